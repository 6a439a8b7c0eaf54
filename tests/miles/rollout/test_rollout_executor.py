"""RolloutExecutor.get: the handover of a stored rollout (no engine needed)."""

import numpy as np
import pytest

from miles.config import load_config
from miles.data import DataSource
from miles.rollout.rollout_executor import RolloutExecutor
from miles.rollout.schema import ROLLOUT_SCHEMA
from miles.rollout.store import RolloutStore

from tests.miles.rollout.test_schema_store import rollout_table


def _executor(tmp_path, global_batch_size):
    config = load_config(None, ["rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=5",
                                f"train.global_batch_size={global_batch_size}", f"train.micro_batch_size={global_batch_size}"],
                         run_dir=str(tmp_path))

    class Tok:
        eos_token_id = 2

    store = RolloutStore(tmp_path)
    return RolloutExecutor(config, None, Tok(), DataSource([{"prompt": "1+1=", "label": "2"}], seed=0), store, None), store


def test_get_normalises_per_group_and_trims_to_whole_global_batches(tmp_path):
    executor, store = _executor(tmp_path, global_batch_size=4)
    table = rollout_table(n=10)  # groups 0..4 of two samples, rewards alternate 0/1
    store.write(3, table)

    handed = executor.get(3)

    assert handed.num_rows == 8 and handed.schema.remove_metadata().equals(ROLLOUT_SCHEMA.remove_metadata())
    assert handed.column("sample_index").to_pylist() == list(range(8))
    # Each group is (0, 1): mean 0.5, unbiased std sqrt(0.5), so the advantages are -/+ 0.5/sqrt(0.5).
    expected = np.tile([-0.5 / (np.sqrt(0.5) + 1e-6), 0.5 / (np.sqrt(0.5) + 1e-6)], 4)
    np.testing.assert_allclose(handed.column("advantage").to_numpy(), expected, rtol=1e-6)
    assert store.read(3).column("advantage").null_count == 0  # the file on disk is never rewritten by get


def test_get_refuses_a_rollout_smaller_than_one_global_batch(tmp_path):
    executor, store = _executor(tmp_path, global_batch_size=20)
    store.write(0, rollout_table(n=6))
    with pytest.raises(ValueError, match="fewer than train.global_batch_size"):
        executor.get(0)
