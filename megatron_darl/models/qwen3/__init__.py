"""Qwen3 dense models on Megatron-core and their Hugging Face weight mapping."""
