"""train_step under Prefect retries: a retry of a trained rollout returns its metrics and does not step."""

import ray
import torch
from prefect import flow

from miles.run import RLRun
from miles.train.actor import TrainActor
from tasks import generate, get, train_step
from tests.helpers.history import stored_task_runs


def test_retried_train_step_does_not_step_again(ray_session, prefect_api, small_config, monkeypatch):
    weights_after_first_attempt = {}
    real_train = RLRun.train

    def train_then_fail_once(self, rollout_id, table):
        metrics = real_train(self, rollout_id, table)
        if not weights_after_first_attempt:
            weights_after_first_attempt.update(self.trainer.call(TrainActor.weights))
            raise ConnectionError("lost the trainer's reply")  # the step happened, the task still fails
        return metrics

    monkeypatch.setattr(RLRun, "train", train_then_fail_once)

    @flow
    def one_iteration(run: RLRun) -> dict:
        generate(run, 0)
        return train_step(run, 0, get(run, 0))

    with RLRun(small_config(num_rollout=1)) as run:
        initial_weights = run.trainer.call(TrainActor.weights)
        state = one_iteration(run, return_state=True)
        final_weights = run.trainer.call(TrainActor.weights)
        trained = ray.get(run.trainer.handles[0].__ray_call__.remote(lambda actor: sorted(actor.trained)))

    assert state.is_completed()
    assert trained == [0]
    assert any(not torch.equal(initial_weights[k], weights_after_first_attempt[k]) for k in initial_weights)
    assert all(torch.equal(final_weights[k], weights_after_first_attempt[k]) for k in final_weights)

    task_run = stored_task_runs(state.state_details.flow_run_id)["train_step[rollout=0]"]
    assert task_run.run_count == 2 and task_run.state.is_completed()
