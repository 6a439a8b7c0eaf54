"""RolloutExecutor: scoring in generate (on the tiny model), and get, the handover of a stored rollout."""

import logging
import math

import numpy as np
import pyarrow as pa
import pytest

from miles.config import RolloutConfig, load_config
from miles.data import DataSource
from miles.rewards import resolve_reward
from miles.rollout.inference_controller import InferenceController
from miles.rollout.rollout_executor import RolloutExecutor
from miles.rollout.schema import ROLLOUT_SCHEMA
from miles.rollout.store import RolloutStore
from miles.run_dir import RunDir
from tests.helpers.samples import rollout_table


def _executor(tmp_path, global_batch_size, *overrides):
    config = load_config(
        None,
        [
            "rollout.rollout_batch_size=4",
            "rollout.n_samples_per_prompt=5",
            f"train.global_batch_size={global_batch_size}",
            f"train.micro_batch_size={global_batch_size}",
            *overrides,
        ],
        run_dir=str(tmp_path),
    )

    class Tok:
        eos_token_id = 2

    store = RolloutStore(RunDir(tmp_path).rollouts)
    return RolloutExecutor(
        config, None, Tok(), DataSource([{"prompt": "1+1=", "label": "2"}], seed=0), store, None
    ), store


def test_get_normalises_per_group_and_trims_to_whole_global_batches(tmp_path):
    executor, store = _executor(tmp_path, global_batch_size=4)
    table = rollout_table(n=10)  # groups 0..4 of two samples, rewards alternate 0/1
    store.write(3, table)

    handed, stats = executor.get(3, trainer_version=5)

    assert handed.num_rows == 8 and handed.schema.remove_metadata().equals(ROLLOUT_SCHEMA.remove_metadata())
    assert handed.column("sample_index").to_pylist() == list(range(8))
    # Each group is (0, 1): mean 0.5, unbiased std sqrt(0.5), so the advantages are -/+ 0.5/sqrt(0.5).
    expected = np.tile([-0.5 / (np.sqrt(0.5) + 1e-6), 0.5 / (np.sqrt(0.5) + 1e-6)], 4)
    np.testing.assert_allclose(handed.column("advantage").to_numpy(), expected, rtol=1e-6)
    assert stats == {
        "staleness_mean": 0.0,
        "dropped_groups": 0,
        "failed_samples": 0,
    }  # rollout_table stamps weight_version = rollout_id


def test_get_refuses_a_rollout_smaller_than_one_global_batch(tmp_path):
    executor, store = _executor(tmp_path, global_batch_size=20)
    store.write(0, rollout_table(n=6))
    with pytest.raises(ValueError, match="fewer than train.global_batch_size"):
        executor.get(0, trainer_version=0)


def _with_column(table, name, values):
    field = ROLLOUT_SCHEMA.field(name)
    return table.set_column(table.schema.get_field_index(name), field, pa.array(values, field.type))


def _with_versions(table, versions):
    return _with_column(table, "weight_version", versions)


def test_groups_staler_than_the_bound_are_dropped_and_counted(tmp_path):
    executor, store = _executor(tmp_path, 4, "rollout.max_weight_staleness=1")
    # groups (two samples each): 0 -> v7, 1 -> v6, 2 -> v5 and v7 (its oldest sample counts), 3 -> v7, 4 -> v7
    store.write(1, _with_versions(rollout_table(n=10), [7, 7, 6, 6, 5, 7, 7, 7, 7, 7]))

    handed, stats = executor.get(1, trainer_version=7)

    assert handed.column("group_index").to_pylist() == [0, 0, 1, 1, 3, 3, 4, 4]
    assert stats["dropped_groups"] == 1
    assert stats["staleness_mean"] == pytest.approx(2 / 8)


def test_a_staleness_bound_that_leaves_less_than_a_batch_says_so(tmp_path):
    executor, store = _executor(tmp_path, 4, "rollout.max_weight_staleness=0")
    store.write(2, _with_versions(rollout_table(n=10), [4] * 10))
    with pytest.raises(
        ValueError, match=r"dropping 5 groups staler than rollout.max_weight_staleness=0.*global_batch_size"
    ):
        executor.get(2, trainer_version=5)


def _with_failed(table, failed):
    """`table` with the samples at positions `failed` as generate stores samples whose reward failed."""
    rewards = [None if i in failed else r for i, r in enumerate(table.column("raw_reward").to_pylist())]
    statuses = [
        "failed" if i in failed else s for i, s in enumerate(table.column("status").cast(pa.string()).to_pylist())
    ]
    return _with_column(_with_column(table, "raw_reward", rewards), "status", statuses)


def test_failed_samples_are_left_out_before_staleness_and_advantages(tmp_path):
    executor, store = _executor(tmp_path, 5, "rollout.max_weight_staleness=1")
    table = _with_column(rollout_table(n=12), "group_index", [i // 3 for i in range(12)])  # rewards alternate 0/1
    # Sample 2 is far staler than the bound: as a failed sample it must not take group 0 down with it.
    table = _with_versions(table, [5, 5, 0] + [5] * 9)
    store.write(5, _with_failed(table, {2, 7}))

    handed, stats = executor.get(5, trainer_version=5)

    assert handed.column("sample_index").to_pylist() == [0, 1, 3, 4, 5, 6, 8, 9, 10, 11]
    assert set(handed.column("status").cast(pa.string()).to_pylist()) <= {"completed", "truncated"}
    assert stats == {"staleness_mean": 0.0, "dropped_groups": 0, "failed_samples": 2}
    pair = 0.5 / (np.sqrt(0.5) + 1e-6)  # rewards (0, 1): mean 0.5, unbiased std sqrt(0.5)
    third = (1 / 3) / (np.sqrt(1 / 3) + 1e-6)  # rewards (1, 0, 1): mean 2/3, unbiased std sqrt(1/3)
    expected = [-pair, pair, third, -2 * third, third, 0.0, 0.0, third, -2 * third, third]  # group 2 is (0, 0)
    np.testing.assert_allclose(handed.column("advantage").to_numpy(), expected, rtol=1e-6)


def test_too_few_samples_after_failures_names_the_failed_count(tmp_path):
    executor, store = _executor(tmp_path, 4, "rollout.max_weight_staleness=0")
    store.write(0, _with_versions(_with_failed(rollout_table(n=10), {0, 1, 2, 3, 4}), [0] * 8 + [-1] * 2))
    with pytest.raises(
        ValueError, match=r"has 3 samples after excluding 5 failed samples and dropping 1 groups staler"
    ):
        executor.get(0, trainer_version=0)


LABELS = [
    "2",
    "raise",
    "nan",
    "8",
    "inf",
    "none",
    "text",
]  # rewards_for_tests.fails_on_some_labels fails on all but digits


@pytest.fixture(scope="module")
def controller(ray_session, tiny_model_dir):
    controller = InferenceController(str(tiny_model_dir), 0, RolloutConfig(num_threads=1))
    yield controller
    controller.shutdown()


def _generating_executor(tmp_path, controller, tokenizer, reward: str):
    config = load_config(
        None,
        [
            f"rollout.rollout_batch_size={len(LABELS)}",
            "rollout.n_samples_per_prompt=2",
            "train.global_batch_size=2",
            "train.micro_batch_size=2",
            f"data.reward={reward}",
        ],
        run_dir=str(tmp_path),
    )
    rows = [{"prompt": f"{k}+1=", "label": label} for k, label in enumerate(LABELS)]
    store = RolloutStore(RunDir(tmp_path).rollouts)
    data = DataSource(rows, seed=0, shuffle=False)
    return RolloutExecutor(config, controller, tokenizer, data, store, resolve_reward(config.data.reward)), store


def test_samples_whose_reward_fails_are_stored_as_failed(tmp_path, controller, tokenizer, caplog):
    reward = "tests.miles.rollout.rewards_for_tests:fails_on_some_labels"
    executor, store = _generating_executor(tmp_path, controller, tokenizer, reward)

    with caplog.at_level(logging.WARNING, logger="miles.rollout.rollout_executor"):
        summary = executor.generate(0)

    table = store.read(0)
    labels = table.column("label").to_pylist()
    statuses = table.column("status").cast(pa.string()).to_pylist()
    rewards = table.column("raw_reward").to_pylist()
    scored = [i for i, label in enumerate(labels) if label.isdigit()]
    assert [i for i, s in enumerate(statuses) if s == "failed"] == [i for i in range(len(labels)) if i not in scored]
    assert all(rewards[i] is None for i in range(len(labels)) if i not in scored)
    assert all(statuses[i] in ("completed", "truncated") and math.isfinite(rewards[i]) for i in scored)
    assert summary["failed_samples"] == 10 and summary["samples"] == 14
    assert summary["reward_mean"] == pytest.approx(np.mean([rewards[i] for i in scored]))
    assert executor.data_source.position == len(LABELS)

    warnings = [r for r in caplog.records if r.name == "miles.rollout.rollout_executor"]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    message = warnings[0].getMessage()
    first_text = tokenizer.decode(table.column("response_ids")[2].as_py(), skip_special_tokens=True)
    assert reward in message and "10 of 14 samples" in message
    assert "sample 2 " in message and "RuntimeError: cannot score" in message and repr(first_text)[:60] in message

    handed, stats = executor.get(0, trainer_version=0)
    assert handed.column("label").to_pylist() == ["2", "2", "8", "8"]
    assert stats["failed_samples"] == 10
    assert np.isfinite(handed.column("advantage").to_numpy()).all()


def test_a_rollout_whose_rewards_all_fail_is_stored_but_not_handed_over(tmp_path, controller, tokenizer, caplog):
    reward = "tests.miles.rollout.rewards_for_tests:always_raises"
    executor, store = _generating_executor(tmp_path, controller, tokenizer, reward)

    with caplog.at_level(logging.WARNING, logger="miles.rollout.rollout_executor"):
        summary = executor.generate(0)

    assert summary["failed_samples"] == 14 and math.isnan(summary["reward_mean"])
    assert "14 of 14 samples" in caplog.text and "KeyError: '2'" in caplog.text
    assert executor.generate(0) == pytest.approx(summary, nan_ok=True)  # the stored rollout is reused
    with pytest.raises(ValueError, match="has 0 samples after excluding 14 failed samples"):
        executor.get(0, trainer_version=0)


def test_an_interrupt_in_the_reward_function_stops_generate(tmp_path, controller, tokenizer):
    reward = "tests.miles.rollout.rewards_for_tests:interrupted"
    executor, store = _generating_executor(tmp_path, controller, tokenizer, reward)
    with pytest.raises(KeyboardInterrupt):
        executor.generate(0)
    assert not store.exists(0)
