"""Cost of the code sandbox: milliseconds per execution and executions per second.

Every HumanEval / stdin-stdout reward is one sandboxed run, so the sandbox's fixed cost (start
an interpreter, build the isolation, tear it down) bounds how fast code tasks can be scored on a
rollout node. This script times, on CPU:

- ``trivial``: ``run_sandboxed("pass")``, the pure overhead of one execution;
- ``humaneval``: ``humaneval_reward`` on a HumanEval-style record with a correct solution (the
  program defines the function, the record's ``check`` calls it a few times);
- ``throughput``: ``--parallel`` threads scoring that record back to back (each run is its own
  process tree, so threads suffice), in executions per second.

Each latency is reported twice: the median wall time and the CPU time per execution of all the
sandbox's processes (user + system, from ``RUSAGE_CHILDREN``). On a shared machine the CPU time
is the steadier of the two: wall time also counts waiting for a core.

    python benchmarks/sandbox.py                         # time this checkout
    python benchmarks/sandbox.py --code-root /tmp/base   # time another checkout's sandbox

``--code-root`` imports ``megatron_darl`` from another checkout (e.g. ``git archive`` of an older
commit) so that the same script measures the code before and after a change. Timings are medians
over ``--runs`` executions; the machine is shared, so the 1-minute load average is recorded too.

Writes ``benchmarks/results/sandbox_cpu_*.json``.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

PROBLEM = {
    "task_id": "bench/0",
    "prompt": "from typing import List\n\n\ndef has_close_elements(numbers: List[float], "
              "threshold: float) -> bool:\n    \"\"\"True if any two numbers are closer than "
              "threshold.\"\"\"\n",
    "canonical_solution": "    for i, a in enumerate(numbers):\n        for j, b in enumerate("
                          "numbers):\n            if i != j and abs(a - b) < threshold:\n"
                          "                return True\n    return False\n",
    "test": "def check(candidate):\n    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3)\n"
            "    assert not candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.05)\n"
            "    assert candidate([1.0, 2.0, 5.9, 4.0, 5.0], 0.95)\n"
            "    assert not candidate([1.0, 2.0, 5.9, 4.0, 5.0], 0.8)\n"
            "    assert candidate([1.1, 2.2, 3.1, 4.1, 5.1], 1.0)\n"
            "    assert not candidate([1.1, 2.2, 3.1, 4.1, 5.1], 0.5)\n",
    "entry_point": "has_close_elements",
}


def _commit_of(root: Path) -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _median_ms(fn, runs: int) -> tuple[float, float]:
    """(median wall ms, mean CPU ms of the sandbox's processes) per call of ``fn``."""
    times, cpu0 = [], _children_cpu()
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times), 1000 * (_children_cpu() - cpu0) / runs


def _throughput(fn, parallel: int, per_thread: int) -> float:
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(per_thread):
                fn()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(parallel)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    elapsed = time.perf_counter() - t0
    if errors or any(t.is_alive() for t in threads):
        raise RuntimeError(f"throughput run failed: {errors[:1]}")
    return parallel * per_thread / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code-root", type=Path, default=HERE.parent,
                        help="checkout whose megatron_darl is timed (default: this one)")
    parser.add_argument("--runs", type=int, default=20, help="executions per latency median")
    parser.add_argument("--parallel", type=int, default=2, help="threads in the throughput run")
    parser.add_argument("--per-thread", type=int, default=15, help="executions per thread")
    parser.add_argument("--label", default="", help="free-form tag stored in the record")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="where the JSON record goes (default: benchmarks/results)")
    parser.add_argument("--code-commit", default="",
                        help="commit of --code-root when it is not a git checkout")
    args = parser.parse_args()
    code_root = args.code_root.resolve()
    sys.path.insert(0, str(code_root))
    sys.path.insert(1, str(HERE.parent))
    from benchmarks.record import print_table, write_result
    from megatron_darl.rewards import code_exec, sandbox

    assert Path(sandbox.__file__).resolve().is_relative_to(code_root), sandbox.__file__
    problem, solution = PROBLEM, PROBLEM["canonical_solution"]
    if code_exec.humaneval_reward(problem, solution) != 1.0:
        raise SystemExit("the benchmark's correct solution does not score 1.0")
    if code_exec.humaneval_reward(problem, "    return True\n") != 0.0:
        raise SystemExit("the benchmark's wrong solution does not score 0.0")
    sandbox.run_sandboxed("pass")  # warm caches (interpreter files, probes)

    trivial_ms, trivial_cpu = _median_ms(lambda: sandbox.run_sandboxed("pass"), args.runs)
    humaneval_ms, humaneval_cpu = _median_ms(
        lambda: code_exec.humaneval_reward(problem, solution), args.runs)
    rate = _throughput(lambda: code_exec.humaneval_reward(problem, solution), args.parallel,
                       args.per_thread)
    metrics = {"trivial_ms": trivial_ms, "trivial_cpu_ms": trivial_cpu,
               "humaneval_ms": humaneval_ms, "humaneval_cpu_ms": humaneval_cpu,
               "throughput_exec_per_s": rate}
    config = {"label": args.label, "code_commit": args.code_commit or _commit_of(code_root),
              "runs": args.runs,
              "parallel": args.parallel, "per_thread": args.per_thread,
              "cpus": os.cpu_count(), "load_avg_1min": round(os.getloadavg()[0], 2)}
    print_table([{**config, **metrics}])
    print(f"wrote {write_result('sandbox', config, metrics, args.out_dir)}")


if __name__ == "__main__":
    main()
