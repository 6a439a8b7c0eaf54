"""The rl-pipeline flow: train, evaluate, and promote the checkpoint only when a person approves it in the UI.

    train = rl-<flow>(config)                     # a child flow run: the whole training (resumes a run directory)
    evaluation = rl-eval(latest checkpoint)       # a child flow run: the run's eval data sets on its weights
    decision = pause for approval                 # the UI's Resume form shows the evaluation and the lineage;
                                                  # approve (with your name and why) or not
    if approved: export the checkpoint to promote_to/<run>-<rollout>   # a clean Hugging Face directory with a model card
    record the decision                           # <run_dir>/promotions.jsonl and the rl-pipeline-decision artifact

`miles approve FLOW_RUN_ID [--reject] --reason WHY` answers from a shell, as the form does.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.flow_runs import pause_flow_run

from control.policy import check_deployment_run
from control.requests import Approval, pause_timeout_s
from flows.eval import rl_eval
from flows.registry import FLOWS
from miles.config import RunConfig
from miles.evaluation.promote import export_checkpoint, record_decision
from miles.lineage import describe, markdown
from miles.state.checkpoint import latest_checkpoint
from miles.state.run_dir import RunDir


@flow(name="rl-pipeline")
def rl_pipeline(config: RunConfig, promote_to: str, flow: str = "sync") -> dict:
    check_deployment_run(config)
    training = FLOWS[flow](config, return_state=True)
    if not training.is_completed():
        raise RuntimeError(f"training ended {training.name}: {training.message}")
    run_dir = RunDir(Path(config.run_dir).resolve())
    checkpoint = latest_checkpoint(run_dir.checkpoints)
    evaluations = rl_eval(str(checkpoint))
    lineage = describe(run_dir.path, int(checkpoint.name))
    description = "\n".join(
        [
            f"Promote checkpoint {checkpoint.name} of {run_dir.path} to {promote_to}?",
            "",
            "| data set | mean reward | pass@1 |",
            "|---|---|---|",
            *(
                f"| {e['eval']} | {e['reward_mean']:.4f} | {e.get('pass_at_1', float('nan')):.4f} |"
                for e in evaluations
            ),
            "",
            markdown(lineage),
        ]
    )
    decision = pause_flow_run(
        wait_for_input=Approval.with_initial_data(description=description),
        timeout=pause_timeout_s(),
        poll_interval=2,
        key=f"approve-{checkpoint.name}",
    )
    target = None
    if decision.approve:
        target = str(
            export_checkpoint(
                checkpoint,
                Path(promote_to) / f"{run_dir.path.name}-{checkpoint.name}",
                evaluations,
                decision.changed_by,
                decision.reason,
            )
        )
    record_decision(checkpoint, decision.approve, decision.changed_by, decision.reason, target)
    verdict = f"promoted to `{target}`" if target else "not promoted"
    create_markdown_artifact(
        key="rl-pipeline-decision",
        markdown=f"# checkpoint {checkpoint.name}: {verdict}\n\nby {decision.changed_by or 'unnamed'}: "
        f"{decision.reason or '(no reason given)'}\n\n{description}",
        description=f"the promotion decision on {checkpoint}",
    )
    return {"checkpoint": str(checkpoint), "approved": decision.approve, "promoted_to": target}
