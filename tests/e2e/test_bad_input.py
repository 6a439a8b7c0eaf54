"""Bad input to `miles run`: one line naming the field, file or row, exit 2, before Prefect and Ray start."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.cli import main
from miles.state.run_dir import RunDir

PROJECT = Path(__file__).resolve().parents[2]
SMALL = ["--set", "rollout.rollout_batch_size=4", "--set", "rollout.n_samples_per_prompt=2"]
SMALL += ["--set", "train.global_batch_size=8", "--set", "eval.datasets=[]"]


def _error(capsys, *args: str) -> str:
    """The CLI's one line on stderr for a start it refuses with exit 2."""
    assert main(["run", "sync", *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: ")
    return lines[0].removeprefix("error: ")


def test_a_config_file_that_is_not_utf8(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_bytes(b"seed: 1\ndata:\n  system_prompt: caf\xe9\n")
    assert (
        _error(capsys, "--config", str(config))
        == f"config file {config} is not UTF-8 text (line 3: invalid continuation byte)"
    )


def test_a_set_value_that_is_not_yaml_and_string_fields_that_take_the_text(tmp_path, capsys):
    message = _error(capsys, "--run-dir", str(tmp_path / "r"), "--set", "train.lr=[0.1")
    assert message.startswith("override 'train.lr=[0.1': the value is not valid YAML (")
    from miles.config import load_config

    config = load_config(None, ["data.system_prompt=Answer with: the number", "data.task=null", "data.path=on"])
    assert (config.data.system_prompt, config.data.task, config.data.path) == ("Answer with: the number", None, "on")


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("raise RuntimeError('no key')\n", "data.reward: importing 'bad_reward_{n}' raised RuntimeError: no key"),
        ("def score(:\n", "data.reward: {file}, line 1: invalid syntax"),
    ],
)
def test_a_reward_module_that_fails_at_import(tmp_path, capsys, monkeypatch, source, expected):
    name = f"bad_reward_{len(source)}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    message = _error(capsys, "--run-dir", str(tmp_path / "r"), "--set", f"data.reward={name}:score")
    assert message == expected.format(n=len(source), file=tmp_path / f"{name}.py")


def test_data_that_is_not_utf8_names_file_and_row_counting_blank_lines(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_bytes(b'{"prompt": "1+1=", "label": "2"}\n\n{"prompt": "caf\xe9", "label": "1"}\n')
    args = ["--run-dir", str(tmp_path / "r"), "--set", "data.task=null", "--set", f"data.path={data}"]
    message = _error(capsys, *args, "--set", "model.path=/nowhere")
    assert message == f"{data}: row 3 is not UTF-8 text (byte 15 of the line)"


def test_a_bad_model_path_is_named(tmp_path, capsys, tiny_model_dir):
    run = ["--run-dir", str(tmp_path / "r")]
    assert _error(capsys, *run, "--set", "model.path=org/not-here") == (
        "model.path: org/not-here does not exist; give a Hugging Face model directory (config.json, weights, tokenizer)"
    )
    (tmp_path / "empty").mkdir()
    assert _error(capsys, *run, "--set", f"model.path={tmp_path / 'empty'}") == (
        f"model.path: {tmp_path / 'empty'} has no config.json; it is not a Hugging Face model directory"
    )
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    message = _error(capsys, *run, "--set", f"model.path={config_only}")
    assert message.startswith(f"model.path: the tokenizer of {config_only} does not load: ")


def test_a_run_dir_that_is_a_file_or_read_only(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert (
        _error(capsys, "--run-dir", str(tmp_path / "file"))
        == f"run_dir: {tmp_path / 'file'} is a file, not a directory"
    )
    if os.geteuid() == 0:
        pytest.skip("root writes to a read-only directory")
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o500)
    try:
        assert _error(capsys, "--run-dir", str(read_only / "run")) == (
            f"run_dir: {read_only / 'run'} cannot be written ({read_only} is not writable)"
        )
    finally:
        read_only.chmod(0o700)


def test_a_run_another_process_is_training(tmp_path, capsys):
    run_dir = tmp_path / "r"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from miles.state.run_dir import RunDir; RunDir({str(run_dir)!r}).create().lock(); input()",
        ],
        cwd=PROJECT,
        stdin=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        while not RunDir(run_dir).lock_path.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        message = _error(capsys, "--run-dir", str(run_dir))
        assert message.startswith(f"run_dir: {run_dir} is being trained by ") and str(holder.pid) in message
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
def test_cuda_asked_on_a_machine_without_it(tmp_path, capsys):
    assert _error(capsys, "--run-dir", str(tmp_path / "r"), "--set", "rollout.device=cuda") == (
        "rollout.device=cuda: this machine has no CUDA device (torch.cuda.is_available() is false), and no "
        "ray_address names a cluster that has one"
    )


def test_an_unreachable_ray_address(tmp_path, capsys):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    message = _error(capsys, "--run-dir", str(tmp_path / "r"), "--set", f"ray_address=127.0.0.1:{port}")
    assert message.startswith(f"ray_address: nothing answers at 127.0.0.1:{port} within 5 s (")


def test_a_prompt_longer_than_the_embedded_models_context(tmp_path, capsys):
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=" * 20, "label": "2"}) + "\n")
    message = _error(capsys, "--run-dir", str(tmp_path / "r"), "--set", f"eval.datasets=[{{name: long, path: {data}}}]")
    assert message == (
        f"eval.datasets.0 (long): {data}: row 1: the prompt is 81 tokens; with max_new_tokens=4 it exceeds the "
        "model's context of 32 tokens (max_position_embeddings)"
    )


def test_a_config_that_changes_what_a_rollout_means_is_refused_on_resume(tmp_path, capsys, tiny_model_dir):
    """The difference is printed, a field that changes freely passes, and the flag lets a meant change through."""
    from miles.config import load_config
    from miles.preflight import check_start

    run_dir = RunDir(tmp_path / "r").create()
    first = load_config(None, ["rollout.temperature=1.0"], run_dir=str(run_dir.path))
    run_dir.record_start(first.model_dump(mode="json"), tiny_model_dir, {"rollout_id": 0})
    run_dir.ledger().record(0, {"loss": 0.0})
    assert main(["run", "sync", "--run-dir", str(run_dir.path), "--set", "rollout.temperature=0.7"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: run_dir: {run_dir.path} was run with another config; these fields change what")
    assert err.strip().endswith("\n  rollout.temperature: 1.0 -> 0.7")
    check_start(first.model_copy(update={"num_rollout": 999}))  # how long a run goes changes freely
    check_start(load_config(None, ["rollout.temperature=0.7", "accept_config_change=true"], run_dir=str(run_dir.path)))


# Runs argv[1:] and prints its peak memory (KiB). A process's ru_maxrss counts the memory of the process it was
# forked from, and this session's pytest process may hold a gigabyte by now: the refusal is forked from this small one.
PEAK_MEMORY = (
    "import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(code)"
)


def test_refusals_take_seconds_and_little_memory(tmp_path):
    """As a user meets them: a fresh process each, within 15 s and 1 GiB."""
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME")}
    env["PYTHONPATH"] = str(PROJECT)
    (tmp_path / "file").write_text("")
    for args in (["--run-dir", str(tmp_path / "file")], ["--set", "model.path=/nowhere", "--run-dir", str(tmp_path)]):
        start = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-c", PEAK_MEMORY, sys.executable, "-m", "flows.cli", "run", "sync", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
        )
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert time.monotonic() - start < 15
        peak_kib = int(out.stdout.split()[-1])
        assert peak_kib < 1024 * 1024, peak_kib
