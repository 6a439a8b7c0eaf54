"""rl-pipeline: train and evaluate as child flow runs, wait for a person's approval, then promote or record why not."""

import json

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from flows.cli import main as miles
from flows.pipeline import rl_pipeline
from miles.state.run_dir import RunDir
from tests.flows.test_control import _operate
from tests.helpers.history import flow_run_artifacts

EVAL = ["eval.datasets=[{name: sums, task: addition, max_prompts: 8}]", "eval.before_training=false"]


def _child_runs(parent_id) -> set[str]:
    """The flows of the flow runs started inside flow run `parent_id`."""
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(parent_flow_run_id={"any_": [parent_id]}))
        return {client.read_flow(r.flow_id).name for r in runs}


def test_an_approved_checkpoint_is_exported_as_a_clean_model_with_its_card(
    ray_session, prefect_api, small_config, tmp_path, capsys
):
    config = small_config(*EVAL, num_rollout=2)
    seen = {}

    def approve(flow_run_id, pause_key):
        with get_client(sync_client=True) as client:
            seen["form"] = client.read_flow_run_input(flow_run_id, f"paused-{pause_key}-description")
        miles(["approve", str(flow_run_id), "--by", "reviewer", "--reason", "beats the baseline"])

    operator = _operate("rl-pipeline", None, lambda _: None, approve)
    state = rl_pipeline(config, str(tmp_path / "promoted"), return_state=True)
    operator.join()
    assert not operator.errors, operator.errors
    assert state.is_completed(), state.message
    result = state.result()
    checkpoint = RunDir(config.run_dir).checkpoint(1)
    assert result == {
        "checkpoint": str(checkpoint),
        "approved": True,
        "promoted_to": str(tmp_path / "promoted" / "run-1"),
    }
    assert _child_runs(state.state_details.flow_run_id) == {"rl-sync", "rl-eval"}
    # The approval form showed the evaluation and the lineage.
    assert "| sums |" in seen["form"] and "lineage of checkpoint 1" in seen["form"]

    promoted = tmp_path / "promoted" / "run-1"
    assert sorted(p.name for p in promoted.iterdir()) == sorted(
        [p.name for p in (checkpoint / "model").iterdir()] + ["README.md"]
    )
    assert (
        load_file(promoted / "model.safetensors").keys() == load_file(checkpoint / "model" / "model.safetensors").keys()
    )
    AutoModelForCausalLM.from_pretrained(promoted)
    AutoTokenizer.from_pretrained(promoted)
    card = (promoted / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers") and "Promoted by reviewer: beats the baseline" in card
    assert "## Lineage of checkpoint 1" in card and "| sums |" in card
    (decision,) = [
        json.loads(line) for line in (RunDir(config.run_dir).path / "promotions.jsonl").read_text().splitlines()
    ]
    assert (decision["approved"], decision["reviewer"], decision["promoted_to"]) == (True, "reviewer", str(promoted))
    (artifact,) = [a for a in flow_run_artifacts(state.state_details.flow_run_id) if a.key == "rl-pipeline-decision"]
    assert artifact.data.startswith(f"# checkpoint 1: promoted to `{promoted}`")


def test_a_rejected_checkpoint_is_not_exported_and_the_reason_is_recorded(
    ray_session, prefect_api, small_config, tmp_path
):
    config = small_config(*EVAL, num_rollout=1)
    reject = ["approve", "{id}", "--reject", "--by", "reviewer", "--reason", "reward fell on sums"]
    operator = _operate(
        "rl-pipeline", None, lambda _: None, lambda flow_run_id, _: miles([a.format(id=flow_run_id) for a in reject])
    )
    state = rl_pipeline(config, str(tmp_path / "promoted"), return_state=True)
    operator.join()
    assert not operator.errors, operator.errors
    assert state.result()["approved"] is False and not (tmp_path / "promoted").exists()
    (decision,) = [
        json.loads(line) for line in (RunDir(config.run_dir).path / "promotions.jsonl").read_text().splitlines()
    ]
    assert (decision["approved"], decision["reason"], decision["promoted_to"]) == (False, "reward fell on sums", None)
