"""The rl-sweep flow: config variants of one run as child flow runs, then one comparison.

    for each variant (the grid's product, then the listed variants):    # each in <run_dir>/<index>-<name>
        in-process: rl-<flow>(variant)           # a child flow run, one after another (the embedded default)
        with a deployment: run it there          # all submitted at once; the deployment's concurrency limit (and
                                                 # its work pool's) says how many train at a time
    artifact rl-sweep-comparison                 # a table (rollouts, final and last-10 mean reward, last evaluation,
                                                 # the flow run's end) and every variant's reward curve in one image

A variant that fails is in the table with its state; the others go on.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment

from control.policy import check_deployment_run
from flows.registry import FLOWS
from miles.config import RunConfig
from miles.evaluation import sweep
from miles.observe.plots import data_uri

POLL_S = 2.0


@flow(name="rl-sweep")
def rl_sweep(
    config: RunConfig,
    grid: dict[str, list[Any]] | None = None,
    variants: list[dict[str, Any]] | None = None,
    flow: str = "sync",
    deployment: str | None = None,
) -> list[dict[str, Any]]:
    configs = {
        sweep.variant_name(values): sweep.variant_config(config, index, values)
        for index, values in enumerate(sweep.variants(grid, variants))
    }
    for variant in configs.values():
        check_deployment_run(variant)
    if deployment is None:
        ends = {name: FLOWS[flow](variant, return_state=True).name for name, variant in configs.items()}
    else:
        submitted = {
            name: run_deployment(deployment, parameters={"config": variant.model_dump(mode="json")}, timeout=0).id
            for name, variant in configs.items()
        }
        ends = _wait_for(submitted)
    rows, image = sweep.compare(configs, f"sweep of {Path(config.run_dir).name}", Path(config.run_dir) / "sweep.png")
    for row in rows:
        row["flow_run"] = ends[row["variant"]]
    create_markdown_artifact(
        key="rl-sweep-comparison",
        markdown=_markdown(rows, image),
        description=f"{len(rows)} variants of {config.run_dir}",
    )
    return rows


def _wait_for(flow_runs: dict[str, Any]) -> dict[str, str]:
    """Each flow run's final state name, once every one has one."""
    ends: dict[str, str] = {}
    with get_client(sync_client=True) as client:
        while len(ends) < len(flow_runs):
            for name, flow_run_id in flow_runs.items():
                state = client.read_flow_run(flow_run_id).state
                if name not in ends and state is not None and state.is_final():
                    ends[name] = state.name
            if len(ends) < len(flow_runs):
                time.sleep(POLL_S)
    return ends


def _markdown(rows: list[dict[str, Any]], image: Path) -> str:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = [
        "# sweep",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
        *("| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows),
        "",
        f"![reward curves of the variants]({data_uri(image)})",
    ]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else "" if value is None else str(value)
