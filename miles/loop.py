"""The sync RL loop in plain Python: the same calls the Prefect flow makes, without Prefect."""

from __future__ import annotations

from typing import Any

from miles.config import RunConfig
from miles.run import RLRun


def sync_iteration(run: RLRun, rollout_id: int) -> None:
    run.generate(rollout_id)
    table = run.get(rollout_id)
    run.train(rollout_id, table)
    if run.should_sync(rollout_id):
        run.sync_weights(rollout_id)
    if run.should_save(rollout_id):
        run.save_checkpoint(rollout_id)


def run_sync(config: RunConfig) -> list[dict[str, Any]]:
    with RLRun(config) as run:
        records = []
        for rollout_id in run.rollout_ids():
            sync_iteration(run, rollout_id)
            records.append(run.finish_iteration(rollout_id))
        return records
