"""The rl-eval flow: evaluate one checkpoint of a run in a flow run of its own (its own engines and history, so the
training does not wait for it), and write the result back to the training run.

    for earlier in unevaluated_checkpoints(run, before=checkpoint):
        evaluate_checkpoint(earlier)               # catch up, in rollout order: their trigger was lost
    records = evaluate_checkpoint(checkpoint)      # each eval data set of the run, on the checkpoint's weights
    artifact <run>-checkpoint-evals                # every checkpoint's evaluations so far: here, and in the
                                                   # training flow run when its id is given
    (the training run logs them to its trackers at its next iteration: eval/<data set>@checkpoint/...)

The `rl-eval/tiny` deployment (deployments/serve.py, prefect.yaml) runs it on every `miles.checkpoint.saved` event of a
full model's checkpoint, with the checkpoint's path and the training flow run's id from the event. A checkpoint is
evaluated once: a repeated trigger returns the stored records (`<run_dir>/evaluations/checkpoint-<id>.json`). An
event the API did not store (a busy SQLite database answers "database is locked"), or a checkpoint saved while no
rl-eval deployment was served, leaves a checkpoint without its trigger: the next checkpoint's rl-eval evaluates it
first (so a run's checkpoints are evaluated in rollout order, as a tracker that takes its steps in order needs), and a
run by hand on a run's latest checkpoint evaluates every one still missing. One that cannot be evaluated then (set
aside as damaged, or deleted by the run meanwhile) is a warning, not a failure of the checkpoint asked for.
"""

from __future__ import annotations

import json
from uuid import UUID

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import ArtifactCreate

from control.policy import check_deployment_run
from miles.config import ConfigError
from miles.evaluation.checkpoint_eval import (
    checkpoint_evaluations,
    checkpoint_run,
    evaluate_checkpoint,
    recorded_run_config,
    unevaluated_checkpoints,
)
from tasks.artifacts import artifact_key, table_rows

SHOWN = ("rollout_id", "eval", "weight_version", "reward_mean", "prompts", "samples", "failed_samples", "checkpoint")


@flow(name="rl-eval", flow_run_name="rl-eval[{checkpoint}]")
def rl_eval(checkpoint: str, training_flow_run_id: str | None = None) -> list[dict]:
    run_dir, rollout_id = checkpoint_run(checkpoint)
    check_deployment_run(recorded_run_config(run_dir))
    for earlier in unevaluated_checkpoints(run_dir, before=rollout_id):
        try:
            evaluate_checkpoint(earlier)
        except (ConfigError, OSError) as exc:
            get_run_logger().warning("checkpoint %s, whose trigger was lost, is not evaluated: %s", earlier, exc)
    records = evaluate_checkpoint(checkpoint)
    rows = table_rows(checkpoint_evaluations(run_dir), lambda key: key in SHOWN or key.startswith("pass_at_"))
    key = artifact_key(run_dir.path.name, "checkpoint-evals")
    description = f"evaluations of the checkpoints of {run_dir.path}, each in an rl-eval flow run"
    create_table_artifact(key=key, table=rows, description=description)
    if training_flow_run_id:
        with get_client(sync_client=True) as client:
            client.create_artifact(
                ArtifactCreate(
                    key=key,
                    type="table",
                    data=json.dumps(rows),  # as create_table_artifact stores a table
                    description=description,
                    flow_run_id=UUID(training_flow_run_id),
                )
            )
    return records
