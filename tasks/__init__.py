"""Prefect tasks: each is retries + a readable run name around one call into `miles`."""

from tasks.checkpoint import save_checkpoint
from tasks.evaluate import evaluate
from tasks.generate import generate
from tasks.get import get
from tasks.train import train_step
from tasks.weights import push_adapter, retire_adapter, sync_weights

__all__ = [
    "generate",
    "get",
    "train_step",
    "sync_weights",
    "push_adapter",
    "retire_adapter",
    "save_checkpoint",
    "evaluate",
]
