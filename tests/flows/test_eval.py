"""rl-eval: one checkpoint evaluated in a flow run of its own, its result written back to the training run."""

import json

import pytest

from flows.eval import rl_eval
from flows.sync_rl import sync_rl
from miles.config import ConfigError
from miles.evaluation.checkpoint_eval import evaluations_path
from miles.state.run_dir import RunDir
from tests.helpers.history import flow_run_artifacts

EVAL = ["eval.datasets=[{name: sums, task: addition, max_prompts: 16}]", "eval.interval=2"]


def test_a_checkpoint_evaluated_apart_equals_the_evaluation_during_training_and_is_written_back(
    ray_session, prefect_api, small_config
):
    config = small_config(*EVAL, num_rollout=4, save_interval=2)
    training = sync_rl(config, return_state=True)
    assert training.is_completed()
    training_id = training.state_details.flow_run_id
    run_dir = RunDir(config.run_dir)
    first, last = run_dir.checkpoint(1), run_dir.checkpoint(3)

    # The trigger of checkpoint 1 was lost: checkpoint 3's evaluation catches up with it, first.
    state = rl_eval(str(last), str(training_id), return_state=True)
    assert state.is_completed(), state.message
    (record,) = state.result()
    caught_up = json.loads(evaluations_path(run_dir, 1).read_text())
    assert evaluations_path(run_dir, 1).stat().st_mtime_ns < evaluations_path(run_dir, 3).stat().st_mtime_ns
    # The same weights (versions 2 and 4), data set, seeds and engines' sampling as the run's own evaluations at
    # rollouts 2 and 4.
    for (stored,), checkpoint in ((caught_up, first), ([record], last)):
        (during,) = [r for r in run_dir.evaluations("sums") if r["rollout_id"] == stored["weight_version"]]
        assert stored["checkpoint"] == str(checkpoint)
        for key in ("rollout_id", "reward_mean", "pass_at_1", "prompts", "samples", "response_length_mean"):
            assert stored[key] == during[key], key
    assert json.loads(evaluations_path(run_dir, 3).read_text()) == [record]

    # Checkpoint 1's trigger again (late, or repeated): the stored records, not a second evaluation.
    written = evaluations_path(run_dir, 1).stat().st_mtime_ns
    assert rl_eval(str(first)) == caught_up and evaluations_path(run_dir, 1).stat().st_mtime_ns == written
    for flow_run_id in (training_id, state.state_details.flow_run_id):
        (artifact,) = [a for a in flow_run_artifacts(flow_run_id) if a.key == "run-checkpoint-evals"]
        rows = [(row["rollout_id"], row["checkpoint"]) for row in json.loads(artifact.data)]
        assert rows == [(2, str(first)), (4, str(last))]


def test_a_path_that_is_not_a_model_checkpoint_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="is not a run's checkpoint"):
        rl_eval.fn(str(tmp_path))
