"""The Slurm launcher's knobs and where each role runs in the allocation: pure and import-light.

``Knobs`` is the typed form of the environment variables documented at the top of
``slurm/launch.sh`` (read here once, validated with one-line errors naming the variable). They
speak the run config's vocabulary: ``TRAINER_*`` and ``ROLLOUT_*`` for the two sides of the split
(``cluster.trainer_*``, ``cluster.rollout_*``), ``MODEL``/``ALGORITHM``/``DATA``/``ROLLOUT``/``TRAINER``
for the groups ``python -m launch.train --help`` lists; ``launch.slurm.cluster_overrides`` is the
one place the layout becomes ``cluster.*``. A name of ``RENAMED`` is not a knob: set, it fails
with one line naming the knob it means.

``plan_layout`` turns them and the allocation's node names into a ``Layout``: which nodes the
trainer step spans with how many tasks, CPUs and GPUs each, and the node of every rollout
worker (one engine per ``ROLLOUT_TP`` GPUs; on CPU one per node). Kept apart from
``launch.slurm`` so that a bad knob fails in a fraction of a second, before torch is imported.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

ROLLOUTS = ("", "hf", "vllm")
DTYPES = ("fp32", "bf16")
# Spellings outside the vocabulary and the knob each means (set one: a one-line error naming it).
RENAMED = {"TRAIN_NODES": "TRAINER_NODES", "TRAIN_GPUS_PER_NODE": "TRAINER_GPUS_PER_NODE", "ENGINE": "ROLLOUT"}


def _int(env: Mapping[str, str], name: str, default: Optional[int], minimum: int = 0) -> Optional[int]:
    raw = env.get(name, "").strip()
    if raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return value


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if raw == "":
        return default
    if raw not in ("0", "1", "true", "false", "yes", "no"):
        raise ValueError(f"{name}={raw!r}: use 1 or 0")
    return raw in ("1", "true", "yes")


def _path(env: Mapping[str, str], name: str, base: Path) -> str:
    raw = env.get(name, "").strip()
    if not raw:
        return ""
    path = Path(raw).expanduser()
    return str(path if path.is_absolute() else (base / path).resolve())


def gpus_from_slurm(env: Mapping[str, str]) -> int:
    """GPUs per node of the allocation: SLURM_GPUS_ON_NODE, else SLURM_GPUS_PER_NODE (``h100:8``)."""
    for name in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        raw = env.get(name, "").strip()
        if raw:
            try:
                return int(raw.rsplit(":", 1)[-1].split("(")[0])
            except ValueError:
                continue
    return 0


@dataclass
class Knobs:
    """The launcher's environment knobs (see ``slurm/launch.sh`` for the user-facing list)."""

    output_dir: str  # OUTPUT_DIR: run dir (metrics, checkpoints, logs); resume key
    model: str = "tiny"  # MODEL: configs/model preset, or "tiny" (embedded default policy)
    model_path: str = ""  # MODEL_PATH: Hugging Face checkpoint directory of the initial policy
    algorithm: str = "darl"  # ALGORITHM: configs/algorithm preset
    data: str = ""  # DATA: configs/data preset ("" = gsm8k for Qwen3, builtin for tiny)
    data_path: str = ""  # DATA_PATH: dataset file replacing the preset's path
    rollout: str = ""  # ROLLOUT: rollout preset vllm|hf ("" = vllm on GPU nodes, hf on a CPU run)
    trainer: str = ""  # TRAINER: configs/trainer preset ("" = default on GPU, cpu_tiny on CPU)
    trainer_nodes: Optional[int] = None  # TRAINER_NODES: nodes of the trainer step
    rollout_nodes: Optional[int] = None  # ROLLOUT_NODES: nodes of rollout engines; 0 = share
    gpus_per_node: int = 0  # GPUS_PER_NODE: GPUs per node (0 = CPU run)
    trainer_gpus_per_node: int = 0  # TRAINER_GPUS_PER_NODE: trainer share when ROLLOUT_NODES=0
    tp: int = 1  # TP: trainer tensor-parallel size
    pp: int = 1  # PP: trainer pipeline-parallel size
    rollout_tp: int = 1  # ROLLOUT_TP: GPUs per rollout engine (vLLM tensor parallel)
    threads: int = 0  # THREADS: torch/OMP threads per process; 0 = CPUs per task (1 on CPU)
    convert: bool = False  # CONVERT: convert MODEL_PATH to a Megatron checkpoint first (cached)
    convert_cache: str = "~/.cache/megatron_darl/converted"  # CONVERT_CACHE
    convert_dtype: str = "fp32"  # CONVERT_DTYPE: fp32 or bf16
    resume: bool = True  # RESUME: continue from OUTPUT_DIR's latest checkpoint when there is one
    master_port: int = 0  # TRAINER_PORT: torch.distributed port of the trainer; 0 = pick
    control_port: int = 0  # STORE_PORT: control-plane store port; 0 = pick

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "Knobs":
        """Read and check every knob; paths relative to the submit directory become absolute."""
        for old, new in RENAMED.items():
            if env.get(old, "").strip():
                raise ValueError(f"{old} is now {new}: set {new}={env[old].strip()} (and unset {old})")
        base = Path(env.get("SLURM_SUBMIT_DIR") or os.getcwd())
        output_dir = _path(env, "OUTPUT_DIR", base)
        if not output_dir:
            raise ValueError("OUTPUT_DIR is empty (slurm/launch.sh sets a default)")
        knobs = cls(
            output_dir=output_dir, model=env.get("MODEL", "").strip() or "tiny",
            model_path=_path(env, "MODEL_PATH", base), algorithm=env.get("ALGORITHM", "").strip() or "darl",
            data=env.get("DATA", "").strip(), data_path=_path(env, "DATA_PATH", base),
            rollout=env.get("ROLLOUT", "").strip(), trainer=env.get("TRAINER", "").strip(),
            trainer_nodes=_int(env, "TRAINER_NODES", None, 1), rollout_nodes=_int(env, "ROLLOUT_NODES", None, 0),
            gpus_per_node=_int(env, "GPUS_PER_NODE", gpus_from_slurm(env), 0),
            trainer_gpus_per_node=_int(env, "TRAINER_GPUS_PER_NODE", 0, 0),
            tp=_int(env, "TP", 1, 1), pp=_int(env, "PP", 1, 1), rollout_tp=_int(env, "ROLLOUT_TP", 1, 1),
            threads=_int(env, "THREADS", 0, 0), convert=_flag(env, "CONVERT", False),
            convert_cache=_path(env, "CONVERT_CACHE", base) or str(Path(cls.convert_cache).expanduser()),
            convert_dtype=env.get("CONVERT_DTYPE", "").strip() or "fp32", resume=_flag(env, "RESUME", True),
            master_port=_int(env, "TRAINER_PORT", 0, 0), control_port=_int(env, "STORE_PORT", 0, 0),
        )
        if not knobs.data and knobs.model != "tiny":
            knobs.data = "gsm8k"
        if not knobs.trainer and knobs.gpus_per_node > 0:
            knobs.trainer = "default"
        if not knobs.rollout:  # vLLM is the production engine; a CPU run has only hf
            knobs.rollout = "vllm" if knobs.gpus_per_node > 0 else "hf"
        knobs.validate()
        return knobs

    def validate(self) -> None:
        """One-line ``ValueError`` naming the knob for paths that do not exist and bad choices."""
        if self.model_path:
            path = Path(self.model_path)
            if not path.is_dir():
                raise ValueError(f"MODEL_PATH={path}: no such directory")
            if not (path / "config.json").is_file():
                raise ValueError(f"MODEL_PATH={path} is not a Hugging Face model directory (no config.json)")
        if self.data_path and not Path(self.data_path).is_file():
            raise ValueError(f"DATA_PATH={self.data_path}: no such file")
        if self.rollout not in ROLLOUTS:
            raise ValueError(f"ROLLOUT={self.rollout!r}: use hf or vllm")
        if self.convert_dtype not in DTYPES:
            raise ValueError(f"CONVERT_DTYPE={self.convert_dtype!r}: use one of {DTYPES}")
        if self.convert and not self.model_path:
            raise ValueError("CONVERT=1 needs MODEL_PATH (a Hugging Face directory to convert)")


@dataclass
class Layout:
    """Where the roles run: one trainer step over ``trainer_nodes``, one step per rollout worker."""

    nodes: list[str]  # the allocation, batch host first
    trainer_nodes: list[str]  # nodes of the trainer step (rank 0 on the first)
    worker_nodes: list[str]  # node of each rollout worker; the worker id is the index
    trainer_tasks_per_node: int  # Megatron ranks per trainer node
    trainer_gpus_per_node: int  # GPUs of the trainer step per node (0 on CPU)
    worker_gpus: int  # GPUs per rollout worker (engine TP; 0 on CPU)
    trainer_cpus_per_task: int  # srun --cpus-per-task of the trainer step
    worker_cpus_per_task: int  # srun --cpus-per-task of each rollout step
    threads: int  # torch/OMP threads per process
    colocated: bool  # rollout engines share the trainer nodes (ROLLOUT_NODES=0)

    @property
    def trainer_ranks(self) -> int:
        return len(self.trainer_nodes) * self.trainer_tasks_per_node

    @property
    def workers(self) -> int:
        return len(self.worker_nodes)

    @property
    def rollout_node_count(self) -> int:
        return 0 if self.colocated else len(set(self.worker_nodes))

    def shell_values(self) -> dict:
        """The plan variables ``slurm/launch.sh`` uses to start the job steps."""
        return {"TRAINER_NODELIST": ",".join(self.trainer_nodes), "TRAINER_NODES": len(self.trainer_nodes),
                "TRAINER_TASKS_PER_NODE": self.trainer_tasks_per_node, "TRAINER_RANKS": self.trainer_ranks,
                "TRAINER_GPUS_PER_NODE": self.trainer_gpus_per_node,
                "TRAINER_CPUS_PER_TASK": self.trainer_cpus_per_task,
                "ROLLOUT_WORKER_NODES": list(self.worker_nodes), "ROLLOUT_WORKER_GPUS": self.worker_gpus,
                "ROLLOUT_WORKER_CPUS_PER_TASK": self.worker_cpus_per_task,
                "THREADS": self.threads}


def _split_nodes(knobs: Knobs, n: int) -> tuple[int, int]:
    """(trainer nodes, rollout nodes) of an ``n``-node allocation; rollout 0 = colocated."""
    rollout = knobs.rollout_nodes if knobs.rollout_nodes is not None else n // 2
    train = knobs.trainer_nodes if knobs.trainer_nodes is not None else max(n - rollout, 1)
    if rollout == 0 and train != n:
        raise ValueError(f"TRAINER_NODES={train} with ROLLOUT_NODES=0 (shared nodes) must equal the "
                         f"allocation's {n} node(s) (sbatch --nodes)")
    if rollout > 0 and train + rollout != n:
        raise ValueError(f"TRAINER_NODES={train} + ROLLOUT_NODES={rollout} must equal the allocation's "
                         f"{n} node(s) (sbatch --nodes), or set ROLLOUT_NODES=0 to share the trainer nodes")
    return train, rollout


def _gpu_split(knobs: Knobs, colocated: bool) -> tuple[int, int]:
    """(trainer GPUs, engines) per node on GPU; (1 task, 1 engine) on CPU."""
    g = knobs.gpus_per_node
    if g == 0:
        return 1, 1
    train_gpus, rollout_gpus = g, g
    if colocated:
        train_gpus = knobs.trainer_gpus_per_node or g // 2
        if not 0 < train_gpus < g:
            raise ValueError(f"ROLLOUT_NODES=0 shares each node's {g} GPU(s) between trainer and "
                             f"engines: TRAINER_GPUS_PER_NODE={train_gpus} must be in 1..{g - 1}")
        rollout_gpus = g - train_gpus
    if rollout_gpus % knobs.rollout_tp:
        raise ValueError(f"ROLLOUT_TP={knobs.rollout_tp} must divide the {rollout_gpus} rollout GPU(s) per node")
    return train_gpus, rollout_gpus // knobs.rollout_tp


def plan_layout(knobs: Knobs, nodes: list[str], batch_host: str = "", cpus_on_node: int = 0) -> Layout:
    """Lay the roles out on ``nodes`` (the trainer starts on ``batch_host``, where ports are picked)."""
    if not nodes:
        raise ValueError("SLURM_JOB_NODELIST is empty: run slurm/launch.sh inside an sbatch allocation")
    if batch_host in nodes:
        nodes = [batch_host] + [n for n in nodes if n != batch_host]
    train_n, rollout_n = _split_nodes(knobs, len(nodes))
    colocated = rollout_n == 0
    tasks, engines = _gpu_split(knobs, colocated)
    train = nodes[:train_n]
    rollout = train if colocated else nodes[train_n:]
    ranks, mp = train_n * tasks, knobs.tp * knobs.pp
    if ranks % mp:
        raise ValueError(f"TP={knobs.tp} x PP={knobs.pp} must divide the {ranks} trainer rank(s) "
                         f"(TRAINER_NODES={train_n} x {tasks} per node)")
    on_train_node = tasks + (engines if colocated else 0)
    on_rollout_node = on_train_node if colocated else engines
    if knobs.gpus_per_node:
        cpus_t = max(1, cpus_on_node // on_train_node) if cpus_on_node else 1
        cpus_w = max(1, cpus_on_node // on_rollout_node) if cpus_on_node else 1
    else:  # CPU runs are smoke tests: one CPU and one thread per process
        cpus_t = cpus_w = 1
    need = max(on_train_node * cpus_t, on_rollout_node * cpus_w)
    if cpus_on_node and need > cpus_on_node:
        raise ValueError(f"the layout needs {need} CPUs per node but the allocation has {cpus_on_node} "
                         "(submit with --exclusive, or fewer tasks per node)")
    return Layout(
        nodes=list(nodes), trainer_nodes=train, worker_nodes=[n for n in rollout for _ in range(engines)],
        trainer_tasks_per_node=tasks, trainer_gpus_per_node=tasks if knobs.gpus_per_node else 0,
        worker_gpus=knobs.rollout_tp if knobs.gpus_per_node else 0, trainer_cpus_per_task=cpus_t,
        worker_cpus_per_task=cpus_w, threads=knobs.threads or cpus_t, colocated=colocated,
    )
