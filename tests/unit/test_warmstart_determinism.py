"""The warm-start fit's deterministic mode (``launch.warmstart_fit.deterministic_fit``): on a GPU
device it turns on deterministic kernels, SDPA's math kernel and cuBLAS's fixed workspace for
the fit and puts every setting back after it; a CPU fit runs as it always has. (Whether two GPU
machines then fit bitwise the same policy is a GPU measurement: gpu/variant_study.sh's
``weights_digest`` names each fit.)"""

from __future__ import annotations

import os

import pytest
import torch

from launch.warmstart_fit import deterministic_fit


def _state():
    return (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.backends.cudnn.benchmark, torch.backends.cuda.flash_sdp_enabled(),
            torch.backends.cuda.mem_efficient_sdp_enabled(), torch.backends.cuda.math_sdp_enabled())


def test_a_gpu_fit_runs_deterministic_kernels_and_leaves_the_settings_as_it_found_them(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    original = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True  # a setting of the process the fit must not keep
    before = _state()
    try:
        with deterministic_fit(torch.device("cuda")):  # no CUDA call: only settings change
            deterministic, warn_only, benchmark, flash, efficient, math = _state()
            assert deterministic and warn_only and not benchmark
            assert (flash, efficient, math) == (False, False, True)
            assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert _state() == before
        with pytest.raises(RuntimeError, match="fit failed"):
            with deterministic_fit(torch.device("cuda")):
                raise RuntimeError("fit failed")
        assert _state() == before  # put back on the way out of a failed fit too
    finally:
        torch.backends.cudnn.benchmark = original


def test_a_cpu_fit_is_left_as_it_was(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = _state()
    with deterministic_fit(torch.device("cpu")):
        assert _state() == before and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
