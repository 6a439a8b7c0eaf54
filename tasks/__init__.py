"""Prefect tasks: each is retries + a readable run name around one call into `miles`; `STEPS` are the steps every
flow graph's schedule (miles.schedules) runs."""

from miles.schedules import Steps
from tasks.checkpoint import save_checkpoint
from tasks.critic import compute_values, train_critic
from tasks.evaluate import evaluate
from tasks.generate import generate
from tasks.get import get
from tasks.train import train_step
from tasks.weights import push_adapter, retire_adapter, sync_weights

STEPS = Steps(
    evaluate=evaluate,
    generate=generate,
    get=get,
    train_step=train_step,
    compute_values=compute_values,
    train_critic=train_critic,
    sync_weights=sync_weights,
    save_checkpoint=save_checkpoint,
    push_adapter=push_adapter,
    retire_adapter=retire_adapter,
)

__all__ = [
    "STEPS",
    "generate",
    "get",
    "train_step",
    "compute_values",
    "train_critic",
    "sync_weights",
    "push_adapter",
    "retire_adapter",
    "save_checkpoint",
    "evaluate",
]
