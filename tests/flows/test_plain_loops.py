"""Each flow graph and its plain loop run one schedule (miles.schedules): on the same config and seed they store the
same rollouts and end with the same weights. (The multi-LoRA graph's pair is compared in test_multi_lora.py.)"""

import pyarrow as pa
import pytest

from flows.async_rl import async_rl
from flows.fully_async_rl import fully_async_rl
from flows.sync_rl import sync_rl
from miles.loop import run_async, run_fully_async, run_sync
from miles.state.run_dir import RunDir
from tests.helpers import final_weights, max_abs_diff

# No evaluation: one beside a generation would make the engine batch the two together, and batch mates change
# log-probs at float rounding. Fully-async with a window of one and no push before the end: every generation is the
# only one in flight and sees one version of the weights, so both sides sample alike (a push in the middle of a
# generation lands at a decode step that depends on timing).
GRAPHS = {
    "sync": (sync_rl, run_sync, []),
    "async": (async_rl, run_async, []),
    "fully-async": (
        fully_async_rl,
        run_fully_async,
        ["rollout.max_rollouts_in_flight=1", "update_weights_interval=10"],
    ),
}


def _rollout(run_dir: str, rollout_id: int) -> pa.Table:
    table = pa.ipc.open_file(str(RunDir(run_dir).rollouts / f"rollout_{rollout_id}.arrow")).read_all()
    return table.select(["sample_index", "response_ids", "rollout_logprobs", "raw_reward", "weight_versions"])


@pytest.mark.parametrize("graph", sorted(GRAPHS))
def test_a_flow_and_its_plain_loop_are_one_schedule(ray_session, prefect_api, small_config, tmp_path, graph):
    flow, plain_loop, overrides = GRAPHS[graph]
    configs = {
        side: small_config("eval.datasets=[]", *overrides, num_rollout=3, run_dir=str(tmp_path / side))
        for side in ("flow", "plain")
    }
    state = flow(configs["flow"], return_state=True)
    assert state.is_completed(), state.message
    records = plain_loop(configs["plain"])

    assert [r["rollout_id"] for r in records] == [0, 1, 2]
    for side in ("flow", "plain"):
        assert sorted(RunDir(configs[side].run_dir).ledger().trained) == [0, 1, 2]
    for rollout_id in range(3):
        assert _rollout(configs["flow"].run_dir, rollout_id).equals(_rollout(configs["plain"].run_dir, rollout_id))
    flow_weights, plain_weights = (final_weights(configs[side].run_dir, 2) for side in ("flow", "plain"))
    assert max_abs_diff(flow_weights, plain_weights) == 0.0
