#!/usr/bin/env bash
# Slurm and munge for a machine with no package registry (the GPU machine), from Debian packages
# fetched here: the sbatch scripts then run under a real one-node Slurm there, as on a cluster.
#
#   bash gpu/slurm_kit.sh fetch DIR           # here: apt-get download the packages into DIR
#   bash gpu/slurm_kit.sh unpack DIR PREFIX   # there: dpkg -x each into PREFIX (not /: nothing
#                                               # of the system is overwritten), link slurmstepd
#                                               # where slurmd looks for it, list missing libraries
#   source <(bash gpu/slurm_kit.sh env PREFIX)  # PATH, LD_LIBRARY_PATH and DARL_SLURM_PLUGIN_DIR
#
# Then tests/slurm/local_cluster.py's LocalSlurm(root, nodes=1, gpus=N,
# plugin_dir=$DARL_SLURM_PLUGIN_DIR) starts munged, slurmctld and slurmd with GRES gpu:N, and
# sbatch runs as usual (gpu/slurm_run.sh does all of it in one device call).
# The packages are Debian 12's (Slurm 22.05, munge 0.5.15): the machine needs glibc >= 2.36;
# `unpack` says which libraries the binaries still miss there.
set -euo pipefail
PACKAGES=(slurmctld slurmd slurm-client munge libmunge2 slurm-wlm-basic-plugins libhwloc15 liblua5.1-0
          libjwt0 libfreeipmi17 libipmimonitoring6 librrd8 libdbi1 libhdf5-103-1 libsz2 libaec0 libb64-0d
          libhdf5-hl-100 libxnvctrl0 ocl-icd-libopencl1 libhwloc-plugins)
LIBDIR=usr/lib/x86_64-linux-gnu

case "${1:-}" in
  fetch)
    dir=${2:?usage: slurm_kit.sh fetch DIR}
    mkdir -p "$dir"
    (cd "$dir" && apt-get download "${PACKAGES[@]}")
    du -sh "$dir"
    ;;
  unpack)
    dir=${2:?usage: slurm_kit.sh unpack DIR PREFIX} prefix=${3:?usage: slurm_kit.sh unpack DIR PREFIX}
    mkdir -p "$prefix"
    for deb in "$dir"/*.deb; do dpkg -x "$deb" "$prefix"; done
    # Debian names the daemons *-wlm and links them in its postinst (not run by dpkg -x)
    for d in slurmctld slurmd slurmstepd; do ln -sf "$d-wlm" "$prefix/usr/sbin/$d"; done
    # slurmd starts the step daemon from the path it was built with
    [ -e /usr/sbin/slurmstepd ] || ln -s "$prefix/usr/sbin/slurmstepd-wlm" /usr/sbin/slurmstepd
    export LD_LIBRARY_PATH="$prefix/$LIBDIR/slurm-wlm:$prefix/$LIBDIR:$prefix/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
    for b in usr/sbin/slurmctld usr/sbin/slurmd usr/sbin/slurmstepd usr/sbin/munged usr/bin/sbatch usr/bin/srun; do
      missing=$(ldd "$prefix/$b" 2>&1 | grep "not found" || true)
      [ -n "$missing" ] && echo "slurm_kit: $b misses: $missing"
    done
    "$prefix/usr/sbin/slurmctld" -V
    ;;
  env)
    prefix=${2:?usage: slurm_kit.sh env PREFIX}
    echo "export PATH=$prefix/usr/sbin:$prefix/usr/bin:\$PATH"
    echo "export LD_LIBRARY_PATH=$prefix/$LIBDIR/slurm-wlm:$prefix/$LIBDIR:$prefix/lib/x86_64-linux-gnu:\${LD_LIBRARY_PATH:-}"
    echo "export DARL_SLURM_PLUGIN_DIR=$prefix/$LIBDIR/slurm-wlm"
    ;;
  *)
    sed -n '2,16p' "$0"; exit 2 ;;
esac
