"""RolloutExecutor: scoring in generate (on the tiny model), and get, the handover of a stored rollout."""

import logging
import math

import numpy as np
import pyarrow as pa
import pytest

from miles.config import RolloutConfig, load_config
from miles.data import DataSource
from miles.engines.base import GenerateRequest, SamplingParams
from miles.rewards import exact_match, resolve_reward
from miles.rollout.handover import uneven_groups
from miles.rollout.inference_controller import InferenceController
from miles.rollout.rollout_executor import PromptOrder, RolloutExecutor, scorer_identity
from miles.rollout.schema import ROLLOUT_SCHEMA
from miles.rollout.store import DamagedRollout, RolloutStore
from miles.state.run_dir import RunDir
from miles.train.algorithms.estimators import ReMax, trained_tokens
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
        name_or_path = ""  # built in memory: no model files to read more EOS ids from

    store = RolloutStore(RunDir(tmp_path).rollouts)
    return RolloutExecutor(
        config, None, Tok(), DataSource([{"prompt": "1+1=", "label": "2"}], seed=0), store, None
    ), store


def test_get_normalises_per_group_and_hands_over_every_sample(tmp_path):
    """10 samples with a global batch of 4: all of them go (the last step takes 2), none is cut off."""
    executor, store = _executor(tmp_path, global_batch_size=4)
    table = rollout_table(n=10)  # groups 0..4 of two samples, rewards alternate 0/1
    store.write(3, table)

    handed, stats = executor.get(3, trainer_version=5)

    assert handed.num_rows == 10 and handed.schema.remove_metadata().equals(ROLLOUT_SCHEMA.remove_metadata())
    assert handed.column("sample_index").to_pylist() == list(range(10))
    # Each group is (0, 1): mean 0.5, unbiased std sqrt(0.5), so the advantages are -/+ 0.5/sqrt(0.5).
    expected = np.tile([-0.5 / (np.sqrt(0.5) + 1e-6), 0.5 / (np.sqrt(0.5) + 1e-6)], 5)
    np.testing.assert_allclose(handed.column("advantage").to_numpy(), expected, rtol=1e-6)
    assert stats == {
        "staleness_mean": 0.0,
        "token_staleness_mean": 0.0,
        "token_staleness_max": 0,
        "mixed_version_samples": 0,
        "dropped_groups": 0,
        "dropped_samples": 0,
        "failed_samples": 0,
        "filtered_groups": 0,
        "uneven_groups": 0,
        "uneven_samples": 0,
        "zero_advantage_groups": 0,
    }  # rollout_table stamps weight_version = rollout_id


def test_get_leaves_out_the_fewest_whole_groups_that_split_unevenly_over_the_workers(tmp_path):
    """A failed sample leaves 9 for 2 workers: the group of one goes, not half a global batch."""
    executor, store = _executor(tmp_path, 4, "train.num_workers=2")
    table = _with_column(rollout_table(n=10), "raw_reward", [0.0, 1.0, 0.0, 1.0, None, 1.0, 0.0, 1.0, 0.0, 1.0])
    store.write(0, _with_column(table, "status", ["completed"] * 4 + ["failed"] + ["completed"] * 5))
    handed, stats = executor.get(0, trainer_version=0)
    assert handed.column("sample_index").to_pylist() == [0, 1, 2, 3, 6, 7, 8, 9]
    assert (stats["failed_samples"], stats["uneven_groups"], stats["uneven_samples"]) == (1, 1, 1)


@pytest.mark.parametrize(
    ("groups", "workers", "left_out"),
    [
        ([0, 0, 1, 1, 1, 2, 2], 2, [1]),  # 7 samples: the one odd group goes
        ([0, 0, 0, 1, 1, 1, 1, 2, 2], 4, [0, 2]),  # sizes 3, 4, 2: 9 = 1 mod 4, and 3 + 2 is the least that is
        ([0, 0, 0, 1, 2, 2, 2, 2, 2], 4, [1]),  # sizes 3, 1, 5: the group of one, not the group of five
        ([0, 1, 2], 2, [2]),  # three groups of one: the last goes
        ([0, 1, 1, 2, 2, 2], 3, []),
    ],
)
def test_uneven_groups_are_the_fewest_samples(groups, workers, left_out):
    assert uneven_groups(np.array(groups), workers).tolist() == left_out


def test_get_bounds_the_staleness_of_every_token(tmp_path):
    """A group goes when any token of it is more than rollout.max_weight_staleness versions behind the trainer; the
    staleness of the tokens kept, and the samples a push split between versions, are counted."""
    executor, store = _executor(tmp_path, 2, "rollout.max_weight_staleness=1")
    versions = [5] * 10  # response lengths 11, 10, ..., 2
    versions[0] = [3] + [5] * 10  # group 0: one token two versions behind trainer version 5
    versions[3] = [4] * 3 + [5] * 5  # group 1: a push after its third token
    table = _with_versions(rollout_table(n=10, rollout_id=5), versions)
    store.write(3, table)

    handed, stats = executor.get(3, trainer_version=5)

    assert handed.column("sample_index").to_pylist() == list(range(2, 10))
    assert stats["dropped_groups"] == 1 and stats["dropped_samples"] == 2
    assert stats["mixed_version_samples"] == 1 and stats["token_staleness_max"] == 1
    assert stats["token_staleness_mean"] == pytest.approx(3 / sum(range(2, 10)))  # 3 stale of 44 tokens


def test_get_refuses_a_rollout_smaller_than_one_global_batch(tmp_path):
    executor, store = _executor(tmp_path, global_batch_size=20)
    store.write(0, rollout_table(n=6))
    with pytest.raises(ValueError, match="fewer than train.global_batch_size"):
        executor.get(0, trainer_version=0)


def _with_column(table, name, values):
    field = ROLLOUT_SCHEMA.field(name)
    return table.set_column(table.schema.get_field_index(name), field, pa.array(values, field.type))


def _with_versions(table, versions):
    """Each sample's tokens of one weight version, or of the per-token versions given for it (a list)."""
    lengths = table.column("response_length").to_pylist()
    per_token = [v if isinstance(v, list) else [v] * n for v, n in zip(versions, lengths, strict=True)]
    table = _with_column(table, "weight_version", [min(v) for v in per_token])
    return _with_column(table, "weight_versions", per_token)


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
    assert stats == {
        "staleness_mean": 0.0,
        "token_staleness_mean": 0.0,
        "token_staleness_max": 0,
        "mixed_version_samples": 0,
        "dropped_groups": 0,
        "dropped_samples": 0,
        "failed_samples": 2,
        "filtered_groups": 0,
        "uneven_groups": 0,
        "uneven_samples": 0,
        "zero_advantage_groups": 1,  # group 2: rewards (0, 0)
    }
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
    return RolloutExecutor(
        config, controller, tokenizer, data, store, resolve_reward(config.data.reward, config)
    ), store


def test_samples_whose_reward_fails_are_stored_as_failed(tmp_path, controller, tokenizer, caplog):
    reward = "tests.miles.rollout.rewards_for_tests:fails_on_some_labels"
    executor, store = _generating_executor(tmp_path, controller, tokenizer, reward)

    with caplog.at_level(logging.WARNING, logger="miles.rollout.generation"):
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
    assert executor.prompt_order.end_of(0) == len(LABELS)

    warnings = [r for r in caplog.records if r.name == "miles.rollout.generation"]
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

    with caplog.at_level(logging.WARNING, logger="miles.rollout.generation"):
        summary = executor.generate(0)

    assert summary["failed_samples"] == 14 and math.isnan(summary["reward_mean"])
    assert "14 of 14 samples" in caplog.text and "KeyError: '2'" in caplog.text
    assert executor.generate(0) == pytest.approx(summary, nan_ok=True)  # the stored rollout is reused
    with pytest.raises(ValueError, match="has 0 samples after excluding 14 failed samples"):
        executor.get(0, trainer_version=0)


def test_an_untrained_rollout_scored_by_another_reward_is_generated_again(tmp_path, controller, tokenizer, caplog):
    """The user fixed a reward that failed every sample and reran: the stored rollout is not reused as it was."""
    failing, store = _generating_executor(
        tmp_path, controller, tokenizer, "tests.miles.rollout.rewards_for_tests:always_raises"
    )
    assert failing.generate(0)["failed_samples"] == 14
    fixed, _ = _generating_executor(
        tmp_path, controller, tokenizer, "tests.miles.rollout.rewards_for_tests:fails_on_some_labels"
    )
    with caplog.at_level(logging.WARNING, logger="miles.rollout.rollout_executor"):
        assert fixed.generate(0)["failed_samples"] == 10
    assert (
        "rollout 0 is generated again: it was scored by data.reward=tests.miles.rollout.rewards_for_tests:always_raises@"
        in caplog.text
    )
    assert [p.name for p in (store.root / "set_aside").iterdir()] == ["rollout_0.rescored.0.arrow"]
    assert fixed.generate(0)["failed_samples"] == 10  # its own rollout is reused


def test_a_reward_changed_in_place_is_another_scorer(tmp_path, monkeypatch):
    module = tmp_path / "my_reward.py"
    module.write_text("def score(response, label, finished):\n    return 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config(None, ["data.reward=my_reward:score"])
    before = scorer_identity(config, resolve_reward(config.data.reward, config))
    module.write_text("def score(response, label, finished):\n    return 1.0\n")
    after = scorer_identity(config, resolve_reward(config.data.reward, config))
    assert before.startswith("data.reward=my_reward:score@") and after.startswith("data.reward=my_reward:score@")
    assert before != after


def test_a_model_reward_is_another_scorer_when_its_settings_change_what_it_scores():
    def identity(*overrides: str) -> str:
        config = load_config(None, ["data.reward=judge", "judge.model_path=/models/judge", *overrides])
        return scorer_identity(config, resolve_reward(config.data.reward, config))

    assert identity() == identity("judge.num_engines=4")  # more engines score the same
    assert identity() != identity("judge.model_path=/models/other")
    assert identity() != identity("judge.prompt_template=Is {response} right?")


def test_a_damaged_untrained_rollout_is_set_aside_and_generated_again(tmp_path, controller, tokenizer, caplog):
    executor, store = _generating_executor(tmp_path, controller, tokenizer, "digit_match")
    summary = executor.generate(0)
    content = store.path(0).read_bytes()
    store.path(0).write_bytes(content[: len(content) // 2])
    with pytest.raises(DamagedRollout, match=rf"^{store.path(0)} is damaged: "):
        store.read(0)
    again, _ = _generating_executor(tmp_path, controller, tokenizer, "digit_match")
    with caplog.at_level(logging.WARNING, logger="miles.rollout.rollout_executor"):
        assert again.generate(0) == summary  # the same seeds draw the same samples
    assert f"rollout 0 is generated again: {store.path(0)} is damaged" in caplog.text
    assert (store.root / "set_aside" / "rollout_0.damaged.0.arrow").read_bytes() == content[: len(content) // 2]
    assert store.read(0).num_rows == 14


def test_an_interrupt_in_the_reward_function_stops_generate(tmp_path, controller, tokenizer):
    reward = "tests.miles.rollout.rewards_for_tests:interrupted"
    executor, store = _generating_executor(tmp_path, controller, tokenizer, reward)
    with pytest.raises(KeyboardInterrupt):
        executor.generate(0)
    assert not store.exists(0)


def test_a_rollout_of_episodes_stores_one_row_per_episode_with_its_mask(tmp_path, controller, tokenizer):
    """rollout.env: each sample is an episode of the quiz, stored whole: the replies masked out of the loss, the
    turns and end reason per row; `get` hands it over like any rollout."""
    config = load_config(
        None,
        [
            "rollout.rollout_batch_size=2",
            "rollout.n_samples_per_prompt=2",
            "train.global_batch_size=2",
            "train.micro_batch_size=2",
            "rollout.env=tests.miles.envs.envs_for_tests:SumQuiz",
        ],
        run_dir=str(tmp_path),
    )
    rows = [{"prompt": "1+2=", "label": "3"}, {"prompt": "20+5=", "label": "25"}]
    store = RolloutStore(RunDir(tmp_path).rollouts)
    executor = RolloutExecutor(config, controller, tokenizer, DataSource(rows, seed=0, shuffle=False), store, None)

    summary = executor.generate(0)

    table = store.read(0)
    assert table.num_rows == 4 and summary["samples"] == 4
    for row in table.to_pylist():
        mask, turns = row["loss_mask"], row["num_turns"]
        assert len(mask) == len(row["response_ids"]) == len(row["rollout_logprobs"]) == row["response_length"]
        assert mask[0] == 1 and all(lp == 0.0 for lp, m in zip(row["rollout_logprobs"], mask, strict=True) if not m)
        # a masked run of tokens between model turns for every reply the quiz gave
        model_runs = sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))
        assert model_runs == turns and 1 <= turns <= 3
        assert (row["status"], row["end_reason"]) in (("completed", "done"), ("truncated", "max_new_tokens"))
        assert row["raw_reward"] is not None and row["prompt"] == rows[row["group_index"]]["prompt"]
    assert summary["turns_mean"] == pytest.approx(np.mean(table.column("num_turns").to_numpy()))
    handed, _ = executor.get(0, trainer_version=0)
    assert handed.num_rows == 4 and np.isfinite(handed.column("advantage").to_numpy()).all()
    assert executor.generate(0) == summary  # stored once: a retry reads the file


def _with_rewards(table, rewards):
    return _with_column(table, "raw_reward", rewards)


def test_dynamic_sampling_leaves_out_groups_whose_rewards_are_all_equal(tmp_path):
    executor, store = _executor(tmp_path, 4, "algo.dynamic_sampling=true")  # rollout_batch_size 4
    # groups of two: 0 (1, 1) equal, 1 (0, 1), 2 (0, 0) equal, 3 (1, 0), 4 (0.5, 1), 5 (1, 0), 6 (0, 1)
    store.write(0, _with_rewards(rollout_table(n=14), [1, 1, 0, 1, 0, 0, 1, 0, 0.5, 1, 1, 0, 0, 1]))

    handed, stats = executor.get(0, trainer_version=0)

    # The first four groups with a reward spread are kept (group 6 is one too many); the equal ones go.
    assert handed.column("group_index").to_pylist() == [1, 1, 3, 3, 4, 4, 5, 5]
    assert stats["filtered_groups"] == 2 and stats["zero_advantage_groups"] == 0


def test_dynamic_sampling_keeps_just_enough_equal_groups_for_one_global_batch(tmp_path):
    executor, store = _executor(tmp_path, 5, "algo.dynamic_sampling=true")
    # groups of two: 0 (1, 1), 1 (0, 0), 2 (0, 1), 3 (1, 1), 4 (0, 0): one group with spread, 2 samples < 5
    store.write(0, _with_rewards(rollout_table(n=10), [1, 1, 0, 0, 0, 1, 1, 1, 0, 0]))

    handed, stats = executor.get(0, trainer_version=0)

    # Groups 0 and 1 fill it up to 6 samples, all trained (a step of 5, then one of 1).
    assert handed.column("group_index").to_pylist() == [0, 0, 1, 1, 2, 2]
    assert stats["filtered_groups"] == 2 and stats["zero_advantage_groups"] == 2


def test_advantages_come_from_the_configured_estimator(tmp_path):
    executor, store = _executor(tmp_path, 2, "algo.advantage_estimator=rloo")
    # groups of three: (1, 0, 0) and (0.5, 0.5, 2)
    store.write(
        0, _with_column(_with_rewards(rollout_table(n=6), [1, 0, 0, 0.5, 0.5, 2]), "group_index", [0] * 3 + [1] * 3)
    )
    handed, _ = executor.get(0, trainer_version=0)
    # RLOO: r_i - mean of the other two: 1 - 0, 0 - 0.5, 0 - 0.5; 0.5 - 1.25, 0.5 - 1.25, 2 - 0.5
    np.testing.assert_allclose(handed.column("advantage").to_numpy(), [1, -0.5, -0.5, -0.75, -0.75, 1.5], rtol=1e-6)


def test_trained_tokens_count_the_loss_masks_ones_of_the_rows_handed_over():
    table = pa.table({"loss_mask": pa.array([[1, 1, 0, 1], [], [0, 0], [1, 1, 1]], pa.list_(pa.int8()))})
    np.testing.assert_array_equal(trained_tokens(table), [3, 0, 0, 3])
    # a filtered and sliced table reads its own rows, not the buffers behind them
    np.testing.assert_array_equal(trained_tokens(table.filter(pa.array([True, False, True, True])).slice(1)), [0, 3])


def test_overlong_responses_lose_reward_before_the_advantages(tmp_path):
    executor, store = _executor(
        tmp_path,
        2,
        "algo.advantage_estimator=dr_grpo",
        "rollout.max_new_tokens=10",
        "algo.overlong_buffer_len=4",
        "algo.overlong_penalty=0.5",
    )
    table = _with_column(rollout_table(n=4), "response_length", [6, 7, 9, 10])
    store.write(0, _with_rewards(_with_column(table, "group_index", [0, 0, 1, 1]), [1, 1, 1, 1]))
    handed, stats = executor.get(0, trainer_version=0)
    # Penalties: length 6 -> 0, 7 -> -0.5 * 1/4, 9 -> -0.5 * 3/4, 10 -> -0.5. Scores 1, 0.875 | 0.625, 0.5.
    np.testing.assert_allclose(handed.column("advantage").to_numpy(), [0.0625, -0.0625, 0.0625, -0.0625], rtol=1e-6)
    assert stats["zero_advantage_groups"] == 0  # the raw rewards were all equal; the scores are not


class _SeedEcho:
    """A controller whose sample is the token `seed % 7 + 3`, cut at max_new_tokens on prompt "2" (so rounds hold
    different statuses); it fails the call numbered `fail_on`, once."""

    def __init__(self, fail_on: int | None = None):
        self.calls = 0
        self.fail_on = fail_on

    def generate(self, requests):
        from miles.engines.base import GenerateResult

        self.calls += 1
        if self.calls == self.fail_on:
            self.fail_on = None
            raise RuntimeError("engine died")
        return [
            GenerateResult([q.seed % 7 + 3], [-0.5], "length", [0])
            if q.prompt_ids == [1, 2]
            else GenerateResult([q.seed % 7 + 3, 2], [-0.5, -0.1], "stop", [0, 0])
            for q in requests
        ]


class _DigitTokenizer:
    eos_token_id = 2
    name_or_path = ""  # built in memory: no model files to read more EOS ids from

    def __call__(self, prompts, add_special_tokens=True):
        return {"input_ids": [[1, int(p)] for p in prompts]}

    def batch_decode(self, ids, skip_special_tokens):
        return ["".join(str(t) for t in x if t != self.eos_token_id) for x in ids]


DYNAMIC_LABELS = ["same", "same", "differ", "same", "differ", "differ", "same", "same"]


def _dynamic_executor(tmp_path, controller):
    config = load_config(
        None,
        [
            "rollout.rollout_batch_size=2",
            "rollout.n_samples_per_prompt=2",
            "rollout.max_generate_rounds=3",
            "algo.dynamic_sampling=true",
            "train.global_batch_size=2",
            "train.micro_batch_size=2",
            "data.reward=tests.miles.rollout.rewards_for_tests:constant_unless_differ",
        ],
        run_dir=str(tmp_path),
    )
    rows = [{"prompt": str(k), "label": label} for k, label in enumerate(DYNAMIC_LABELS)]
    store = RolloutStore(RunDir(tmp_path).rollouts)
    data = DataSource(rows, seed=0, shuffle=False)
    return RolloutExecutor(
        config, controller, _DigitTokenizer(), data, store, resolve_reward(config.data.reward, config)
    ), store


def test_dynamic_sampling_draws_rounds_until_enough_groups_differ(tmp_path):
    executor, store = _dynamic_executor(tmp_path, _SeedEcho())
    executor.prompt_order.ends_at(0, 0)  # rollout 1 draws from the first prompts
    summary = executor.generate(1)
    # Round 0 (prompts 0, 1) has no group with spread, round 1 (2, 3) one, round 2 (4, 5) two more: it stops there.
    table = store.read(1)
    assert summary["generate_rounds"] == 3 and summary["samples"] == 12 and summary["truncated_fraction"] == 2 / 12
    assert table.column("label").to_pylist() == [label for label in DYNAMIC_LABELS[:6] for _ in range(2)]
    # Sample and group numbers of slots 3..5 (rollout 1 x 3 rounds + round): unique within the run.
    assert table.column("sample_index").to_pylist() == list(range(12, 24))
    assert table.column("group_index").to_pylist() == [g for g in range(6, 12) for _ in range(2)]
    assert executor.prompt_order.end_of(1) == 6

    handed, stats = executor.get(1, trainer_version=1)
    assert handed.column("label").to_pylist() == ["differ"] * 4  # two groups with spread (rollout_batch_size)
    assert stats["filtered_groups"] == 3 and stats["zero_advantage_groups"] == 0


def test_an_interrupted_round_is_drawn_again_on_retry(tmp_path):
    whole, whole_store = _dynamic_executor(tmp_path / "whole", _SeedEcho())
    whole.generate(0)
    retried, retried_store = _dynamic_executor(tmp_path / "retried", _SeedEcho(fail_on=2))
    with pytest.raises(RuntimeError, match="engine died"):
        retried.generate(0)
    assert not retried_store.exists(0) and retried.prompt_order.start_of(1) == 2  # nothing half-written: one round on
    retried.generate(0)
    assert retried_store.read(0).equals(whole_store.read(0))
    assert retried.prompt_order.end_of(0) == whole.prompt_order.end_of(0) == 6
    assert retried.generate(0)["generate_rounds"] == 3  # a further retry reads the stored rollout


def test_a_generate_function_by_import_path_produces_the_rollout(tmp_path):
    executor, store = _executor(tmp_path, 5, "rollout.generate_fn=tests.miles.rollout.rewards_for_tests:echo_generate")
    summary = executor.generate(0)
    table = store.read(0)
    assert table.num_rows == 20 and summary["samples"] == 20 and summary["weight_version"] == 3
    row = table.to_pylist()[0]
    assert row["response_ids"] == [ord(ch) for ch in "1+1="] and row["loss_mask"] == [1, 1, 0, 0]
    assert (row["num_turns"], row["end_reason"], row["prompt"]) == (2, "done", "1+1=")
    assert table.column("raw_reward").to_pylist()[:2] == [4.0, 5.0]  # the seeds of a group's samples differ

    bad, _ = _executor(tmp_path / "bad", 5, "rollout.generate_fn=tests.miles.rollout.rewards_for_tests:too_few_records")
    with pytest.raises(ValueError, match=r"rollout.generate_fn '.*too_few_records' returned 19 records for 20"):
        bad.generate(0)


def test_rollouts_generated_ahead_take_consecutive_prompts_in_any_order():
    """The fully-async flow generates rollouts 0, 1, 2 at once: each starts where the one before ends, counted on
    from the last end known when that one is still generating."""
    order = PromptOrder(batch_size=4, position=40)  # the run resumes at rollout 0, prompt 40
    assert [order.start_of(k) for k in (2, 0, 1)] == [48, 40, 44]
    order.ends_at(3, 70)  # stored by an earlier start: its file says where it ended
    assert order.start_of(4) == 70 and order.start_of(5) == 74


def test_gae_advantages_and_returns_over_the_trained_tokens_from_the_stored_values(tmp_path):
    executor, store = _executor(tmp_path, 2, "algo.advantage_estimator=gae", "algo.gamma=0.5", "algo.lam=0.5")
    table = _with_column(rollout_table(n=2), "loss_mask", [[1, 0, 1], [1, 1]])  # sample 0's middle token: the env's
    store.write(0, table)  # rewards 0 and 1
    with pytest.raises(RuntimeError, match="compute_values runs before get"):
        executor.get(0, trainer_version=0)
    store.write_values(0, [0, 1], [[0.5, 9.0, 0.2], [0.4, 0.6]])

    handed, _ = executor.get(0, trainer_version=0)

    # gamma = lam = 0.5; the env token is skipped: sample 0's first token looks ahead to its third.
    # sample 0: d2 = 0 - 0.2 = -0.2, A2 = -0.2; d0 = 0.5 * 0.2 - 0.5 = -0.4, A0 = -0.4 + 0.25 * -0.2 = -0.45
    # sample 1: d1 = 1 - 0.6 = 0.4, A1 = 0.4; d0 = 0.5 * 0.6 - 0.4 = -0.1, A0 = -0.1 + 0.25 * 0.4 = 0.0
    # returns A + V: [0.05, -, 0], [0.4, 1.0]
    returns = handed.column("returns").to_pylist()
    np.testing.assert_allclose(returns[0], [0.05, 0.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(returns[1], [0.4, 1.0], atol=1e-6)
    # whitened over the four trained tokens: mean -0.0625, unbiased variance 0.386875 / 3
    std = math.sqrt(0.386875 / 3 + 1e-8)
    advantages = handed.column("token_advantages").to_pylist()
    np.testing.assert_allclose(advantages[0], [-0.3875 / std, 0.0, -0.1375 / std], rtol=1e-5)
    np.testing.assert_allclose(advantages[1], [0.0625 / std, 0.4625 / std], rtol=1e-5)
    np.testing.assert_allclose(handed.column("values").to_pylist()[0], [0.5, 9.0, 0.2], rtol=1e-6)
    # a sample's own advantage is its first trained token's
    np.testing.assert_allclose(handed.column("advantage").to_numpy(), [-0.3875 / std, 0.0625 / std], rtol=1e-5)


def test_gae_credits_an_episodes_token_rewards_where_they_were_given(tmp_path):
    """A process reward: sample 0's turn rewards (0.5 at its first token, 1.5 at its last) make its score 2; sample
    1 has none, its score 1 at its last trained token."""
    executor, store = _executor(tmp_path, 2, "algo.advantage_estimator=gae", "algo.gamma=0.5", "algo.lam=1.0")
    table = _with_rewards(rollout_table(n=2), [2.0, 1.0])
    table = _with_column(table, "token_rewards", [[0.5, 0.0, 1.5], None])
    store.write(0, table)
    store.write_values(0, [0, 1], [[0.0, 0.0, 0.0], [0.0, 0.0]])

    handed, _ = executor.get(0, trainer_version=0)

    # values 0, gamma 0.5, lambda 1: the return is the discounted reward to go
    # sample 0: [0.5 + 0.5 * 0 + 0.25 * 1.5, 0 + 0.5 * 1.5, 1.5]; sample 1: [0.5 * 1, 1]
    returns = handed.column("returns").to_pylist()
    np.testing.assert_allclose(returns[0], [0.875, 0.75, 1.5], atol=1e-6)
    np.testing.assert_allclose(returns[1], [0.5, 1.0], atol=1e-6)


def test_remax_generates_a_greedy_response_per_prompt_whose_reward_is_its_samples_baseline(
    tmp_path, controller, tokenizer
):
    executor, store = _generating_executor(tmp_path, controller, tokenizer, "exact_match")
    executor.config = executor.client.config = executor.config.model_copy(
        update={"algo": executor.config.algo.model_copy(update={"advantage_estimator": "remax"})}
    )
    executor.estimator = ReMax()
    executor.generate(0)
    table = store.read(0)

    # the greedy responses, generated apart: their exact_match rewards are the baselines, one per prompt
    prompts = [f"{k}+1=" for k in range(len(LABELS))]
    sampling = SamplingParams(
        temperature=0.0,
        max_new_tokens=executor.config.rollout.max_new_tokens,
        stop_token_ids=executor.client.stop_token_ids,
    )
    results = controller.generate(
        [GenerateRequest(prompt_ids=ids, sampling=sampling) for ids in tokenizer(prompts)["input_ids"]]
    )
    greedy = [
        exact_match(text, label, executor.client.stopped(r))
        for text, label, r in zip(
            tokenizer.batch_decode([r.output_ids for r in results], skip_special_tokens=True),
            LABELS,
            results,
            strict=True,
        )
    ]
    assert table.column("baseline_reward").to_pylist() == [b for b in greedy for _ in range(2)]
    assert table.num_rows == 2 * len(LABELS)  # the greedy responses are not samples

    handed, _ = executor.get(0, trainer_version=0)
    rewards, baselines = (handed.column(c).to_numpy(zero_copy_only=False) for c in ("raw_reward", "baseline_reward"))
    np.testing.assert_allclose(handed.column("advantage").to_numpy(), rewards - baselines, atol=1e-6)
