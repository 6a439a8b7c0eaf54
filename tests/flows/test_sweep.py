"""rl-sweep: each variant a child flow run in its own run directory, and one comparison of them all."""

import base64
import re

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter

from flows.sweep import rl_sweep
from miles.state.run_dir import RunDir
from tests.helpers.history import flow_run_artifacts


def test_a_grid_and_a_listed_variant_run_as_child_flow_runs_and_are_compared_in_one_artifact(
    ray_session, prefect_api, small_config, tmp_path
):
    base = small_config(num_rollout=3, run_dir=tmp_path / "sweep")
    state = rl_sweep(
        base,
        grid={"train.lr": [0.001, 0.003]},
        variants=[{"train.lr": 0.001, "rollout.temperature": 0.7}],
        return_state=True,
    )
    assert state.is_completed(), state.message
    rows = state.result()
    names = ["train.lr=0.001", "train.lr=0.003", "train.lr=0.001,rollout.temperature=0.7"]
    assert [row["variant"] for row in rows] == names
    assert all(row["rollouts"] == 3 and row["flow_run"] == "Completed" for row in rows)

    run_dirs = sorted(p for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    assert [p.name for p in run_dirs] == [
        "0-train.lr=0.001",
        "1-train.lr=0.003",
        "2-train.lr=0.001,rollout.temperature=0.7",
    ]
    configs = [RunDir(p).recorded_config() for p in run_dirs]
    assert [(c["train"]["lr"], c["rollout"]["temperature"]) for c in configs] == [
        (0.001, 1.0),
        (0.003, 1.0),
        (0.001, 0.7),
    ]
    for row, run_dir in zip(rows, run_dirs, strict=True):
        assert row["final_reward"] == RunDir(run_dir).metrics()[-1]["reward_mean"]
    # The two lr=0.001 variants differ only in temperature, so they sample differently from the first rollout on.
    assert RunDir(run_dirs[0]).metrics()[0]["reward_mean"] != RunDir(run_dirs[2]).metrics()[0]["reward_mean"]

    flow_run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        children = client.read_flow_runs(flow_run_filter=FlowRunFilter(parent_flow_run_id={"any_": [flow_run_id]}))
        assert sorted(client.read_flow(c.flow_id).name for c in children) == ["rl-sync"] * 3
    (artifact,) = [a for a in flow_run_artifacts(flow_run_id) if a.key == "rl-sweep-comparison"]
    assert all(f"| {name} | 3 |" in artifact.data for name in names)
    image = re.search(r"!\[reward curves of the variants\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", artifact.data)
    assert image and base64.b64decode(image.group(1)) == (tmp_path / "sweep" / "sweep.png").read_bytes()
