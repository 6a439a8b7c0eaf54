"""Each checkpoint's lineage: the rollouts since the previous checkpoint with their files' sha256 and the data rows
they drew, the config and the code; read back with the evaluations of its weights, across a resume."""

import hashlib
import json
import subprocess

from flows.cli import main as miles
from miles.data import DataSource, load_rows
from miles.lineage import SOURCE_TREE, describe
from miles.loop import run_sync
from miles.rollout.store import RolloutStore
from miles.state.run_dir import RunDir

BATCH = 8  # prompts per rollout of the small config


def test_a_checkpoint_lists_what_made_it_and_the_evaluations_of_its_weights(ray_session, small_config, capsys):
    eval_sets = ["eval.interval=2", "eval.datasets=[{name: sums, task: addition, max_prompts: 8}]"]
    run_sync(small_config(*eval_sets, num_rollout=2, save_interval=2))
    config = small_config(
        *eval_sets, "changes=[{rollout_id: 3, values: {train.lr: 0.002}}]", num_rollout=4, save_interval=2
    )
    run_sync(config)  # resumes after checkpoint 1

    lineage = describe(config.run_dir, 3)
    assert lineage["previous_checkpoint"] == 1 and [r["rollout_id"] for r in lineage["rollouts"]] == [2, 3]
    walk = DataSource(load_rows(config.data), seed=config.seed, shuffle=config.data.shuffle)
    store = RolloutStore(RunDir(config.run_dir).rollouts)
    for entry in lineage["rollouts"]:
        i = entry["rollout_id"]
        assert entry["data_positions"] == [i * BATCH, (i + 1) * BATCH]
        assert entry["data_rows"] == walk.indices_at(i * BATCH, BATCH)
        assert entry["file"] == str(store.path(i))
        assert entry["sha256"] == hashlib.sha256(store.path(i).read_bytes()).hexdigest()
    assert lineage["config"]["train"]["lr"] == 0.002  # in effect at rollout 3
    head = subprocess.run(["git", "-C", str(SOURCE_TREE), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert lineage["code"]["git_commit"] == head.stdout.strip() and "torch" in lineage["code"]["packages"]
    # Evaluations of a checkpoint's weights are those before the next rollout: checkpoint 1 -> eval at rollout 2.
    assert [(e["rollout_id"], e["eval"]) for e in describe(config.run_dir, 1)["evaluations"]] == [(2, "sums")]
    assert [(e["rollout_id"], e["eval"]) for e in lineage["evaluations"]] == [(4, "sums")]
    first = describe(config.run_dir, 1)
    assert first["previous_checkpoint"] is None and [r["rollout_id"] for r in first["rollouts"]] == [0, 1]

    assert miles(["lineage", config.run_dir]) == 0  # the latest checkpoint
    printed = capsys.readouterr().out
    assert "# lineage of checkpoint 3" in printed and lineage["rollouts"][0]["sha256"][:16] in printed
    assert miles(["lineage", config.run_dir, "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rollouts"] == first["rollouts"]
    assert miles(["lineage", config.run_dir, "2"]) == 2
    assert "has no checkpoint of rollout 2; it has [1, 3]" in capsys.readouterr().err
