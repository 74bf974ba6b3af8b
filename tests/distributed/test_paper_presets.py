"""The paper's three baselines are three algorithms: naive async, decoupled PPO, D-ARL.

Each preset runs the whole main job on CPU (``experiment=smoke``, one seed, the same warm-started
policy and prompts). From step 1 on the batches mix behavior versions, so the objectives part:
naive async takes the PPO ratio against the engine's log-probs with no weight, decoupled PPO
weights each token by its own behavior ratio, D-ARL by the sequence mixture's. Their losses must
differ at every step from step 1 on. The control that makes "differ" mean something: the run is
deterministic (one worker, whole batches, each step waiting for every start the bound allows
under its version: ``loop.wait_for_bound``), so ``async_is_paper``, verl's name for
decoupled PPO, logs exactly what ``decoupled_paper`` logs. Before the fix ``async_paper`` was that
same objective and logged bit-identical metrics to ``decoupled_paper``.
"""

from __future__ import annotations

import itertools
import json

import pytest

from tests.distributed.test_loop_smoke import run_smoke

STEPS = 5
PRESETS = ("async_paper", "decoupled_paper", "darl_paper", "async_is_paper")


@pytest.fixture(scope="module")
def losses(tmp_path_factory) -> dict[str, list[float]]:
    out = {}
    for preset in PRESETS:
        run_dir = tmp_path_factory.mktemp(preset)
        # no checkpoint between steps: a save's seconds would move when the worker's next batch
        # lands against the trainer's receive, and with it which groups a step gets
        # and each step waits for the bound: what a step receives does not hang on whether the
        # worker's next batch beat the trainer to its receive (under load it did, at step 0)
        proc = run_smoke(run_dir, f"algorithm={preset}", "loop.checkpoint_interval=0", "loop.wait_for_bound=true",
                         steps=STEPS)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["version"] for r in rows] == [float(s + 1) for s in range(STEPS)]
        assert all(r["optimizer_steps"] == 4 for r in rows)  # M = 4 mini-batches
        out[preset] = [r["loss"] for r in rows]
    return out


def test_the_three_baselines_differ_from_step_one_on(losses):
    for a, b in itertools.combinations(("async_paper", "decoupled_paper", "darl_paper"), 2):
        # a step whose groups all had equal rewards (advantages 0) has loss 0 under every
        # objective: it says nothing about the objectives, so it is left out (and counted)
        informative = [s for s in range(1, STEPS) if not losses[a][s] == losses[b][s] == 0.0]
        assert len(informative) >= STEPS - 2, (a, b, losses[a], losses[b])
        same = [s for s in informative if losses[a][s] == losses[b][s]]
        assert not same, f"{a} and {b} logged the same loss at steps {same}: {losses[a]} vs {losses[b]}"


def test_rollout_is_on_async_is_decoupled_ppo_and_the_runs_repeat(losses):
    assert losses["async_is_paper"] == losses["decoupled_paper"]
