"""posttrain: post-training language models with reinforcement learning in executable environments."""

__version__ = "0.1.0"
