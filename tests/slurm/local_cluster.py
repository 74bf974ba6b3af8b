"""A real Slurm cluster on this machine: munged, slurmctld and two emulated slurmd nodes.

Used by ``tests/slurm`` (docs/architecture.md) so the sbatch scripts are exercised by the real
scheduler, not reviewed by eye. Every daemon runs from a private directory with its own
config, and ``stop()`` kills only the processes this object started, by PID.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_darl.ports import free_port, free_port_block

SLURM_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "sacct", "scontrol")


def missing_binaries() -> list[str]:
    """Slurm/munge programs that are not installed (empty when the cluster can start)."""
    search = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    return [b for b in SLURM_BINARIES if shutil.which(b, path=search) is None]


# Slurm numbers a step's GPUs from 0 on every node (a real node's devices); emulated node<i> of a
# shared host owns the host's GPUs from (i-1) x gpus on. A task prolog's "export" lines set the
# task's environment.
TASK_PROLOG = """#!/bin/bash
off=$(( (${{SLURMD_NODENAME#node}} - 1) * {gpus} ))
if [ -n "${{CUDA_VISIBLE_DEVICES:-}}" ]; then
  out=""; for d in ${{CUDA_VISIBLE_DEVICES//,/ }}; do out="$out${{out:+,}}$((d + off))"; done
  echo "export CUDA_VISIBLE_DEVICES=$out"
fi
"""


@dataclass
class LocalSlurm:
    """Start/stop a private Slurm cluster of ``nodes`` emulated nodes rooted at ``root``."""

    root: Path
    nodes: int = 2
    cpus_per_node: int = 2
    memory_mb: int = 8000
    gpus: int = 0  # GRES gpu:N on every node (one real node: /dev/nvidia0..N-1)
    # emulated nodes share one host's GPUs: node i gets the host's GPUs (i-1)*N .. i*N-1, and a
    # task prolog shifts the CUDA_VISIBLE_DEVICES Slurm gives each step (node-local indices 0..N-1)
    # to those, so two emulated nodes of gpu:2 on a 4-GPU host never share a GPU
    split_host_gpus: bool = False
    gpu_device_dir: str = "/dev"  # where the nvidia<k> device files are (tests: fake ones)
    plugin_dir: str = ""  # Slurm's plugins when not where it was built to look (gpu/slurm_kit.sh)
    slurmd_debug: str = ""  # SlurmdDebug (e.g. debug2: slurmstepd logs each pid it signals); "" = info
    procs: dict[str, subprocess.Popen] = field(default_factory=dict, repr=False)  # the daemons started

    @property
    def env(self) -> dict[str, str]:
        """Environment that points Slurm's client commands at this cluster."""
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.root / "slurm.conf")
        env["PATH"] = env.get("PATH", "") + ":/usr/sbin:/sbin"
        return env

    def node_names(self) -> list[str]:
        return [f"node{i + 1}" for i in range(self.nodes)]

    def start(self, timeout: float = 60.0) -> None:
        """Write the configs, start munged, slurmctld and the slurmd nodes; wait until idle."""
        self.root.mkdir(parents=True, exist_ok=True)
        for sub in ("state", "log", "munge", "spool"):
            (self.root / sub).mkdir(exist_ok=True)
        for name in self.node_names():  # slurmd's socket directory (it logs an error without one)
            (self.root / "spool" / f"slurmd.{name}").mkdir(exist_ok=True)
        self._start_munge()
        self._write_conf()
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.root / "slurm.conf")])
        for name in self.node_names():
            self._spawn(
                f"slurmd-{name}",
                ["slurmd", "-D", "-N", name, "-f", str(self.root / "slurm.conf")],
            )
        self._wait_idle(timeout)

    def _start_munge(self) -> None:
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._spawn(
            "munged",
            [
                "munged", "--foreground", "--force", f"--key-file={key}",
                f"--socket={self.root / 'munge' / 'munge.sock'}",
                f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                f"--log-file={self.root / 'log' / 'munged.log'}",
                f"--seed-file={self.root / 'munge' / 'munged.seed'}",
            ],
        )
        deadline = time.time() + 15
        while not (self.root / "munge" / "munge.sock").exists():
            if time.time() > deadline:
                raise RuntimeError(f"munged did not create its socket; see {self.root}/log")
            time.sleep(0.1)

    def _write_conf(self) -> None:
        ctld_port = free_port("0.0.0.0")
        base = free_port_block(self.nodes, "0.0.0.0")  # slurmd of node<i> listens on base + i - 1
        r = self.root
        lines = [
            "ClusterName=darltest",
            "SlurmctldHost=localhost",
            f"SlurmctldPort={ctld_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={r / 'munge' / 'munge.sock'}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}/slurmd.%n",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'spool'}/slurmd.%n.pid",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log'}/slurmd.%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "MpiDefault=none",
            "KillWait=30",  # Slurm's default: time for the trainer to checkpoint after scancel
            "MinJobAge=600",
            "SlurmdTimeout=30",
            "InactiveLimit=0",
            "GresTypes=gpu",
            *([f"TaskProlog={r / 'task_prolog.sh'}"] if self.gpus and self.split_host_gpus else []),
            *([f"PluginDir={self.plugin_dir}"] if self.plugin_dir else []),
            *([f"SlurmdDebug={self.slurmd_debug}"] if self.slurmd_debug else []),
            f"NodeName=node[1-{self.nodes}] NodeHostname=localhost "
            f"Port=[{base}-{base + self.nodes - 1}] CPUs={self.cpus_per_node} "
            f"RealMemory={self.memory_mb}{f' Gres=gpu:{self.gpus}' if self.gpus else ''} State=UNKNOWN",
            f"PartitionName=debug Nodes=node[1-{self.nodes}] Default=YES MaxTime=INFINITE "
            "State=UP OverSubscribe=YES",
        ]
        (r / "slurm.conf").write_text("\n".join(lines) + "\n")
        # slurmd 22.05 loads a cgroup plugin even with proctrack/linuxproc and task/none, and
        # cgroup/v2 (autodetected on a cgroup2-only host such as the GPU machine) fails to start
        # in a container without systemd. cgroup/v1 only reads its mount point when a cgroup
        # plugin uses it, and none does here: so the emulated nodes never touch the host's cgroups.
        (r / "cgroup.conf").write_text(
            f"CgroupPlugin=cgroup/v1\nCgroupAutomount=no\nCgroupMountpoint={r / 'no_cgroups'}\n")
        if self.gpus:  # slurmd reads gres.conf beside slurm.conf
            (r / "gres.conf").write_text(self._gres_conf())
        if self.gpus and self.split_host_gpus:
            prolog = r / "task_prolog.sh"
            prolog.write_text(TASK_PROLOG.format(gpus=self.gpus))
            prolog.chmod(0o755)

    def _gres_conf(self) -> str:
        dev, n = self.gpu_device_dir, self.gpus
        if not self.split_host_gpus:
            return f"Name=gpu File={dev}/nvidia[0-{n - 1}]\n"
        return "".join(f"NodeName={name} Name=gpu File={dev}/nvidia[{i * n}-{(i + 1) * n - 1}]\n"
                       for i, name in enumerate(self.node_names()))

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.stdout", "wb")
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        self.procs[name] = proc

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.time() + timeout
        out = ""
        while time.time() < deadline:
            res = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True,
                env=self.env, timeout=10,
            )
            out = res.stdout
            states = dict(line.split() for line in out.splitlines() if line.strip())
            if len(states) == self.nodes and all(s == "idle" for s in states.values()):
                return
            dead = {name: p.returncode for name, p in self.procs.items() if p.poll() is not None}
            if dead:
                raise RuntimeError(f"Slurm daemon(s) exited while starting {dead}: {self._errors(dead)}; "
                                   f"logs in {self.root}/log")
            time.sleep(0.5)
        raise RuntimeError(f"Slurm nodes not idle after {timeout}s: {out!r}: {self._errors(self.procs)}; "
                           f"logs in {self.root}/log")

    def _errors(self, names) -> str:
        """The last error lines each daemon printed (why a node never came up)."""
        lines = []
        for name in names:
            log = self.root / "log" / f"{name}.stdout"
            text = log.read_text(errors="replace") if log.exists() else ""
            errors = [x.strip() for x in text.splitlines() if "error" in x or "fatal" in x]
            lines += [f"{name}: {x}" for x in errors[-3:]]
        return " | ".join(lines) or "no error lines"

    def run(self, argv: list[str], timeout: float = 60.0) -> subprocess.CompletedProcess:
        """Run a Slurm client command (sbatch, squeue, ...) against this cluster."""
        return subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=timeout)

    def cancel_all(self, timeout: float = 20.0) -> None:
        """SIGKILL every job of this cluster and wait until none is left (job steps run under
        slurmstepd in sessions of their own: killing the daemons would leave them running)."""
        if "slurmctld" not in self.procs:
            return
        try:
            ids = self.run(["squeue", "-h", "-o", "%A"], timeout=10).stdout.split()
            if ids:
                self.run(["scancel", "--signal=KILL", "--full", *ids], timeout=10)
                self.run(["scancel", *ids], timeout=10)
            deadline = time.time() + timeout
            while time.time() < deadline and self.run(["squeue", "-h"], timeout=10).stdout.strip():
                time.sleep(0.5)
        except (OSError, subprocess.TimeoutExpired):
            pass

    def stop(self) -> None:
        """Cancel the cluster's jobs, then kill the daemons this object started (and their
        process groups), by PID."""
        self.cancel_all()
        for proc in reversed(list(self.procs.values())):
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
        deadline = time.time() + 10
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)
        self.procs.clear()
