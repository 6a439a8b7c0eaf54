"""A rank of a data-parallel training run on the CPU (gloo), for torch.multiprocessing.spawn."""

from __future__ import annotations

import json

import pyarrow as pa
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from miles.config import load_config
from miles.train.sharding import full_state_dict, shard_model
from miles.train.update import train_on_rollout


def train_one_rank(
    rank: int, world: int, rendezvous: str, model_dir: str, rollout: str, overrides: list, out: str
) -> None:
    """Rank `rank` of `world` (world 1: no process group, no sharding) trains the model on the rollout file; rank 0
    writes the full weights to `out` (safetensors) and the metrics next to it."""
    torch.set_num_threads(1)
    if world > 1:
        # A file rendezvous: no port to find free and then lose to another process.
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    config = load_config(None, overrides)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    if world > 1:
        shard_model(model)
    train = config.train
    optimizer = torch.optim.AdamW(model.parameters(), lr=train.lr, betas=train.adam_betas)
    with pa.memory_map(rollout) as source:
        table = pa.ipc.open_file(source).read_all()
    metrics = train_on_rollout(
        model, optimizer, list(model.parameters()), table, config, torch.device("cpu"), model.config.pad_token_id or 0
    )
    weights = full_state_dict(model)
    if rank == 0:
        save_file({k: v.contiguous() for k, v in weights.items()}, out)
        with open(out + ".json", "w") as f:
            json.dump(metrics, f)
    if world > 1:
        dist.barrier()  # no rank tears the group down while another still uses it
        dist.destroy_process_group()
