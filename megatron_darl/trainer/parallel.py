"""Process groups for the Megatron trainer, built once and passed around as one object.

``init_parallel`` initialises ``torch.distributed`` (NCCL on GPU, gloo on CPU), Megatron's
``parallel_state`` (Megatron's own modules still read it underneath) and its RNG tracker, and
returns a ``ParallelState`` holding this rank's coordinates and the TP/PP/DP/embedding groups.
New code takes a ``ParallelState`` argument instead of reading Megatron's globals.

``run_local_gloo`` spawns a small gloo world on this machine; the converters and the
distributed tests use it to run the same code at TP x PP > 1 without a launcher.
"""

from __future__ import annotations

import datetime
import inspect
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_darl.ports import free_port
from megatron_darl.trainer.config import ParallelConfig
from megatron_darl.trainer.cpu_compat import apply_cpu_compat, import_megatron


@dataclass
class ParallelState:
    """This rank's place in the TP x PP x DP grid and the groups to talk to its peers."""

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    device: torch.device
    tp_group: Any = field(repr=False)  # torch.distributed.ProcessGroup
    pp_group: Any = field(repr=False)
    dp_group: Any = field(repr=False)
    dp_group_gloo: Any = field(repr=False)  # gloo group over the same DP ranks (CPU objects)
    embedding_group: Any = field(repr=False)  # first and last PP stage (tied embeddings)
    model_parallel_group: Any = field(repr=False)  # TP x PP of one DP replica
    pg_collection: Any = field(repr=False)  # megatron ProcessGroupCollection (for Megatron APIs)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def on_cpu(self) -> bool:
        return self.device.type == "cpu"

    @property
    def is_hub(self) -> bool:
        """The replica's first rank (TP 0, PP 0): it holds the replica's replay state and hub."""
        return self.tp_rank == 0 and self.pp_rank == 0

    def dp_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a CPU tensor over this rank's DP group in place (gloo); identity at DP 1."""
        if self.dp_size > 1:
            dist.all_reduce(tensor, group=self.dp_group_gloo)
        return tensor

    def dp_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """Elementwise max of a CPU tensor over this rank's DP group in place; identity at DP 1."""
        if self.dp_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.dp_group_gloo)
        return tensor


def validate_layout(cfg: ParallelConfig, world_size: int) -> int:
    """Return the DP size, or raise ``ValueError`` if TP x PP does not divide the world."""
    if world_size % (cfg.tp * cfg.pp) != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by tp*pp = {cfg.tp}*{cfg.pp}"
        )
    return world_size // (cfg.tp * cfg.pp)


def init_parallel(
    cfg: ParallelConfig,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
) -> ParallelState:
    """Initialise torch.distributed (if needed), Megatron parallel state and RNG.

    Args:
        cfg: the layout.
        rank, world_size, init_method: passed to ``init_process_group`` when it has not been
            called yet (otherwise the existing default group is reused, e.g. after
            ``destroy_parallel(keep_default_group=True)``); ``None`` lets torch read
            ``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` itself (``env://``), as set by torchrun,
            srun wrappers or ``run_local_gloo``.

    Returns:
        The ``ParallelState`` of this rank. On CPU, ``cpu_compat`` is applied first.
    """
    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        import_megatron()  # without its import-time torch.compile wrappers (cpu_compat)
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if not on_cpu else "gloo")
    if on_cpu == (backend == "nccl"):
        raise ValueError(
            f"ParallelConfig.backend={cfg.backend!r} with CUDA "
            f"{'unavailable' if on_cpu else 'available'}: use nccl on GPU, gloo on CPU (hide "
            "GPUs with CUDA_VISIBLE_DEVICES= for a CPU run)"
        )
    if on_cpu:
        apply_cpu_compat()
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    if not dist.is_initialized():
        given = dict(rank=rank, world_size=world_size, init_method=init_method)
        dist.init_process_group(
            backend=backend, timeout=timeout, **{k: v for k, v in given.items() if v is not None}
        )
    world = dist.get_world_size()
    dp_size = validate_layout(cfg, world)
    if not on_cpu:
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    mp_kwargs = dict(
        tensor_model_parallel_size=cfg.tp,
        pipeline_model_parallel_size=cfg.pp,
        distributed_timeout_minutes=max(1, int(cfg.timeout_s // 60)),
    )
    known = inspect.signature(mpu.initialize_model_parallel).parameters
    mpu.initialize_model_parallel(**{k: v for k, v in mp_kwargs.items() if k in known})
    _seed_megatron_rng(tensor_parallel, cfg.seed, on_cpu)
    return _state_from_mpu(mpu, device, dp_size)


def init_single_process(cfg: ParallelConfig | None = None) -> ParallelState:
    """``init_parallel`` for a world of one (benchmarks, notebooks, single-GPU tests)."""
    cfg = cfg or ParallelConfig()
    return init_parallel(cfg, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")


def _seed_megatron_rng(tensor_parallel, seed: int, on_cpu: bool) -> None:
    torch.manual_seed(seed)
    # On CPU there is no CUDA generator to fork: the inference tracker makes fork() a no-op
    # (dropout is 0 for our models, and weights come from checkpoints or CPU init).
    seed_fn = tensor_parallel.model_parallel_cuda_manual_seed
    if "inference_rng_tracker" in inspect.signature(seed_fn).parameters:
        seed_fn(seed, inference_rng_tracker=on_cpu)
    else:  # older megatron-core: no tracker choice (CPU runs then need a CUDA-free fork)
        seed_fn(seed)


def _state_from_mpu(mpu, device: torch.device, dp_size: int) -> ParallelState:
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ParallelState(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        tp_size=mpu.get_tensor_model_parallel_world_size(),
        pp_rank=mpu.get_pipeline_model_parallel_rank(),
        pp_size=mpu.get_pipeline_model_parallel_world_size(),
        dp_rank=mpu.get_data_parallel_rank(),
        dp_size=dp_size,
        device=device,
        tp_group=mpu.get_tensor_model_parallel_group(),
        pp_group=mpu.get_pipeline_model_parallel_group(),
        dp_group=mpu.get_data_parallel_group(),
        dp_group_gloo=mpu.get_data_parallel_group_gloo(),
        embedding_group=mpu.get_embedding_group(),
        model_parallel_group=mpu.get_model_parallel_group(),
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )


def destroy_parallel(keep_default_group: bool = False) -> None:
    """Tear down Megatron's parallel state and (unless kept) the default process group.

    Idempotent. With ``keep_default_group`` the same processes can call ``init_parallel``
    again with another TP/PP layout (the layout tests do this to avoid re-spawning).
    """
    from megatron.core import parallel_state as mpu

    mpu.destroy_model_parallel()
    if dist.is_initialized() and not keep_default_group:
        dist.destroy_process_group()


def _local_worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
    )
    # Each rank gets a fair share of the machine; gloo ranks fight over cores otherwise.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        fn(rank, world_size, *args)
    finally:
        try:
            destroy_parallel()
        except Exception:  # noqa: BLE001 - teardown must not mask the real error
            pass


class LocalWorkerError(RuntimeError):
    """A worker of ``run_local_gloo`` raised; the message is the worker's last error line."""

    details: str = ""


def run_local_gloo(fn: Callable, world_size: int, args: tuple = (), timeout_s: float = 600.0):
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes on this host.

    ``fn`` must be importable (a module-level function). The workers find each other through
    ``MASTER_ADDR``/``MASTER_PORT`` env vars set here, so ``fn`` calls ``init_parallel`` with
    no rendezvous arguments. Raises ``RuntimeError`` if any worker fails or times out (all
    workers are then terminated); ``LocalWorkerError`` carries the worker's traceback.
    """
    import torch.multiprocessing as mp

    ctx = mp.start_processes(
        _local_worker, args=(world_size, free_port(), fn, args), nprocs=world_size,
        join=False, start_method="spawn",
    )
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
    try:
        while not ctx.join(timeout=1.0):
            if datetime.datetime.now() > deadline:
                raise RuntimeError(f"local gloo run of {fn.__name__} timed out after {timeout_s}s")
    except mp.ProcessRaisedException as exc:
        err = LocalWorkerError(str(exc).strip().splitlines()[-1])
        err.details = str(exc)  # the worker's full traceback
        raise err from None
    except mp.ProcessExitedException as exc:
        raise RuntimeError(f"a worker of {fn.__name__} exited: {exc}") from None
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
