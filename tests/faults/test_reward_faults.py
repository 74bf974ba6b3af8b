"""Hostile inputs to the math reward: a malformed reference in a dataset, a crafted answer.

The dataset is a real jsonl file read by the real loader; the runtime error goes through the
real reward thread pool path (a helper process) and the real heartbeat to the trainer's side.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megatron_darl import counters
from megatron_darl.data.config import DataConfig, FieldMapConfig
from megatron_darl.data.loaders import MalformedRowError, load_records
from megatron_darl.rewards.registry import get_reward_fn
from megatron_darl.rewards.references import reference_check
from megatron_darl.data.records import PromptRecord

REPO = Path(__file__).resolve().parents[2]


def _dataset(tmp_path: Path, answers: list[str]) -> DataConfig:
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": a}) + "\n" for i, a in enumerate(answers)))
    return DataConfig(name="gsm8k", task="gsm8k", source="file", path=str(path),
                      fields=FieldMapConfig(prompt="question", reference="answer"))


@pytest.mark.fault(kind="input", name="malformed math reference in a dataset row")
@pytest.mark.parametrize("bad", ["Natalia sold 48 clips ####", "####   "])
def test_a_malformed_math_reference_is_named_at_load_time(tmp_path, bad, fault_record):
    """Loading stops with an error naming the file, the line and the field (or skips and counts the row when asked)."""
    cfg = _dataset(tmp_path, ["She has 3 #### 3", bad, "#### 1,000"])
    with pytest.raises(MalformedRowError) as err:
        load_records(cfg, reference_check(cfg.task))
    assert f"{cfg.path}:2: field 'answer': math reference has no answer" in str(err.value)
    cfg.skip_malformed = True
    result = load_records(cfg, reference_check(cfg.task))
    assert [r.reference for r in result.records] == ["She has 3 #### 3", "#### 1,000"]
    assert result.skipped == 1 and result.skipped_lines == [2]
    fault_record["observed"] = f"MalformedRowError: '{err.value}'"[:200]


@pytest.mark.fault(kind="input", name="unparseable math reference at run time (reward thread)")
def test_an_unparseable_reference_at_run_time_is_a_counted_error_not_a_crash(fault_record):
    """The reward is 0.0, the error is logged and counted, and the count reaches the trainer through the heartbeat."""
    from megatron_darl.transport import (
        TRAINER, WORKER, ControlPlaneConfig, Heartbeat, HeartbeatConfig, MemberInfo, serve_store,
    )
    from tests.distributed.procs.launcher import free_port, wait_for

    reward = get_reward_fn("gsm8k")
    record = PromptRecord(0, "q", [], "gsm8k", "the answer is #### ")  # passed no load-time check
    before = counters.snapshot().get(counters.REWARD_ERRORS, 0)
    with ThreadPoolExecutor(2) as pool:  # as the rollout worker scores: off the main thread
        scores = list(pool.map(lambda text: reward(record, text), ["#### 3", "\\boxed{3}"]))
    assert scores == [0.0, 0.0]
    assert counters.snapshot()[counters.REWARD_ERRORS] == before + 2
    control = ControlPlaneConfig(port=free_port(), store_timeout_s=10)
    store = serve_store(control)
    cfg = HeartbeatConfig(interval_s=0.05, timeout_s=1.0)
    trainer = Heartbeat(control, cfg, MemberInfo.here(TRAINER, 0), watch=[(WORKER, 0)]).start()
    worker = Heartbeat(control, cfg, MemberInfo.here(WORKER, 0)).start()
    try:
        wait_for(lambda: trainer.peer_counters()[counters.REWARD_ERRORS] >= before + 2, 5,
                 "the count in the trainer's view")
    finally:
        worker.close(), trainer.close(), store.close()
    fault_record["observed"] = "both responses scored 0.0; reward_errors +2 in the worker and in the trainer's metrics"
    fault_record["lost"] = "the two samples' rewards (scored 0.0, counted)"


_CRAFTED = """
import sys, time
from megatron_darl.rewards.math_answer import math_reward
from concurrent.futures import ThreadPoolExecutor
answer = "#### 1" + " " * 200_000 + "x"  # quadratic for the old regex: ~300 s
t = time.monotonic()
inline = math_reward(answer, "#### 1")
with ThreadPoolExecutor(1) as pool:
    threaded = pool.submit(math_reward, answer, "#### 1").result()
print(inline, threaded, round(time.monotonic() - t, 2))
"""


@pytest.mark.fault(kind="input", name="crafted 200 kB answer (regex backtracking bomb)")
def test_a_crafted_long_answer_is_scored_within_the_deadline(fault_record):
    """Scoring a 200 kB crafted answer finishes well inside the reward deadline, inline and from a reward thread."""
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", _CRAFTED], cwd=REPO, capture_output=True, text=True,
                         timeout=30, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    inline, threaded, seconds = out.stdout.split()
    assert (inline, threaded) == ("0.0", "0.0")  # "1" + spaces + "x" is not the answer 1
    fault_record["observed"] = (f"scored 0.0 both ways in {float(seconds):.2f} s (process {time.monotonic() - t0:.1f} s "
                                "with imports); the old regex took ~125 s on 130 kB")
