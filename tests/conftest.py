"""Test tiers: each test gets the marker of its folder, and GPU tests skip without a GPU."""

from pathlib import Path

import pytest

_TIERS = {"unit", "distributed", "slurm", "gpu", "faults"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = Path(str(item.fspath)).parent.name
        if tier in _TIERS:
            item.add_marker(getattr(pytest.mark, tier))
        if tier == "gpu":
            import torch

            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (tests/gpu tier)"))
