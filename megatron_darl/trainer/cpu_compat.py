"""Make Megatron-core run on a CPU-only torch build, for CI and the embedded (no GPU) mode.

Megatron-core assumes CUDA everywhere: it allocates with ``device=torch.cuda.current_device()``,
checks ``tensor.type() == "torch.cuda.FloatTensor"``, synchronises streams and times with CUDA
events. None of that is needed for correctness with gloo on CPU, so this module patches the
few entry points once per process and installs a ``TorchFunctionMode`` that rewrites CUDA device
arguments to CPU. It is only imported (by ``megatron_darl.trainer.parallel``) when no GPU is
used; the GPU path never touches it.

Megatron is imported here too, on CPU, with ``torch.compile`` a no-op decorator
(``import_megatron``): Megatron wraps its fused kernels in ``torch.compile`` at import, and the
wrapping alone imports inductor, about 2.5 s of the 4.5 s Megatron import that every CPU trainer
process pays. Those kernels are the fusions a CPU run switches off
(``transformer_config_from_hf(on_cpu=True)``); one called anyway runs eagerly.

Caveat: torch function modes are *thread-local*. ``apply_cpu_compat()`` enters the mode on the
calling thread only; a worker thread that allocates Megatron tensors must call
``enter_cpu_device_mode()`` itself.
"""

from __future__ import annotations

import contextlib
import sys
import threading

import torch
from torch.overrides import TorchFunctionMode

_PATCHED = False
_LOCAL = threading.local()
_CPU = torch.device("cpu")


def _is_cuda_device(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int is how Megatron passes torch.cuda.current_device() as a device.
    return isinstance(device, int) and not isinstance(device, bool)


def _cpu_type_name(name: str) -> str:
    return name.replace("torch.cuda.", "torch.")


class CpuDeviceMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU and makes ``Tensor.type()`` report CUDA names."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = _CPU
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if func is torch.Tensor.to:
            args = tuple(_CPU if _is_cuda_device(a) else a for a in args)
        if func is torch.Tensor.type:
            return self._type(args, kwargs)
        return func(*args, **kwargs)

    @staticmethod
    def _type(args, kwargs):
        tensor = args[0]
        target = args[1] if len(args) > 1 else kwargs.pop("dtype", None)
        if target is None:
            # Megatron compares against "torch.cuda.*Tensor" names; report what it expects.
            return torch.Tensor.type(tensor).replace("torch.", "torch.cuda.", 1)
        if isinstance(target, str):
            target = _cpu_type_name(target)
        return torch.Tensor.type(tensor, target, **kwargs)


class _DummyStream:
    """Stands in for ``torch.cuda.Stream``: every operation is already ordered on CPU."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        return None

    def wait_event(self, *args, **kwargs):
        return None

    def synchronize(self):
        return None

    def record_event(self, *args, **kwargs):
        return _DummyEvent()


class _DummyEvent:
    """Stands in for ``torch.cuda.Event``; timings read as zero."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        return None

    def wait(self, *args, **kwargs):
        return None

    def synchronize(self):
        return None

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def enter_cpu_device_mode() -> None:
    """Enter the device-rewriting mode on the calling thread (idempotent per thread)."""
    if getattr(_LOCAL, "stack", None) is None:
        stack = contextlib.ExitStack()
        stack.enter_context(CpuDeviceMode())
        _LOCAL.stack = stack


def import_megatron() -> None:
    """Import ``megatron.core`` with ``torch.compile`` a no-op decorator (once per process; a
    process that imported Megatron already keeps what it has)."""
    if "megatron.core" in sys.modules:
        return
    real = torch.compile

    def no_compile(model=None, **kwargs):
        return model if model is not None else (lambda fn: fn)

    torch.compile = no_compile
    try:
        import megatron.core  # noqa: F401
    finally:
        torch.compile = real


def apply_cpu_compat() -> None:
    """Patch ``torch.cuda`` entry points Megatron calls, once per process, and enter the mode.

    Safe to call many times. Must not be called when a GPU is used.
    """
    global _PATCHED
    if torch.cuda.is_available():
        raise RuntimeError("apply_cpu_compat() is for CPU-only runs; a CUDA device is visible")
    if not _PATCHED:
        torch.cuda.current_device = lambda: 0
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.empty_cache = lambda: None
        torch.cuda.set_device = lambda *a, **k: None
        torch.cuda.device_count = lambda: 0
        torch.cuda.Stream = _DummyStream
        torch.cuda.Event = _DummyEvent
        torch.cuda.current_stream = lambda *a, **k: _DummyStream()
        torch.cuda.default_stream = lambda *a, **k: _DummyStream()
        torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
        torch.cuda.memory_allocated = lambda *a, **k: 0
        torch.cuda.max_memory_allocated = lambda *a, **k: 0
        _PATCHED = True
    enter_cpu_device_mode()
