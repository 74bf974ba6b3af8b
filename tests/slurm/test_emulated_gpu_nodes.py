"""Emulated nodes on one GPU host (the device recipe for sbatch on 4 GPUs as 2 nodes x gpu:2):
each node's job steps see only its own share of the host's GPUs, though Slurm numbers every
node's GPUs from 0. Fake nvidia<k> character devices stand in for the GPUs (Slurm only opens the
files named in gres.conf); the scheduler, GRES accounting and task prolog are the real ones."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from local_cluster import LocalSlurm, missing_binaries
from slurm_jobs import job_info, wait_state


def test_two_emulated_nodes_split_the_hosts_gpus(tmp_path):
    if missing_binaries() or os.geteuid() != 0:
        pytest.skip("needs Slurm and root (tests/run.sh installs it as root)")
    devices = tmp_path / "dev"
    devices.mkdir()
    for k in range(4):
        os.mknod(devices / f"nvidia{k}", 0o600 | 0o020000, os.makedev(195, k))  # character devices
    root = Path(tempfile.mkdtemp(prefix="emu", dir="/tmp"))  # slurmd's socket paths: <= 108 chars
    cluster = LocalSlurm(root, nodes=2, gpus=2, split_host_gpus=True, gpu_device_dir=str(devices))
    job = tmp_path / "job.sh"
    job.write_text("#!/bin/bash\n" + "".join(
        f"srun --nodes=1 --ntasks=1 -w {node} --gpus-per-node={g} --exact "
        f"bash -c 'echo {node} {g} $CUDA_VISIBLE_DEVICES' > {tmp_path}/{node}_{g}.txt\n"
        for node, g in (("node1", 2), ("node2", 2), ("node2", 1))))
    try:
        cluster.start(timeout=60)
        assert "gpu:2" in cluster.run(["sinfo", "-h", "-N", "-o", "%G"]).stdout
        res = cluster.run(["sbatch", "--parsable", "--nodes=2", "--gpus-per-node=2",
                           f"--output={tmp_path}/out.txt", str(job)])
        assert res.returncode == 0, res.stderr
        job_id = int(res.stdout.strip().split(";")[0])
        try:
            info = wait_state(cluster, job_id, timeout=180, output=tmp_path / "out.txt")
        except AssertionError as err:  # say why Slurm kept it waiting
            nodes = cluster.run(["scontrol", "show", "node", "-o"]).stdout
            ctld = (cluster.root / "log" / "slurmctld.log").read_text()[-3000:]
            raise AssertionError(f"{err}\n{job_info(cluster, job_id)}\n{nodes}\n{ctld}") from None
        assert info["JobState"] == "COMPLETED", info
        seen = {p.stem: p.read_text().split() for p in tmp_path.glob("node*_*.txt")}
        assert seen == {"node1_2": ["node1", "2", "0,1"], "node2_2": ["node2", "2", "2,3"],
                        "node2_1": ["node2", "1", "2"]}
    finally:
        cluster.cancel_all()
        cluster.stop()
        shutil.rmtree(devices, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


def test_a_node_that_dies_at_start_is_named_at_once_with_its_error(tmp_path, monkeypatch):
    # a slurmd that cannot start (here: an option slurmd 22.05 refuses) used to leave the start
    # waiting out its whole timeout with "node1 unknown*"; the GPU machine's cgroup/v2 did so
    if missing_binaries() or os.geteuid() != 0:
        pytest.skip("needs Slurm and root (tests/run.sh installs it as root)")
    root = Path(tempfile.mkdtemp(prefix="bad", dir="/tmp"))
    cluster = LocalSlurm(root, nodes=1)
    write_conf = cluster._write_conf

    def broken_cgroup_conf() -> None:
        write_conf()
        (root / "cgroup.conf").write_text("CgroupPlugin=cgroup/none\n")

    monkeypatch.setattr(cluster, "_write_conf", broken_cgroup_conf)
    try:
        with pytest.raises(RuntimeError, match=r"exited while starting \{'slurmd-node1'") as err:
            cluster.start(timeout=60)
        assert "slurmd-node1: slurmd:" in str(err.value) and "logs in" in str(err.value)
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_the_launchers_one_gpu_steps_share_a_node_at_once(tmp_path):
    # Two engines of one GPU each on a gpu:2 node, in a job of --gpus-per-node=2 (the headline's
    # 2 nodes x gpu:2): every step inherits the job's SLURM_GPUS_PER_NODE, so a step asking only
    # --gpus=1 was given both GPUs and the second engine waited for the first to end (on the GPU
    # host it started after the trainer had finished). The steps use slurm/launch.sh's own GPU
    # option (its gpus function), so the launcher's binding is what is checked.
    if missing_binaries() or os.geteuid() != 0:
        pytest.skip("needs Slurm and root (tests/run.sh installs it as root)")
    launch = (Path(__file__).resolve().parents[2] / "slurm" / "launch.sh").read_text()
    gpus_fn = next(line for line in launch.splitlines() if line.startswith("gpus() {"))
    devices = tmp_path / "dev"
    devices.mkdir()
    for k in range(4):
        os.mknod(devices / f"nvidia{k}", 0o600 | 0o020000, os.makedev(195, k))
    root = Path(tempfile.mkdtemp(prefix="emu", dir="/tmp"))
    cluster = LocalSlurm(root, nodes=2, gpus=2, split_host_gpus=True, gpu_device_dir=str(devices))
    step = "bash -c 'echo $(date +%s.%N) $CUDA_VISIBLE_DEVICES; sleep 6; echo $(date +%s.%N) end'"
    job = tmp_path / "job.sh"
    job.write_text("\n".join([
        "#!/bin/bash", gpus_fn,
        f"srun --exact --nodes=1 --ntasks=2 -w node1 $(gpus 2) {step} > {tmp_path}/trainer.txt &",
        *(f"srun --exact --nodes=1 --ntasks=1 -w node2 $(gpus 1) {step} > {tmp_path}/rollout{w}.txt 2>&1 &"
          for w in range(2)),
        "wait", ""]))
    try:
        cluster.start(timeout=60)
        res = cluster.run(["sbatch", "--parsable", "--nodes=2", "--gpus-per-node=2", "--exclusive",
                           f"--output={tmp_path}/out.txt", str(job)])
        assert res.returncode == 0, res.stderr
        info = wait_state(cluster, int(res.stdout.strip().split(";")[0]), timeout=120, output=tmp_path / "out.txt")
        assert info["JobState"] == "COMPLETED", info
        trainer = [line.split()[1] for line in (tmp_path / "trainer.txt").read_text().splitlines()
                   if not line.endswith(" end")]
        assert trainer == ["0,1", "0,1"]
        rollouts = [(tmp_path / f"rollout{w}.txt").read_text() for w in range(2)]
        assert not any("step creation" in r for r in rollouts), rollouts  # neither waited for a GPU
        started, seen, ended, _ = zip(*(r.split()[-4:] for r in rollouts))
        assert sorted(seen) == ["2", "3"], rollouts  # one GPU each, node2's own
        spans = [(float(a), float(b)) for a, b in zip(started, ended)]
        assert spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1], rollouts  # side by side: they overlap
    finally:
        cluster.cancel_all()
        cluster.stop()
        shutil.rmtree(devices, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
