"""Launch one fake trainer job step and one rollout job step per worker, as separate sessions."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tests.distributed.procs.launcher import Procs, free_port
from tests.distributed.procs.sources import save_tiny_model


@dataclass
class Scenario:
    """Arguments shared by the trainer ranks and the workers of one test run."""

    out: Path  # log and record directory
    trainers: int = 1  # trainer ranks (stage leaders are ranks < stages)
    workers: int = 2  # rollout workers
    stages: int = 1  # PP stages
    steps: int = 3  # trainer steps (versions published)
    gps: int = 4  # groups per step
    eta: int = 1  # max staleness
    trainer_args: list[str] = field(default_factory=list)  # extra trainer flags
    worker_args: dict[int, list[str]] = field(default_factory=dict)  # extra flags per worker
    secret: str = ""  # the run's control-store secret (every process gets it)
    port: int = 0  # control-store port, set by launch()

    def common(self, port: int) -> list[str]:
        return ["--port", str(port), "--workers", str(self.workers), "--stages", str(self.stages),
                "--hubs", "1", "--gps", str(self.gps), "--eta", str(self.eta), "--out", str(self.out),
                "--model-dir", str(self.out / "model"), "--secret", self.secret]

    def launch(self) -> Procs:
        save_tiny_model(str(self.out / "model"))
        port, default_port = free_port(), free_port()
        self.port = port
        procs = Procs(self.out)
        for r in range(self.trainers):
            procs.start(f"trainer{r}", "tests.distributed.procs.trainer_proc", *self.common(port), "--rank", str(r),
                        "--world", str(self.trainers), "--default-port", str(default_port),
                        "--steps", str(self.steps), *self.trainer_args)
        for w in range(self.workers):
            procs.start(f"worker{w}", "tests.distributed.procs.worker_proc", *self.common(port),
                        "--worker", str(w), *self.worker_args.get(w, []))
        return procs

    def records(self, name: str) -> list[dict]:
        path = self.out / name
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
