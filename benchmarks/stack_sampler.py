"""A sampling profiler for every thread of a benchmark process, in the standard library only.

Why: the channel's work happens in link threads and store I/O threads that ``cProfile`` (one
thread) does not see, and the GPU machine has no ``py-spy``. A daemon thread reads
``sys._current_frames()`` every ``interval_s`` and counts, per thread name, the innermost frame
of this repository or of torch (where the time goes) and the leaf frame; ``report()`` lists the
most frequent. A sample costs a few microseconds per thread, so 5 ms intervals barely perturb
what is measured.

    sampler = StackSampler().start()
    ...                                   # the work
    print(sampler.stop().report(top=15))
"""

from __future__ import annotations

import collections
import sys
import threading
from pathlib import Path

_REPO = str(Path(__file__).resolve().parents[1])


def _where(frame) -> tuple[str, str]:
    """(leaf "file:line func", innermost frame in this repository or torch) of one stack."""
    leaf = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} {frame.f_code.co_name}"
    f, ours = frame, ""
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith(_REPO) or "/torch/" in name:
            ours = f"{Path(name).name}:{f.f_lineno} {f.f_code.co_name}"
            break
        f = f.f_back
    return leaf, ours


class StackSampler:
    """Counts where each thread is, every ``interval_s``, until ``stop``."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.counts: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def start(self) -> StackSampler:
        self._thread.start()
        return self

    def stop(self) -> StackSampler:
        self._stop.set()
        self._thread.join(5.0)
        return self

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval_s):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    leaf, ours = _where(frame)
                    self.counts[(names.get(ident, str(ident)), ours, leaf)] += 1
            self.samples += 1

    def report(self, top: int = 20) -> str:
        """The ``top`` most frequent (thread, our frame, leaf) with their share of the samples."""
        lines = [f"{self.samples} samples every {1000 * self.interval_s:.1f} ms"]
        for (thread, ours, leaf), n in self.counts.most_common(top):
            lines.append(f"{100 * n / max(1, self.samples):5.1f}%  {thread:<24} {ours:<48} {leaf}")
        return "\n".join(lines)
