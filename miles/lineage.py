"""Lineage: what made a checkpoint. Saved in the checkpoint's state (state.json, under its checksums): the rollouts
trained since the previous checkpoint (ids, files, sha256, the data they drew: positions in the data walk and the
rows' numbers in their source), the config in effect with its changes, and the code (package versions; the source
tree's git commit where it is one). `describe` reads it back with the evaluations of those weights."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path
from typing import Any

from miles.data.datasets import ROW
from miles.state.checkpoint import file_sha256, read_state
from miles.state.run_dir import RunDir, package_versions

SOURCE_TREE = Path(__file__).resolve().parent.parent


def rollout_lineage(path: Path, rollout_id: int, positions: tuple[int, int], rows: list[dict]) -> dict[str, Any]:
    """One trained rollout's entry: `rows` are the data rows its prompts came from, `positions` their span in the walk."""
    return {
        "rollout_id": rollout_id,
        "file": str(path),
        "sha256": file_sha256(path),
        "data_positions": list(positions),
        "data_rows": [row.get(ROW, index) for index, row in rows],
    }


@functools.cache
def code_version() -> dict[str, Any]:
    """The packages the run imports, and the git commit of this source tree (with `dirty` when it has changes), as
    this process found them first."""
    version: dict[str, Any] = {"packages": package_versions()}
    try:
        commit = _git("rev-parse", "HEAD")
        dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.CalledProcessError):
        return version  # an installed package, not a checkout
    return {**version, "git_commit": commit, "dirty": dirty}


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(SOURCE_TREE), *args], capture_output=True, text=True, check=True, timeout=10
    ).stdout.strip()


def describe(run_dir: str | Path, rollout_id: int | None = None) -> dict[str, Any]:
    """The lineage of the run's checkpoint of `rollout_id` (the latest when None), with the evaluations of its
    weights (those at rollout_id + 1)."""
    run = RunDir(run_dir)
    saved = run.saved_checkpoints()
    if not saved:
        raise ValueError(f"{run.path} has no checkpoint")
    if rollout_id is None:
        rollout_id = saved[-1]
    if rollout_id not in saved:
        raise ValueError(f"{run.path} has no checkpoint of rollout {rollout_id}; it has {saved}")
    checkpoint = run.checkpoint(rollout_id)
    lineage = read_state(checkpoint).get("lineage")
    if lineage is None:
        raise ValueError(f"checkpoint {checkpoint} holds no lineage (saved with logging.lineage=false)")
    evaluations = [r for r in run.evaluations() if r["rollout_id"] == rollout_id + 1]
    return {"checkpoint": str(checkpoint), **lineage, "evaluations": evaluations}


def markdown(lineage: dict[str, Any]) -> str:
    """The lineage as the `miles lineage` command prints it and the checkpoint's artifact shows it."""
    code = lineage["code"]
    commit = code.get("git_commit")
    lines = [
        f"# lineage of checkpoint {lineage['rollout_id']}",
        "",
        f"- checkpoint: `{lineage.get('checkpoint', '')}`",
        f"- previous checkpoint: {lineage['previous_checkpoint']}",
        f"- code: {commit[:12] + (' (with changes)' if code['dirty'] else '') if commit else 'installed package'}; "
        + ", ".join(f"{name} {version}" for name, version in code["packages"].items()),
        f"- config: lr {lineage['config']['train']['lr']}, temperature {lineage['config']['rollout']['temperature']}, "
        f"algorithm {lineage['config']['algo']['advantage_estimator']}; changes: "
        + (", ".join(f"{c['values']} from rollout {c['rollout_id']}" for c in lineage["config"]["changes"]) or "none"),
        "",
        "| rollout | file | sha256 | data positions | data rows |",
        "|---|---|---|---|---|",
        *(
            f"| {r['rollout_id']} | `{r['file']}` | `{r['sha256'][:16]}` | {r['data_positions'][0]}..{r['data_positions'][1]} "
            f"| {_rows(r['data_rows'])} |"
            for r in lineage["rollouts"]
        ),
    ]
    if lineage.get("evaluations"):
        lines += ["", "| evaluation | data set | reward | |", "|---|---|---|---|"]
        lines += [
            f"| rollout {e['rollout_id']} | {e['eval']} | {e['reward_mean']:.3f} | "
            + ", ".join(f"{k} {v:.3f}" for k, v in e.items() if k.startswith("pass_at_"))
            + " |"
            for e in lineage["evaluations"]
        ]
    return "\n".join(lines)


def _rows(rows: list[int], shown: int = 8) -> str:
    return ", ".join(map(str, rows[:shown])) + (f", ... ({len(rows)} rows)" if len(rows) > shown else "")
