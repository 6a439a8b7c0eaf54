"""RunDir: the layout of a run directory, its metrics, run record and ledger (its lock: test_run_lock.py)."""

import json

from miles.rollout.store import RolloutStore
from miles.state.run_dir import RunDir

# ---------------------------------------------------------------- ledger


def test_ledger_record_and_reload(tmp_path):
    ledger = RunDir(tmp_path).ledger()
    assert ledger.trained == {}
    assert not ledger.path.exists()
    ledger.record(0, {"loss": 0.5})
    ledger.record(2, {"loss": 0.25, "reward": 1.0})
    ledger.record(1, {"loss": 0.75})
    assert ledger.path == tmp_path / "ledger.jsonl"

    reloaded = RunDir(tmp_path).ledger()
    assert reloaded.trained == {0: {"loss": 0.5}, 1: {"loss": 0.75}, 2: {"loss": 0.25, "reward": 1.0}}
    assert all(isinstance(k, int) for k in reloaded.trained)
    lines = ledger.path.read_text().splitlines()
    assert [json.loads(line)["rollout_id"] for line in lines] == [0, 2, 1]  # one line appended per record


def test_a_ledger_line_cut_short_by_a_crash_leaves_its_rollout_untrained_and_the_next_record_whole(tmp_path):
    ledger = RunDir(tmp_path).ledger()
    ledger.record(0, {"loss": 0.5})
    with ledger.path.open("a") as f:
        f.write('{"rollout_id": 1, "metr')  # the process died while appending rollout 1
    assert RunDir(tmp_path).ledger().trained == {0: {"loss": 0.5}}

    resumed = RunDir(tmp_path).ledger()
    resumed.record(1, {"loss": 0.25})
    assert RunDir(tmp_path).ledger().trained == {0: {"loss": 0.5}, 1: {"loss": 0.25}}


def test_the_ledger_json_of_an_older_run_is_read_and_taken_over(tmp_path):
    (tmp_path / "ledger.json").write_text(json.dumps({"trained": {"0": {"loss": 0.5}, "1": {"loss": 0.25}}}))
    ledger = RunDir(tmp_path).ledger()
    ledger.record(2, {"loss": 0.125})
    assert RunDir(tmp_path).ledger().trained == {0: {"loss": 0.5}, 1: {"loss": 0.25}, 2: {"loss": 0.125}}
    assert ledger.forget_after(0) == [1, 2]
    assert not (tmp_path / "ledger.json").exists()
    assert RunDir(tmp_path).ledger().trained == {0: {"loss": 0.5}}


def test_ledger_record_overwrites(tmp_path):
    ledger = RunDir(tmp_path).ledger()
    ledger.record(3, {"loss": 1.0})
    ledger.record(3, {"loss": 2.0})
    assert RunDir(tmp_path).ledger().trained == {3: {"loss": 2.0}}


def test_ledger_forget_after(tmp_path):
    ledger = RunDir(tmp_path).ledger()
    for i in range(6):
        ledger.record(i, {"step": float(i)})
    assert ledger.forget_after(2) == [3, 4, 5]
    assert sorted(ledger.trained) == [0, 1, 2]
    assert sorted(RunDir(tmp_path).ledger().trained) == [0, 1, 2]
    assert ledger.forget_after(2) == []
    assert ledger.forget_after(-1) == [0, 1, 2]
    assert RunDir(tmp_path).ledger().trained == {}


def test_ledger_forget_after_sorts_numerically(tmp_path):
    ledger = RunDir(tmp_path).ledger()
    for i in (12, 3, 100, 9):
        ledger.record(i, {})
    assert ledger.forget_after(5) == [9, 12, 100]
    assert RunDir(tmp_path).ledger().trained == {3: {}}


# ---------------------------------------------------------------- layout, metrics, run record


def test_layout_names_every_file_and_an_adapter_has_a_run_dir_of_its_own(tmp_path):
    run_dir = RunDir(tmp_path)
    assert run_dir.checkpoint(7) == tmp_path / "checkpoints" / "7"
    assert RolloutStore(run_dir.rollouts).path(3) == tmp_path / "rollouts" / "rollout_3.arrow"
    assert run_dir.ledger().path == tmp_path / "ledger.jsonl"
    adapter = run_dir.adapter("add")
    assert (
        adapter.path == tmp_path / "adapters" / "add"
        and adapter.checkpoint(0) == tmp_path / "adapters" / "add" / "checkpoints" / "0"
    )


def test_metrics_lines_of_rollouts_to_be_trained_again_are_dropped(tmp_path):
    run_dir = RunDir(tmp_path)
    assert run_dir.keep_metrics_before(0) == [] and run_dir.metrics() == []
    for rollout_id in range(4):
        run_dir.append_metrics({"rollout_id": rollout_id, "eval": "sums", "reward_mean": 1.0})
        run_dir.append_metrics({"rollout_id": rollout_id, "reward_mean": rollout_id / 10})
    # The evaluation at 2 was on the weights a run resuming at 2 starts with: it is kept, the one at 3 is not.
    kept = run_dir.keep_metrics_before(2)
    assert [(r["rollout_id"], "eval" in r) for r in kept] == [(0, True), (0, False), (1, True), (1, False), (2, True)]
    assert run_dir.records() == kept
    assert run_dir.metrics() == [{"rollout_id": 0, "reward_mean": 0.0}, {"rollout_id": 1, "reward_mean": 0.1}]
    assert [r["rollout_id"] for r in run_dir.evaluations("sums")] == [0, 1, 2] and run_dir.evaluations("other") == []
    assert run_dir.keep_metrics_before(5) == kept


def test_run_record_keeps_every_start_with_its_config(tmp_path):
    run_dir = RunDir(tmp_path)
    run_dir.record_start({"seed": 1}, tmp_path / "model", {"rollout_id": 0})
    run_dir.record_start({"seed": 2}, tmp_path / "model", {"rollout_id": 3})
    record = json.loads((tmp_path / "run.json").read_text())
    assert run_dir.recorded_config() == record["config"] == {"seed": 2}
    assert [(s["rollout_id"], s["config"]) for s in record["starts"]] == [(0, {"seed": 1}), (3, {"seed": 2})]
    assert "pyarrow" in record["versions"]


def test_the_initial_model_is_pinned_once_a_start_has_trained(tmp_path):
    """A first start that failed before training pins nothing: a corrected model.path is taken at the next start."""
    run_dir = RunDir(tmp_path)
    assert run_dir.pinned_initial_model() is None
    run_dir.record_start({"seed": 1}, tmp_path / "wrong-model", {"rollout_id": 0})
    assert run_dir.pinned_initial_model() is None and not run_dir.has_work()
    run_dir.rollouts.mkdir()
    (run_dir.rollouts / "rollout_0.arrow").write_bytes(b"")
    assert run_dir.has_work() and run_dir.pinned_initial_model() is None
    run_dir.ledger().record(0, {"loss": 0.0})
    assert run_dir.pinned_initial_model() == tmp_path / "wrong-model"


def test_a_metrics_line_cut_short_is_left_out_and_written_over(tmp_path, caplog):
    run_dir = RunDir(tmp_path)
    run_dir.append_metrics({"rollout_id": 0, "reward_mean": 0.5})
    with run_dir.metrics_path.open("a") as f:
        f.write('{"rollout_id": 1, "rew')  # the process was killed while writing it
    with caplog.at_level("WARNING", logger="miles.state.run_dir"):
        assert run_dir.metrics() == [{"rollout_id": 0, "reward_mean": 0.5}]
    assert f"{run_dir.metrics_path}: line 2 is cut short or damaged" in caplog.text
    assert run_dir.keep_metrics_before(1) == [{"rollout_id": 0, "reward_mean": 0.5}]
    run_dir.append_metrics({"rollout_id": 1, "reward_mean": 0.6})
    assert [r["rollout_id"] for r in run_dir.metrics()] == [0, 1]
