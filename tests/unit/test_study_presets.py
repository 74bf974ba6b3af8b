"""The variants the study reports are presets: ``algorithm=<name>`` composes each one alone.

``darl_once`` (D-ARL without replay) and ``async_is`` (naive async with rollout IS) are named in
docs/results.md; each must be its own ``configs/algorithm`` preset, equal to its base preset but
for the one setting that makes it, and the study (``benchmarks/variant_study.py``) must run the
preset rather than rebuild it from overrides.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from benchmarks.variant_study import CASES
from launch.config import load_run_config

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("preset, base, changed", [
    ("darl_once", "darl", {("replay", "max_replays"): 1}),
    ("async_is", "async", {("algorithm", "rollout_is"): 2.0}),
])
def test_a_derived_preset_is_its_base_but_for_one_setting(preset, base, changed):
    got, want = load_run_config([f"algorithm={preset}"]), load_run_config([f"algorithm={base}"])
    for (section, name), value in changed.items():
        assert getattr(getattr(got, section), name) == value != getattr(getattr(want, section), name)
        setattr(getattr(want, section), name, value)
    assert dataclasses.asdict(got) == dataclasses.asdict(want)


def test_every_study_case_named_in_the_results_is_a_preset_the_study_runs():
    text = (REPO / "docs" / "results.md").read_text()
    named = {c for c in CASES if re.search(rf"`{c}`", text)} | {"sync", "async", "darl", "darl_once",
                                                                 "decoupled", "async_is"}
    for case in sorted(named):
        preset, extra, _ = CASES[case]
        assert preset == case and (REPO / "configs" / "algorithm" / f"{case}.yaml").is_file(), case
        # what a case adds is the study's setting, never the variant itself
        assert not any(o.startswith(("replay.max_replays", "algorithm.rollout_is", "algorithm.variant"))
                       for o in extra), (case, extra)
