"""The training loop: the one place that wires trainer, replay, algorithms and transport."""
