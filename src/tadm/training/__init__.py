"""Training: data, loop, checkpoints, distributed."""
