"""The sync RL flow: for each rollout_id, generate -> get -> train_step -> sync_weights (and a checkpoint when due).

    for rollout_id in start .. num_rollout - 1:
        generate(rollout_id)                 # engines sample, reward scores, Arrow file in the run dir
        table = get(rollout_id)              # pyarrow.Table with GRPO advantages
        train_step(rollout_id, table)        # PPO-clip optimizer steps, recorded in the ledger
        sync_weights(rollout_id)             # engines get weights version rollout_id + 1
        save_checkpoint(rollout_id)          # every save_interval and at the end
    evaluate(last rollout_id)                # greedy accuracy, starting model vs final checkpoint

A run directory that already holds checkpoints resumes after the latest one.
"""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact

from flows.runtime import wait_for_task_history
from miles.config import RunConfig
from miles.run import RLRun
from tasks import evaluate, generate, get, save_checkpoint, sync_weights, train_step

TABLE_COLUMNS = ("rollout_id", "reward_mean", "response_length_mean", "loss", "grad_norm", "clip_fraction", "entropy",
                 "time_generate", "time_get", "time_train", "time_sync")


def sync_iteration(run: RLRun, rollout_id: int) -> int:
    """One rollout through the task chain; returns the number of task runs it made."""
    generate(run, rollout_id)
    table = get(run, rollout_id)
    train_step(run, rollout_id, table)
    sync_weights(run, rollout_id)
    if run.should_save(rollout_id):
        save_checkpoint(run, rollout_id)
        return 5
    return 4


@flow(name="rl-sync")
def sync_rl(config: RunConfig) -> dict:
    run = RLRun(config)
    task_runs = 0
    records = []
    try:
        total = config.num_rollout
        progress = create_progress_artifact(
            progress=100.0 * run.start_rollout_id / total, key="rl-sync-progress", description=f"rollouts of {config.run_dir}"
        )
        shown = 0
        for rollout_id in run.rollout_ids():
            task_runs += sync_iteration(run, rollout_id)
            records.append(run.finish_iteration(rollout_id))
            percent = int(100 * (rollout_id + 1) / total)
            if percent > shown:  # one update per whole percent keeps API writes off the hot path
                update_progress_artifact(artifact_id=progress, progress=float(percent))
                shown = percent
        evaluation = {}
        if records:
            evaluation = evaluate(run, records[-1]["rollout_id"])
            task_runs += 1
            create_table_artifact(
                key="rl-sync-metrics",
                table=[{k: round(r[k], 4) if isinstance(r.get(k), float) else r.get(k) for k in TABLE_COLUMNS} for r in records],
                description=f"per-iteration metrics of {config.run_dir}",
            )
    finally:
        run.close()
    wait_for_task_history(task_runs)
    return {
        "run_dir": config.run_dir,
        "rollouts_trained": len(records),
        "final_reward_mean": records[-1]["reward_mean"] if records else None,
        "task_runs": task_runs,
        **evaluation,
    }


if __name__ == "__main__":
    from flows.runtime import configure_prefect

    configure_prefect()
    print(sync_rl(RunConfig()))
