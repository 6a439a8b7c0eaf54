"""Tenants of a multi-LoRA run through its run directory: submissions checked and taken once, withdrawals, states."""

from __future__ import annotations

import threading

import pytest

from flows.cli import main
from miles.config import AdapterConfig, ConfigError, DataConfig
from miles.multi_lora.admin import adapter_states, check_tenant, submit_tenant, withdraw_adapter
from miles.multi_lora.tenants import TenantBook
from miles.state.run_dir import RunDir

CONFIGURED = "adapters=[{name: add, data: {task: addition}, num_steps: 3}]"


@pytest.fixture
def run_dir(small_config, tmp_path):
    """A multi-LoRA run directory as a start leaves it (its config recorded, its adapters' directory), nothing trained."""
    config = small_config(CONFIGURED, run_dir=str(tmp_path / "run"))
    directory = RunDir(config.run_dir).create()
    directory.adapters_path.mkdir()
    directory.record_start(config.model_dump(mode="json"), config.model.path, {"rollout_id": {"add": 0}})
    return directory


def _tenant(name: str, **fields) -> AdapterConfig:
    return AdapterConfig(name=name, data=DataConfig(task="addition"), num_steps=2, **fields)


def test_a_name_is_taken_by_the_first_of_two_concurrent_submissions(tmp_path):
    book = TenantBook(RunDir(tmp_path))
    outcomes = []

    def submit(lr: float) -> None:
        try:
            book.submit(_tenant("same", lr=lr))
            outcomes.append(lr)
        except ConfigError:
            outcomes.append(None)

    threads = [threading.Thread(target=submit, args=(lr,)) for lr in (0.1, 0.2, 0.3, 0.4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [lr for lr in outcomes if lr is not None]
    assert len(winners) == 1
    assert [a.lr for a in book.submitted()] == winners
    assert [p.name for p in book.path.iterdir()] == ["same.json"]  # no staging file left behind


def test_a_submission_is_checked_as_a_configured_adapter_is(run_dir, tmp_path):
    submit_tenant(run_dir.path, _tenant("add-2"))
    assert [a.name for a in TenantBook(run_dir).submitted()] == ["add-2"]
    for taken in ("add", "add-2"):
        with pytest.raises(ConfigError, match=f"adapter name '{taken}' is taken"):
            check_tenant(run_dir.path, _tenant(taken))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "label": "2"}\nnot json\n')
    no_prompts = AdapterConfig(name="mine", data=DataConfig(task=None, path=str(bad)))
    with pytest.raises(ConfigError, match=r"tenant mine \(mine\): .*bad\.jsonl: row 2 is not valid JSON"):
        check_tenant(run_dir.path, no_prompts)
    with pytest.raises(ConfigError, match="no multi-LoRA run has started there"):
        check_tenant(tmp_path / "elsewhere", _tenant("x"))
    refused = []
    unknown = AdapterConfig(name="add-3", data=DataConfig(task="addition", reward="not_a_module:reward"))
    with pytest.raises(RuntimeError, match="not allowed"):  # checked before anything of the tenant's is imported
        submit_tenant(run_dir.path, unknown, allowed=lambda config: refused.append(config) or _refuse())
    assert [a.name for a in refused[0].adapters] == ["add", "add-3"]  # the deployment checks the run with it
    assert [a.name for a in TenantBook(run_dir).submitted()] == ["add-2"]  # a refused one is not recorded


def _refuse():
    raise RuntimeError("not allowed")


def test_states_withdrawals_and_the_cli(run_dir, tmp_path, capsys):
    adapter_file = tmp_path / "tenant.yaml"
    adapter_file.write_text("name: sub\ndata: {task: addition}\nnum_steps: 4\n")
    assert main(["tenant", "submit", str(run_dir.path), "--adapter", str(adapter_file), "--set", "lr=0.01"]) == 0
    assert TenantBook(run_dir).submitted()[0].lr == 0.01
    assert main(["tenant", "submit", str(run_dir.path), "--set", "name=sub"]) == 2
    assert "adapter name 'sub' is taken" in capsys.readouterr().err
    assert main(["tenant", "withdraw", str(run_dir.path), "nobody"]) == 2
    assert "has no adapter 'nobody'; its adapters: add, sub" in capsys.readouterr().err

    withdraw_adapter(run_dir.path, "add", "enough")
    with pytest.raises(ConfigError, match="withdrawn already"):
        withdraw_adapter(run_dir.path, "add")
    TenantBook(run_dir).fail("sub", "ValueError: boom")
    assert TenantBook(run_dir).withdrawn()["add"]["reason"] == "enough"
    assert [
        (r["name"], r["origin"], r["trained"], r["num_steps"], r["state"]) for r in adapter_states(run_dir.path)
    ] == [
        ("add", "config", 0, 3, "withdrawn"),
        ("sub", "tenant", 0, 4, "failed"),
    ]
    assert main(["tenant", "list", str(run_dir.path)]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[0].split() == ["add", "config", "group", "main", "0/3", "withdrawn"]
