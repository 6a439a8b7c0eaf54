"""rl-eval: one checkpoint evaluated in a flow run of its own, its result written back to the training run."""

import json

import pytest

from flows.eval import rl_eval
from flows.sync_rl import sync_rl
from miles.checkpoint_eval import evaluations_path
from miles.config import ConfigError
from miles.run_dir import RunDir
from tests.helpers.history import flow_run_artifacts

EVAL = ["eval.datasets=[{name: sums, task: addition, max_prompts: 16}]", "eval.interval=2"]


def test_a_checkpoint_evaluated_apart_equals_the_evaluation_during_training_and_is_written_back(
    ray_session, prefect_api, small_config
):
    config = small_config(*EVAL, num_rollout=4, save_interval=2)
    training = sync_rl(config, return_state=True)
    assert training.is_completed()
    training_id = training.state_details.flow_run_id
    checkpoint = RunDir(config.run_dir).checkpoint(1)

    state = rl_eval(str(checkpoint), str(training_id), return_state=True)
    assert state.is_completed(), state.message
    (record,) = state.result()
    # The same weights (version 2), data set, seeds and engines' sampling as the run's own evaluation at rollout 2.
    (during,) = [r for r in RunDir(config.run_dir).evaluations("sums") if r["rollout_id"] == 2]
    assert record["weight_version"] == 2 and record["checkpoint"] == str(checkpoint)
    for key in ("rollout_id", "reward_mean", "pass_at_1", "prompts", "samples", "response_length_mean"):
        assert record[key] == during[key], key
    stored = evaluations_path(RunDir(config.run_dir), 1)
    assert json.loads(stored.read_text()) == [record]

    # Again (a repeated trigger): the stored records, not a second evaluation.
    written = stored.stat().st_mtime_ns
    assert rl_eval(str(checkpoint)) == [record] and stored.stat().st_mtime_ns == written
    for flow_run_id in (training_id, state.state_details.flow_run_id):
        (artifact,) = [a for a in flow_run_artifacts(flow_run_id) if a.key == "run-checkpoint-evals"]
        assert [(row["rollout_id"], row["checkpoint"]) for row in json.loads(artifact.data)] == [(2, str(checkpoint))]


def test_a_path_that_is_not_a_model_checkpoint_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="is not a run's checkpoint"):
        rl_eval.fn(str(tmp_path))
