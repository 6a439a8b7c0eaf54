"""Promotion: a checkpoint exported as a clean Hugging Face model directory, and every decision on record.

`export_checkpoint` copies the checkpoint's model as the trainer wrote it (its weights in the model's own dtype, its
config, generation config and tokenizer; no optimizer state, no run files) into a staging directory beside the
target, adds a model card (README.md: where it came from, its evaluations, its lineage), and renames it into place:
the target appears whole or not at all, and one that exists is never overwritten. `record_decision` appends each
approval or rejection, with who decided and why, to `<run_dir>/promotions.jsonl`.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from miles.evaluation.checkpoint_eval import checkpoint_run
from miles.lineage import describe, markdown
from miles.state.checkpoint import MODEL_DIR


def model_card(lineage: dict[str, Any], evaluations: list[dict[str, Any]], reviewer: str, reason: str) -> str:
    """README.md of an exported model: front matter for the Hub, then where it came from."""
    config = lineage["config"]
    base = config["model"]["path"] or "the embedded model (miles-flow)"
    rows = [
        f"| {e['eval']} | {e['reward_mean']:.4f} | "
        + ", ".join(f"{k} {v:.4f}" for k, v in e.items() if k.startswith("pass_at_"))
        + " |"
        for e in evaluations
    ]
    return "\n".join(
        [
            "---",
            "library_name: transformers",
            "tags: [miles-flow, reinforcement-learning, " + config["algo"]["advantage_estimator"] + "]",
            "---",
            "",
            f"# {Path(lineage['checkpoint']).parent.parent.name}, rollout {lineage['rollout_id']}",
            "",
            f"Post-trained from {base} with {config['algo']['advantage_estimator']} "
            f"({config['algo']['policy_loss']} loss) by miles-flow. Promoted by {reviewer or 'an unnamed reviewer'}"
            + (f": {reason}" if reason else "")
            + ".",
            "",
            "## Evaluation",
            "",
            "| data set | mean reward | pass@k |",
            "|---|---|---|",
            *rows,
            "",
            markdown(lineage).replace("# lineage of", "## Lineage of", 1),
            "",
        ]
    )


def export_checkpoint(
    checkpoint: str | Path, target: str | Path, evaluations: list[dict[str, Any]], reviewer: str = "", reason: str = ""
) -> Path:
    """The checkpoint's model as a Hugging Face directory at `target`, with its model card; `target` must not exist."""
    run_dir, rollout_id = checkpoint_run(checkpoint)
    target = Path(target).resolve()
    if target.exists():
        raise FileExistsError(f"promotion target {target} exists; a promoted model is never overwritten")
    source = run_dir.checkpoint(rollout_id) / MODEL_DIR
    lineage = describe(run_dir.path, rollout_id)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.staging-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging)  # the model directory alone: the optimizer and run state lie beside it
    (staging / "README.md").write_text(model_card(lineage, evaluations, reviewer, reason))
    os.rename(staging, target)
    return target


def record_decision(checkpoint: str | Path, approved: bool, reviewer: str, reason: str, target: str | None) -> None:
    run_dir, rollout_id = checkpoint_run(checkpoint)
    decision = {
        "rollout_id": rollout_id,
        "checkpoint": str(run_dir.checkpoint(rollout_id)),
        "approved": approved,
        "reviewer": reviewer,
        "reason": reason,
        "promoted_to": target,
        "time": time.time(),
    }
    with (run_dir.path / "promotions.jsonl").open("a") as f:
        f.write(json.dumps(decision) + "\n")
