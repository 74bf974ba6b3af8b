"""Model families: Megatron specs and the one HF<->Megatron weight mapping per family."""
