"""RolloutExecutor.get: the handover of a stored rollout (no engine needed)."""

import numpy as np
import pyarrow as pa
import pytest

from miles.config import load_config
from miles.data import DataSource
from miles.rollout.rollout_executor import RolloutExecutor
from miles.rollout.schema import ROLLOUT_SCHEMA
from miles.rollout.store import RolloutStore

from tests.miles.rollout.test_schema_store import rollout_table


def _executor(tmp_path, global_batch_size, *overrides):
    config = load_config(None, ["rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=5",
                                f"train.global_batch_size={global_batch_size}", f"train.micro_batch_size={global_batch_size}",
                                *overrides],
                         run_dir=str(tmp_path))

    class Tok:
        eos_token_id = 2

    store = RolloutStore(tmp_path)
    return RolloutExecutor(config, None, Tok(), DataSource([{"prompt": "1+1=", "label": "2"}], seed=0), store, None), store


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
    assert stats == {"staleness_mean": 0.0, "dropped_groups": 0}  # rollout_table stamps weight_version = rollout_id


def test_get_refuses_a_rollout_smaller_than_one_global_batch(tmp_path):
    executor, store = _executor(tmp_path, global_batch_size=20)
    store.write(0, rollout_table(n=6))
    with pytest.raises(ValueError, match="fewer than train.global_batch_size"):
        executor.get(0, trainer_version=0)


def _with_versions(table, versions):
    return table.set_column(table.schema.get_field_index("weight_version"), ROLLOUT_SCHEMA.field("weight_version"), pa.array(versions, pa.int64()))


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
    with pytest.raises(ValueError, match=r"dropping 5 groups staler than rollout.max_weight_staleness=0.*global_batch_size"):
        executor.get(2, trainer_version=5)
