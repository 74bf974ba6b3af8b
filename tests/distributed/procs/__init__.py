"""Helper programs that tests start as separate process trees (as Slurm job steps would be)."""
