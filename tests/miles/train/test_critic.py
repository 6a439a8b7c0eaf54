"""The critic (algo.advantage_estimator=gae): CriticActor in-process, then in the plain loops: its own trainer group,
ledger and checkpoints, values stored beside each rollout, recovery and resharding as the policy's trainer has them."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForTokenClassification, AutoTokenizer

from miles.engines.torch_engine import TorchEngine
from miles.loop import run_sync
from miles.run import RLRun
from miles.state.run_dir import RunDir
from miles.train.batch import RETURNS, VALUES
from miles.train.critic import CriticActor
from tests.helpers import RECOVERY_RUN, final_weights, max_abs_diff
from tests.helpers.samples import make_requests, seeded, training_table

GAE = ("algo.advantage_estimator=gae",)


def critic_weights(run_dir, rollout_id: int) -> dict:
    return load_file(str(RunDir(run_dir).critic().checkpoint(rollout_id) / "model" / "model.safetensors"))


def test_a_gae_run_trains_the_critic_beside_the_policy(ray_session, small_config):
    config = small_config(*GAE, "critic.warmup_rollouts=1", num_rollout=3)
    records = run_sync(config)
    run_dir = RunDir(config.run_dir)
    assert sorted(run_dir.critic().ledger().trained) == [0, 1, 2]
    assert sorted(run_dir.ledger().trained) == [0, 1, 2]
    assert records[0].get("critic_warmup") == 1.0 and "pg_loss" not in records[0]
    assert all("value_loss" in r and "pg_loss" in r for r in records[1:])
    for rollout_id in range(3):
        values = pa.ipc.open_file(str(run_dir.rollouts / f"values_{rollout_id}.arrow")).read_all()
        assert values.num_rows == config.samples_per_rollout
    assert (run_dir.critic().checkpoint(2) / "model" / "model.safetensors").exists()


@pytest.fixture(scope="module")
def rollout(tiny_model_dir) -> pa.Table:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    requests = make_requests(tokenizer, [f"{a}+{a + 3}=" for a in range(8)])
    results = TorchEngine(str(tiny_model_dir), num_threads=1).generate(seeded(requests, 3))
    return training_table(requests, results)


def _critic(small_config, tiny_model_dir, run_dir, checkpoint=None, *overrides) -> CriticActor:
    config = small_config(*GAE, *overrides, run_dir=str(run_dir)).critic_view()
    RunDir(config.run_dir).create()
    return CriticActor(config, str(tiny_model_dir), checkpoint=checkpoint)


def _with_targets(table: pa.Table, values: list[list[float]], target: float) -> pa.Table:
    as_lists = pa.list_(pa.float32())
    returns = [[target] * len(v) for v in values]
    return table.append_column(VALUES, pa.array(values, as_lists)).append_column(RETURNS, pa.array(returns, as_lists))


def test_a_tokens_value_is_the_heads_output_at_the_token_before_it(small_config, tiny_model_dir, tmp_path, rollout):
    critic = _critic(small_config, tiny_model_dir, tmp_path)
    values = critic.values(rollout)
    head = AutoModelForTokenClassification.from_pretrained(tiny_model_dir, num_labels=1).eval()
    head.load_state_dict(critic.model.state_dict())
    for row, sample_values in enumerate(values):
        prompt, response = rollout.column("prompt_ids")[row].as_py(), rollout.column("response_ids")[row].as_py()
        assert len(sample_values) == len(response)
        with torch.no_grad():
            out = head(input_ids=torch.tensor([prompt + response])).logits[0, :, 0]
        expected = out[len(prompt) - 1 : len(prompt) + len(response) - 1]  # the state each token was sampled from
        torch.testing.assert_close(torch.tensor(sample_values), expected, atol=1e-5, rtol=1e-5)


def test_the_critic_learns_the_returns_and_its_checkpoint_resumes_it(small_config, tiny_model_dir, tmp_path, rollout):
    critic = _critic(small_config, tiny_model_dir, tmp_path, None, "critic.cliprange_value=null")
    table = _with_targets(rollout, critic.values(rollout), target=1.0)
    losses = [critic.train(rollout_id, table)["value_loss"] for rollout_id in range(4)]
    assert max(losses[1:]) < 0.5 * losses[0], losses  # the values move towards the returns
    assert critic.train(3, table)["value_loss"] == losses[3]  # a retried rollout is answered, not trained again
    checkpoint = critic.save_checkpoint(3, {})
    resumed = _critic(small_config, tiny_model_dir, tmp_path, checkpoint, "critic.cliprange_value=null")
    torch.testing.assert_close(
        torch.tensor(sum(resumed.values(rollout), [])), torch.tensor(sum(critic.values(rollout), []))
    )
    assert resumed.train(4, table)["value_loss"] == pytest.approx(critic.train(4, table)["value_loss"], rel=1e-5)


@pytest.fixture(scope="module")
def uninterrupted_gae(ray_session, tiny_model_dir, tmp_path_factory) -> tuple[dict, dict]:
    """(policy, critic) final weights of an uninterrupted gae run of RECOVERY_RUN."""
    from tests.helpers import small_config_for

    config = small_config_for(tiny_model_dir, tmp_path_factory.mktemp("gae") / "run", *GAE, **RECOVERY_RUN)
    run_sync(config)
    return final_weights(config.run_dir, 4), critic_weights(config.run_dir, 4)


def test_a_run_stopped_before_the_critics_turn_resumes_with_the_critic_caught_up(small_config, uninterrupted_gae):
    """Stopped after the policy trained rollout 2 and before the critic did: the next start's critic replays
    rollout 2 (the policy's ledger has it) onto its checkpoint 1, and both end as the uninterrupted run."""
    config = small_config(*GAE, **RECOVERY_RUN)
    with RLRun(config) as run:
        for rollout_id in range(3):
            run.generate(rollout_id)
            run.compute_values(rollout_id)
            table = run.get(rollout_id)
            run.train(rollout_id, table)
            if rollout_id < 2:
                run.train_critic(rollout_id, table)
            run.sync_weights(rollout_id)
            if run.should_save(rollout_id):
                run.save_checkpoint(rollout_id)
            run.finish_iteration(rollout_id)
    assert sorted(RunDir(config.run_dir).critic().ledger().trained) == [0, 1]

    records = run_sync(config)

    assert [r["rollout_id"] for r in records] == [3, 4]
    assert sorted(RunDir(config.run_dir).critic().ledger().trained) == [0, 1, 2, 3, 4]
    policy, critic = uninterrupted_gae
    assert max_abs_diff(final_weights(config.run_dir, 4), policy) == 0.0
    assert max_abs_diff(critic_weights(config.run_dir, 4), critic) == 0.0


def test_a_critic_saved_by_two_workers_resumes_on_one_and_back(small_config, uninterrupted_gae):
    for workers in (2, 1, 2):
        run_sync(small_config(*GAE, "iterations_per_run=2", f"critic.num_workers={workers}", **RECOVERY_RUN))
    run_dir = RunDir(small_config().run_dir).critic()
    assert sorted(run_dir.ledger().trained) == [0, 1, 2, 3, 4]
    shards = [len(list((run_dir.checkpoint(i) / "optimizer").glob("*.safetensors"))) for i in (1, 3, 4)]
    assert shards == [2, 1, 2]  # one optimizer shard per critic worker that saved it
    policy, critic = uninterrupted_gae
    gaps = (
        max_abs_diff(final_weights(run_dir.path.parent, 4), policy),
        max_abs_diff(critic_weights(run_dir.path.parent, 4), critic),
    )
    print(f"critic 2 -> 1 -> 2 workers vs 1 uninterrupted: policy {gaps[0]:.2e}, critic {gaps[1]:.2e}")
    assert max(gaps) < 1e-5
