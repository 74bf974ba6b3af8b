"""Packaging for megatron_darl (supported versions: docs/guide.md, Install)."""

from setuptools import find_packages, setup

setup(
    name="megatron_darl",
    version="0.1.0",
    description="Asynchronous D-ARL post-training of reasoning LLMs on Megatron-core",
    python_requires=">=3.11",
    packages=find_packages(include=["megatron_darl", "megatron_darl.*"]),
    install_requires=[
        # torch is installed first by launch/quickstart.sh and tests/run.sh (the CPU wheel
        # on CPU machines); any release in this range is accepted as it is.
        "torch>=2.6",
        "megatron-core>=0.16.1,<0.20",
        "transformers>=4.51",
        "tokenizers>=0.21",
        "safetensors>=0.4",
        "hydra-core>=1.3",
        "omegaconf>=2.3",
        "math-verify>=0.7",
        "psutil>=5.9",  # megatron dist_checkpointing's async writer needs it
        "numpy>=1.26",
        "pyarrow>=14",
        "tqdm>=4.66",
        "tensorboard>=2.15",
        "matplotlib>=3.8",
        "pyyaml>=6",
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "hypothesis>=6.100"],
        "vllm": ["vllm>=0.20,<0.27"],  # the releases that pin torch 2.11 (our GPU torch)
        "te": ["transformer_engine[pytorch]>=2.4"],
        "wandb": ["wandb>=0.18"],
    },
)
