"""Loggers: the local JSONL records (always) and Weights & Biases (``logger=wandb``)."""

from experiments.loggers.base import Logger

__all__ = ["Logger"]
