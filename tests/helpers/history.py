"""The Prefect API's record of a flow run that ran in this process, read once the API has stored its task history
(the server stores task-run states asynchronously; a flow run ends without waiting for that)."""

from __future__ import annotations

from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, FlowRunFilter
from prefect.client.schemas.objects import Artifact, TaskRun

from tasks.history import wait_for_task_history


def stored_task_runs(flow_run_id: UUID) -> dict[str, TaskRun]:
    """By task-run name."""
    wait_for_task_history([flow_run_id])
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [str(flow_run_id)]}))
    return {r.name: r for r in runs}


def retried_task_runs(runs: dict[str, TaskRun]) -> dict[str, int]:
    """The task runs that ran more than once, with their run counts: a failed check names every retry."""
    return {name: r.run_count for name, r in runs.items() if r.run_count > 1}


def flow_run_artifacts(flow_run_id: UUID) -> list[Artifact]:
    """Artifacts are written through the API as the flow creates them: no wait for the task history."""
    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id={"any_": [str(flow_run_id)]}))
