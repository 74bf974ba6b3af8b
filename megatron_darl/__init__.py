"""megatron_darl: asynchronous D-ARL post-training of reasoning LLMs on Megatron-core.

The package is split by contract (see docs/architecture.md, Layers and imports): ``algorithms`` is pure tensor
math, ``replay`` holds the version-windowed buffer and log-prob cache, ``models`` maps Qwen3
between Hugging Face and Megatron, ``trainer`` runs Megatron, ``rollout`` runs engines,
``transport`` connects the two, and ``loop`` wires them into the training loop.
"""

__version__ = "0.1.0"
