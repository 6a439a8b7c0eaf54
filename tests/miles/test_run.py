"""The library without Prefect: the plain loop, resume from the run dir, idempotent train."""

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoTokenizer

from miles import schedules
from miles.config import ConfigError, load_config
from miles.loop import plain_steps, run_sync
from miles.rollout.schema import ROLLOUT_SCHEMA
from miles.run import RLRun, check_inputs
from miles.state.checkpoint import latest_checkpoint, read_state
from miles.state.run_dir import RunDir
from miles.train.actor import TrainActor
from tests.helpers import RECOVERY_RUN, final_weights, max_abs_diff


def _metrics(run_dir) -> list[dict]:
    return RunDir(run_dir).metrics()


def test_miles_imports_no_prefect():
    modules = [p.relative_to(".").with_suffix("").as_posix().replace("/", ".") for p in Path("miles").rglob("*.py")]
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in modules if not m.endswith("__init__"))
        + "print('prefect' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_plain_loop_runs_and_records_the_run(ray_session, small_config):
    config = small_config("logging.trackers=[tensorboard]", num_rollout=3, save_interval=2)
    records = run_sync(config)
    run_dir = Path(config.run_dir)

    assert [r["rollout_id"] for r in records] == [0, 1, 2]
    assert [m["rollout_id"] for m in _metrics(run_dir)] == [0, 1, 2]
    for m in _metrics(run_dir):
        for key in ("reward_mean", "response_length_mean", "time_generate", "time_get", "time_train", "time_sync"):
            assert key in m
        # fp32 on CPU: the trainer's recompute matches the engine's log-probs on-policy.
        assert m["train_rollout_logprob_abs_diff"] < 1e-4
        assert m["optimizer_steps"] == 2
    # Rollout i is sampled by the weights trained on rollouts < i.
    assert [m["weight_version"] for m in _metrics(run_dir)] == [0, 1, 2]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["1", "2"]
    state = read_state(latest_checkpoint(RunDir(run_dir).checkpoints))
    assert state["rollout_id"] == 2 and state["weight_version"] == 3 and state["data"]["position"] == 24
    record = json.loads((run_dir / "run.json").read_text())
    assert record["initial_model"] == config.model.path and "torch" in record["versions"]
    table = pa.ipc.open_file(pa.memory_map(str(run_dir / "rollouts" / "rollout_2.arrow"))).read_all()
    assert table.schema.remove_metadata().equals(ROLLOUT_SCHEMA.remove_metadata())
    assert table.num_rows == 32
    events = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    assert [e.step for e in events.Scalars("reward_mean")] == [0, 1, 2]  # the tracker's steps are rollout ids
    prompts = table.column("prompt").to_pylist()  # the text each sample's prompt_ids encode
    assert len(set(prompts)) == 8 and all(p.endswith("=") for p in prompts)  # 8 prompts x 4 samples


def test_chat_messages_reach_the_engine_through_the_models_chat_template(
    ray_session, small_config, tiny_model_dir, tmp_path
):
    model = tmp_path / "chat-model"
    shutil.copytree(tiny_model_dir, model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"
    )
    tokenizer.save_pretrained(model)
    data = tmp_path / "chat.jsonl"
    questions = [("12+30", "42"), ("7+8", "15")]
    data.write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": q}], "label": a}) + "\n" for q, a in questions)
    )
    config = small_config(
        "data.task=null",
        "rollout.max_new_tokens=4",  # own data takes the real-model preset's 1024 otherwise
        f"data.path={data}",
        "data.prompt_key=messages",
        f"model.path={model}",
        "rollout.rollout_batch_size=2",
        "rollout.n_samples_per_prompt=2",
        "train.global_batch_size=4",
        "train.micro_batch_size=4",
        num_rollout=1,
    )
    run_sync(config)
    table = RunDir(config.run_dir).path / "rollouts" / "rollout_0.arrow"
    table = pa.ipc.open_file(pa.memory_map(str(table))).read_all()
    by_text = dict(zip(table.column("prompt").to_pylist(), table.column("prompt_ids").to_pylist(), strict=True))
    assert set(by_text) == {"12+30=", "7+8="}
    for question, _ in questions:
        messages = [{"role": "user", "content": question}]
        expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
        assert by_text[question + "="] == expected


def test_resume_after_a_stopped_run_continues_at_the_next_rollout(ray_session, small_config):
    config = small_config(num_rollout=4, save_interval=1)
    with RLRun(config) as run:  # stopped after rollout 1 was trained and rollout 2 was generated
        for rollout_id in (0, 1):
            run.generate(rollout_id)
            run.train(rollout_id, run.get(rollout_id))
            run.sync_weights(rollout_id)
            run.save_checkpoint(rollout_id)
            run.finish_iteration(rollout_id)
        run.generate(2)
    rollout_2 = Path(config.run_dir) / "rollouts" / "rollout_2.arrow"
    generated_at = rollout_2.stat().st_mtime_ns

    records = run_sync(config)

    assert [r["rollout_id"] for r in records] == [2, 3]
    assert [m["rollout_id"] for m in _metrics(config.run_dir)] == [0, 1, 2, 3]
    assert rollout_2.stat().st_mtime_ns == generated_at  # reused, not regenerated
    assert read_state(latest_checkpoint(RunDir(config.run_dir).checkpoints))["rollout_id"] == 3
    starts = json.loads((Path(config.run_dir) / "run.json").read_text())["starts"]
    assert [s["rollout_id"] for s in starts] == [0, 2]


def test_train_twice_on_one_rollout_steps_once(ray_session, small_config):
    with RLRun(small_config(num_rollout=1)) as run:
        run.generate(0)
        table = run.get(0)
        before = run.trainer.call(TrainActor.weights)
        first = run.train(0, table)
        after_first = run.trainer.call(TrainActor.weights)
        second = run.train(0, table)
        after_second = run.trainer.call(TrainActor.weights)
    assert any(not torch.equal(before[k], after_first[k]) for k in before)
    assert all(torch.equal(after_first[k], after_second[k]) for k in before)
    assert second == first


def test_update_weights_interval_pushes_every_n_rollouts(ray_session, small_config):
    config = small_config("update_weights_interval=2", num_rollout=4)
    run_sync(config)
    # Weights reach the engines after rollouts 1 and 3 (and always after the last one).
    assert [m["weight_version"] for m in _metrics(config.run_dir)] == [0, 0, 2, 2]


@pytest.mark.parametrize("transport", ["disk", "distributed"])
def test_every_weight_transport_trains_as_the_object_store_does(small_config, uninterrupted_weights, transport):
    config = small_config(f"rollout.weight_transport={transport}", **RECOVERY_RUN)
    run_sync(config)
    assert max_abs_diff(final_weights(config.run_dir, 4), uninterrupted_weights) == 0.0
    engine_weights = RunDir(config.run_dir).engine_weights
    # disk keeps the version the engines hold (a restarted engine loads it), none older; distributed writes nothing
    assert (sorted(p.name for p in engine_weights.iterdir()) if engine_weights.exists() else []) == (
        ["5"] if transport == "disk" else []
    )


def test_iterations_per_run_trains_a_slice_then_the_next_run_resumes(ray_session, small_config):
    """Slices of 2 rollouts, weights pushed every 3: each slice's closing evaluation (every 2 rollouts) still sees the
    weights its slice trained, so the engines get them at the slice's end whatever the push interval."""
    config = small_config(
        "iterations_per_run=2",
        "update_weights_interval=3",
        "eval.interval=2",
        "eval.datasets=[{name: sums, task: addition, max_prompts: 8}]",
        num_rollout=5,
        save_interval=100,
    )
    first = run_sync(config)
    assert [r["rollout_id"] for r in first] == [0, 1]
    assert (
        read_state(latest_checkpoint(RunDir(config.run_dir).checkpoints))["rollout_id"] == 1
    )  # saved at the end of the slice
    assert [r["rollout_id"] for r in run_sync(config)] == [2, 3]
    assert [r["rollout_id"] for r in run_sync(config)] == [4]
    assert [m["rollout_id"] for m in _metrics(config.run_dir)] == [0, 1, 2, 3, 4]
    evaluations = RunDir(config.run_dir).evaluations()
    assert [(r["rollout_id"], r["weight_version"]) for r in evaluations] == [(0, 0), (2, 2), (4, 4), (5, 5)]


def test_a_checkpoint_saved_by_two_workers_resumes_on_one_and_back(small_config, uninterrupted_weights):
    """Runs of two rollouts each (iterations_per_run) on 2, 1, then 2 trainer workers: each resumes from the previous
    run's checkpoint, resharded, and the end equals the uninterrupted single-worker run."""
    for workers in (2, 1, 2):
        run_sync(small_config("iterations_per_run=2", f"train.num_workers={workers}", **RECOVERY_RUN))
    run_dir = RunDir(small_config().run_dir)
    assert sorted(run_dir.ledger().trained) == [0, 1, 2, 3, 4]
    shards = {i: sorted(p.name for p in (run_dir.checkpoint(i) / "optimizer").glob("*.safetensors")) for i in (1, 3, 4)}
    assert [len(names) for names in shards.values()] == [2, 1, 2]  # one optimizer shard per worker that saved it
    checksums = json.loads((run_dir.checkpoint(1) / "checksums.json").read_text())
    assert all(f"optimizer/{name}" in checksums for name in shards[1])
    gap = max_abs_diff(final_weights(run_dir.path, 4), uninterrupted_weights)
    print(f"2 -> 1 -> 2 workers vs 1 uninterrupted: {gap:.2e}")
    assert gap < 1e-5


def _stop_after(config, trained: int, generated: int | None = None) -> None:
    """A run stopped after training rollouts 0..trained (saving when due, as a flow does) and generating `generated`."""
    with RLRun(config) as run:
        for rollout_id in range(trained + 1):
            run.generate(rollout_id)
            run.train(rollout_id, run.get(rollout_id))
            run.sync_weights(rollout_id)
            if run.should_save(rollout_id):
                run.save_checkpoint(rollout_id)
            run.finish_iteration(rollout_id)
        if generated is not None:
            run.generate(generated)


def test_resume_replays_rollouts_trained_after_the_checkpoint(small_config, uninterrupted_weights):
    config = small_config(**RECOVERY_RUN)
    _stop_after(config, trained=2, generated=3)  # checkpoint 1; rollout 2 trained after it; rollout 3 not trained
    rollout_3 = Path(config.run_dir) / "rollouts" / "rollout_3.arrow"
    generated_at = rollout_3.stat().st_mtime_ns

    records = run_sync(config)

    assert [r["rollout_id"] for r in records] == [3, 4]  # rollout 2 is not an iteration again
    assert rollout_3.stat().st_mtime_ns == generated_at  # reused, not regenerated
    assert sorted(RunDir(config.run_dir).ledger().trained) == [0, 1, 2, 3, 4]
    assert [m["rollout_id"] for m in _metrics(config.run_dir)] == [0, 1, 2, 3, 4]
    starts = json.loads((Path(config.run_dir) / "run.json").read_text())["starts"]
    assert [(s["rollout_id"], s["replayed"]) for s in starts] == [(0, []), (3, [2])]
    assert max_abs_diff(final_weights(config.run_dir, 4), uninterrupted_weights) == 0.0


def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(small_config, uninterrupted_weights, caplog):
    config = small_config(**RECOVERY_RUN)
    _stop_after(config, trained=3)  # checkpoints 1 and 3
    weights_file = Path(config.run_dir) / "checkpoints" / "3" / "model" / "model.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[:1000])  # a disk that filled up, a copy cut short

    with caplog.at_level("WARNING", logger="miles"):
        records = run_sync(config)

    assert "checkpoint" in caplog.text and "model/model.safetensors has 1000 bytes" in caplog.text
    assert [r["rollout_id"] for r in records] == [4]
    starts = json.loads((Path(config.run_dir) / "run.json").read_text())["starts"]
    assert starts[-1]["checkpoint"].endswith("checkpoints/1") and starts[-1]["replayed"] == [2, 3]
    assert max_abs_diff(final_weights(config.run_dir, 4), uninterrupted_weights) == 0.0


def test_prompt_longer_than_the_context_is_refused_before_any_work(small_config, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+2=", "label": "3"}\n' + json.dumps({"prompt": "1+" * 40 + "=", "label": "x"}) + "\n")
    config = small_config(
        "data.task=null", f"data.path={data}", "rollout.max_new_tokens=4", run_dir=str(tmp_path / "never")
    )
    with pytest.raises(ConfigError, match=rf"{data}: row 2: the prompt is \d+ tokens; with rollout.max_new_tokens=4"):
        RLRun(config)
    assert not (tmp_path / "never" / "rollouts").exists()


def test_an_algorithm_that_cannot_be_imported_is_refused_before_any_work(small_config, tmp_path):
    config = small_config("algo.policy_loss=no_such_module_xyz:loss", run_dir=str(tmp_path / "never"))
    with pytest.raises(ConfigError, match="algo.policy_loss: cannot import 'no_such_module_xyz:loss'"):
        RLRun(config)
    assert not (tmp_path / "never").exists()


def test_samples_whose_reward_fails_are_counted_and_the_run_goes_on(small_config, tmp_path, caplog):
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"{a}+{b}=", "label": str(a + b)} for a, b in ((1, 2), (3, 4), (10, 5), (7, 7), (20, 1), (6, 3))]
    rows += [{"prompt": "5+5=", "label": "raise"}, {"prompt": "9+1=", "label": "nan"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reward = "tests.miles.rollout.rewards_for_tests:fails_on_some_labels"
    config = small_config(
        "data.task=null", f"data.path={data}", "rollout.max_new_tokens=4", f"data.reward={reward}", num_rollout=2
    )

    with caplog.at_level("WARNING", logger="miles"):
        records = run_sync(config)  # each rollout holds all 8 prompts: 2 of them, x 4 samples, fail

    assert [(r["rollout_id"], r["failed_samples"]) for r in records] == [(0, 8), (1, 8)]
    assert sorted(RunDir(config.run_dir).ledger().trained) == [0, 1]
    assert f"rollout 0: reward {reward!r} failed on 8 of 32 samples" in caplog.text
    table = pa.ipc.open_file(pa.memory_map(str(Path(config.run_dir) / "rollouts" / "rollout_0.arrow"))).read_all()
    failed = [row for row in table.to_pylist() if row["status"] == "failed"]
    assert sorted({row["label"] for row in failed}) == ["nan", "raise"] and all(
        row["raw_reward"] is None for row in failed
    )


def test_a_sync_run_on_a_three_node_cluster_spreads_the_trainer_workers(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.helpers.two_nodes", str(tiny_model_dir), str(run_dir)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    placed = json.loads(done.stdout.strip().splitlines()[-1])
    assert placed["cluster_nodes"] == 3 and placed["trained"] == [0, 1]
    trainer_nodes, engine_nodes = placed["trainer_nodes"], placed["engine_nodes"]
    assert len(set(trainer_nodes)) == 2  # one worker per node
    assert not set(engine_nodes) & set(trainer_nodes)  # the engine on the third
    assert (run_dir / "checkpoints" / "1" / "model" / "model.safetensors").is_file()


def _sums_file(path: Path) -> Path:
    rows = [{"prompt": f"{a}+{b}=", "label": str(a + b)} for a in (3, 14, 25) for b in (1, 22, 7)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_evaluations_run_on_schedule_once_each_across_a_stop_and_resume(ray_session, small_config, tmp_path):
    """eval.interval=2 over 5 rollouts: evaluations at 0, 2, 4 (before training them) and 5 (the end). The first
    process stops right after the evaluation at 4; the resumed one neither repeats it nor skips the rest."""
    sums = _sums_file(tmp_path / "sums.jsonl")
    eval_sets = f"eval.datasets=[{{name: sums, path: {sums}, n_samples_per_prompt: 4, temperature: 1.0}}, {{name: greedy, task: addition, max_prompts: 16}}]"
    config = small_config("eval.interval=2", eval_sets, num_rollout=5, save_interval=2)
    with RLRun(config) as run, plain_steps() as steps:
        for rollout_id in range(4):
            schedules.sync_iteration(run, steps, rollout_id)
            run.finish_iteration(rollout_id)
        stopped_at = run.evaluate(4)
        assert not run.should_evaluate(4)  # done: a retry of the task returns the records
        assert run.evaluate(4) == stopped_at

    run_sync(config)

    run_dir = RunDir(config.run_dir)
    sums_evals = run_dir.evaluations("sums")
    assert [(r["rollout_id"], r["weight_version"]) for r in sums_evals] == [(0, 0), (2, 2), (4, 4), (5, 5)]
    assert [r["rollout_id"] for r in run_dir.evaluations("greedy")] == [0, 2, 4, 5]
    assert [r for r in run_dir.evaluations() if r["rollout_id"] == 4] == stopped_at  # not run again
    assert [r["rollout_id"] for r in run_dir.metrics()] == [0, 1, 2, 3, 4]
    for record in sums_evals:
        assert (record["prompts"], record["samples"]) == (9, 36)
        assert 0.0 <= record["pass_at_1"] <= record["pass_at_2"] <= record["pass_at_4"] <= 1.0
        assert record["reward_mean"] == pytest.approx(record["pass_at_1"])  # a 0/1 reward with no failures
    assert [r["prompts"] for r in run_dir.evaluations("greedy")] == [16] * 4


def test_evaluation_leaves_the_training_data_and_samples_untouched(ray_session, small_config, tmp_path):
    """The same run with evaluation at every rollout and without any: the same rollouts, the same weights."""
    sums = _sums_file(tmp_path / "sums.jsonl")
    evaluated = small_config(
        "eval.interval=1",
        f"eval.datasets=[{{name: sums, path: {sums}, n_samples_per_prompt: 2, temperature: 1.0}}]",
        run_dir=tmp_path / "evaluated",
        num_rollout=3,
    )
    plain = small_config("eval.datasets=[]", run_dir=tmp_path / "plain", num_rollout=3)
    run_sync(evaluated)
    run_sync(plain)

    assert [r["rollout_id"] for r in RunDir(evaluated.run_dir).evaluations()] == [0, 1, 2, 3]
    assert RunDir(plain.run_dir).evaluations() == []
    for rollout_id in range(3):
        tables = [
            pa.ipc.open_file(
                pa.memory_map(str(Path(c.run_dir) / "rollouts" / f"rollout_{rollout_id}.arrow"))
            ).read_all()
            for c in (evaluated, plain)
        ]
        for column in ("prompt", "response_ids", "rollout_logprobs"):
            assert tables[0].column(column).equals(tables[1].column(column)), (rollout_id, column)
    states = [read_state(latest_checkpoint(RunDir(c.run_dir).checkpoints))["data"] for c in (evaluated, plain)]
    assert states[0] == states[1]
    assert max_abs_diff(final_weights(evaluated.run_dir, 2), final_weights(plain.run_dir, 2)) == 0.0


def test_an_eval_data_set_that_cannot_be_read_is_refused_before_any_work(small_config, tmp_path):
    missing = tmp_path / "missing.jsonl"
    config = small_config(f"eval.datasets=[{{name: held-out, path: {missing}}}]", run_dir=str(tmp_path / "never"))
    with pytest.raises(ConfigError, match=rf"eval.datasets.0 \(held-out\): .*{missing}"):
        RLRun(config)
    assert not (tmp_path / "never" / "rollouts").exists()


def test_top_p_below_one_is_warned_about(caplog):
    """The engines' log-probs are of the untruncated distribution: a run that truncates it is told so."""
    with caplog.at_level(logging.WARNING, logger="miles.run"):
        check_inputs(load_config(None, ["rollout.top_p=1.0"]))
        assert not caplog.records
        check_inputs(load_config(None, ["rollout.top_p=0.9"]))
    assert "rollout.top_p=0.9" in caplog.text and "truncat" in caplog.text


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["critic.num_workers=3"], r"critic.num_workers \(3\) must divide train.global_batch_size \(256\)"),
        (["critic.num_workers=2", "train.sharding=none"], "critic.num_workers=2 needs train.sharding fsdp or unset"),
    ],
)
def test_a_critic_group_that_cannot_run_is_refused_when_the_estimator_needs_one(overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        check_inputs(load_config(None, ["algo.advantage_estimator=gae", *overrides]))
    # GRPO trains no critic: its section is not asked to fit
    assert not check_inputs(load_config(None, overrides)).algorithm.needs_critic
