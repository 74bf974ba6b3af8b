"""Sample-based accuracy metrics: avg@n and the unbiased pass@k estimator.

pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"): with n samples of
which c are correct, the probability that at least one of k samples drawn without replacement
is correct is ``1 - C(n-c, k) / C(n, k)``. The binomials overflow quickly, so it is evaluated in
the paper's product form ``1 - prod_{i=n-c+1}^{n} (1 - k / i)``. avg@n is the mean fraction of
correct samples, i.e. pass@1 averaged over n samples.
"""

from __future__ import annotations

import math
from typing import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``c`` correct out of ``n`` samples."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean_pass_at_k(correct: Sequence[int], n: int, k: int) -> float:
    """pass@k averaged over problems (``correct[i]`` = correct samples of problem i)."""
    if not correct:
        raise ValueError("mean_pass_at_k: no problems")
    return sum(pass_at_k(n, c, k) for c in correct) / len(correct)


def avg_at_n(rewards: Sequence[Sequence[float]]) -> float:
    """Mean reward over all samples of all problems (each problem weighs the same)."""
    if not rewards or any(len(r) == 0 for r in rewards):
        raise ValueError("avg_at_n: every problem needs at least one sample")
    return sum(sum(r) / len(r) for r in rewards) / len(rewards)


def default_ks(n: int) -> list[int]:
    """Powers of two up to ``n``, and ``n`` itself."""
    ks = [2**i for i in range(n.bit_length()) if 2**i <= n]
    return ks if ks[-1] == n else ks + [n]
