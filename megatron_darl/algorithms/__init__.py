"""Pure D-ARL math (DESIGN.md section 4): advantages, importance weights, losses, scores, selection.

Nothing here knows about process groups, configs or Megatron, so another RL pipeline can import
these functions into its own loss.
"""
