"""tadm: time-anchored diffusion language models."""

__version__ = "0.1.0"
