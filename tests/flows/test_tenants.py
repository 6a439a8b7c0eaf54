"""A multi-LoRA run as a service (the plain loop): tenants join while it runs, one is withdrawn, two fail, and the
configured adapter ends as it does alone; a restart after the service is killed resumes each tenant."""

from __future__ import annotations

import threading
from pathlib import Path

import ray

from miles.config import AdapterConfig, DataConfig
from miles.loop import run_multi_lora
from miles.multi_lora.admin import adapter_states, submit_tenant, withdraw_adapter
from miles.multi_lora.run import AdaptersFailed
from miles.state.run_dir import RunDir
from tests.flows.test_multi_lora import _adapter_weights
from tests.helpers import max_abs_diff
from tests.helpers.waiting import eventually

SHAPE = dict(rollout_batch_size=4, n_samples_per_prompt=4)
SERVICE = (
    "adapters=[{name: add, data: {task: addition, reward: digit_match}, num_steps: 16, rollout_batch_size: 4,"
    " n_samples_per_prompt: 4, lr: 0.003}]"
)


def _tenant(name: str, reward: str = "digit_match", **fields) -> AdapterConfig:
    return AdapterConfig(name=name, data=DataConfig(task="addition", reward=reward), **{**SHAPE, **fields})


def _trained(run_dir: RunDir, name: str) -> list[int]:
    return sorted(run_dir.adapter(name).ledger().trained)


def _in_background(config) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def serve() -> None:
        try:
            outcome["records"] = run_multi_lora(config)
        except Exception as exc:
            outcome["error"] = exc

    service = threading.Thread(target=serve)
    service.start()
    return service, outcome


def test_tenants_join_leave_and_fail_without_touching_the_others(ray_session, small_config, tmp_path):
    alone = small_config(SERVICE, run_dir=str(tmp_path / "alone"))
    run_multi_lora(alone)
    config = small_config(SERVICE, "tenants.idle_timeout_s=1", run_dir=str(tmp_path / "service"))
    run_dir = RunDir(config.run_dir)
    service, outcome = _in_background(config)
    assert eventually(lambda: _trained(run_dir, "add"), timeout_s=120)

    submit_tenant(run_dir.path, _tenant("late", num_steps=2, trainer_group="solo"))
    submit_tenant(run_dir.path, _tenant("leaves", num_steps=50))
    submit_tenant(run_dir.path, _tenant("raises", reward="tests.miles.rollout.rewards_for_tests:always_raises"))
    submit_tenant(run_dir.path, _tenant("diverges", lr=1e30, global_batch_size=8))
    assert eventually(lambda: _trained(run_dir, "leaves"), timeout_s=120)
    withdraw_adapter(run_dir.path, "leaves", "enough")
    assert eventually(lambda: len(_trained(run_dir, "late")) == 2, timeout_s=120)
    assert len(_trained(run_dir, "add")) < 16  # the tenant trained and retired while the configured adapter trains
    # Its trainer group, of its own, is stopped once it retires: the engine and group main keep their CPU slots.
    assert eventually(lambda: ray.available_resources().get("CPU") == ray.cluster_resources()["CPU"] - 2, every_s=0.2)
    service.join(timeout=300)

    assert isinstance(outcome.get("error"), AdaptersFailed)
    message = str(outcome["error"])
    assert "adapter raises failed: ValueError: rollout 0 has 0 samples after excluding 16 failed samples" in message
    assert "adapter diverges failed: NonFiniteGradient: the gradient norm is nan" in message
    states = {row["name"]: (row["state"], row["trained"]) for row in adapter_states(run_dir.path)}
    leaves = states.pop("leaves")
    assert states == {"add": ("done", 16), "late": ("done", 2), "raises": ("failed", 0), "diverges": ("failed", 0)}
    assert leaves[0] == "withdrawn" and 1 <= leaves[1] < 50
    # The withdrawn one is saved at its last trained rollout
    checkpoints = run_dir.adapter("leaves").path / "checkpoints"
    assert max(int(p.name) for p in checkpoints.iterdir()) == leaves[1] - 1
    # The configured adapter trained as it does alone: the tenants share its engines and trainer, not its samples.
    assert max_abs_diff(_adapter_weights(config.run_dir, "add", 15), _adapter_weights(alone.run_dir, "add", 15)) < 1e-4


def test_a_restarted_service_resumes_each_tenant_where_it_was(ray_session, small_config, tmp_path):
    """The service stops mid-run (iterations_per_run, as a killed one leaves its run directory: the run lock's lease
    covers a killed holder); the next start finds the tenant in the run directory and resumes it."""
    config = small_config(SERVICE.replace("num_steps: 16", "num_steps: 3"), save_interval=1)
    run_dir = RunDir(config.run_dir)
    run_multi_lora(config.model_copy(update={"iterations_per_run": 1}))
    submit_tenant(run_dir.path, _tenant("late", num_steps=3))
    run_multi_lora(config.model_copy(update={"iterations_per_run": 1}))  # the tenant joins: a rollout each
    assert (_trained(run_dir, "add"), _trained(run_dir, "late")) == ([0, 1], [0])

    records = run_multi_lora(config)

    assert {name: [r["rollout_id"] for r in rows] for name, rows in records.items()} == {"add": [2], "late": [1, 2]}
    assert {row["name"]: row["state"] for row in adapter_states(run_dir.path)} == {"add": "done", "late": "done"}
    assert Path(run_dir.adapter("late").checkpoint(2)).is_dir()
