"""The tenant admin API of a multi-LoRA run, from outside it: submit an adapter (checked as a configured one is), withdraw
one, and list each adapter's state. Everything goes through the run directory (miles.multi_lora.tenants), so the
run need not be running: it admits a submission at its next boundary, or at its next start."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles.config import AdapterConfig, ConfigError, RunConfig
from miles.multi_lora.inputs import base_tokenizer, check_adapter, naming
from miles.multi_lora.tenants import TenantBook
from miles.run import check_context
from miles.state.run_dir import RunDir


def check_tenant(
    run_dir: str | Path, adapter: AdapterConfig, allowed: Callable[[RunConfig], None] | None = None
) -> RunConfig:
    """The multi-LoRA run at `run_dir` (its last start's config) with `adapter` added, once its name is free there,
    `allowed` (a deployment's allow-lists) accepts that config, before anything of the adapter's is imported or read,
    and the adapter passes what a configured one passes at a start (its view of the run, its data, reward and
    prompts). The run need not be running: a submission waits in the run directory for its next start."""
    directory, config = _recorded_run(run_dir)
    taken = {a.name for a in config.adapters} | {a.name for a in TenantBook(directory).submitted()}
    if adapter.name in taken | {p.name for p in directory.adapters_path.iterdir()}:
        raise ConfigError(f"adapter name {adapter.name!r} is taken in {run_dir}; a name is used once in a run")
    where = f"tenant {adapter.name}"
    if config.rollout.engine == "sglang":  # the servers' LoRA pool is sized by the configured adapters
        rank = max(a.rank for a in config.adapters)
        modules = {m for a in config.adapters for m in a.target_modules}
        if adapter.rank > rank or not set(adapter.target_modules) <= modules:
            raise ConfigError(
                f"{where}: rank {adapter.rank} and target_modules {adapter.target_modules} must fit the SGLang "
                f"servers' LoRA pool (rank {rank}, modules {sorted(modules)}), sized by the run's configured adapters"
            )
    with_tenant = config.model_copy(update={"adapters": [*config.adapters, adapter]})
    if allowed is not None:
        allowed(with_tenant)
    inputs = check_adapter(with_tenant, adapter, where)
    with naming(where, adapter):
        check_context(inputs, base_tokenizer(config))
    return with_tenant


def submit_tenant(
    run_dir: str | Path, adapter: AdapterConfig, allowed: Callable[[RunConfig], None] | None = None
) -> None:
    """Submit `adapter` to the multi-LoRA run at `run_dir` once it passes check_tenant (with `allowed`); the run
    admits it at its next iteration boundary."""
    check_tenant(run_dir, adapter, allowed)
    TenantBook(RunDir(run_dir)).submit(adapter)


def withdraw_adapter(run_dir: str | Path, name: str, reason: str = "") -> None:
    """Withdraw adapter `name` (check_withdrawal); the run saves and retires it at its next iteration boundary."""
    check_withdrawal(run_dir, name)
    TenantBook(RunDir(run_dir)).withdraw(name, reason)


def check_withdrawal(run_dir: str | Path, name: str) -> None:
    """Adapter `name` is one of the multi-LoRA run's at `run_dir`, and neither withdrawn nor failed yet."""
    directory, config = _recorded_run(run_dir)
    book = TenantBook(directory)
    known = [a.name for a in [*config.adapters, *book.submitted()]]
    if name not in known:
        raise ConfigError(f"{run_dir} has no adapter {name!r}; its adapters: {', '.join(known)}")
    if name in book.withdrawn():
        raise ConfigError(f"adapter {name!r} of {run_dir} is withdrawn already")
    if name in book.failed():
        raise ConfigError(f"adapter {name!r} of {run_dir} has failed ({book.failed()[name]['error']}); it is retired")


def adapter_states(run_dir: str | Path) -> list[dict[str, Any]]:
    """Each adapter of the multi-LoRA run at `run_dir`: where it came from (config, tenant), its trainer group,
    rollouts trained of its budget, and its state: waiting (not started yet), training, done, withdrawn, failed."""
    directory, config = _recorded_run(run_dir)
    book = TenantBook(directory)
    withdrawn, failed = book.withdrawn(), book.failed()
    rows = []
    for origin, adapters in (("config", config.adapters), ("tenant", book.submitted())):
        for adapter in adapters:
            trained = len(directory.adapter(adapter.name).ledger().trained)
            if adapter.name in failed:
                state = "failed"
            elif adapter.name in withdrawn:
                state = "withdrawn"
            elif trained >= adapter.num_steps:
                state = "done"
            else:
                state = "training" if directory.adapter(adapter.name).path.is_dir() else "waiting"
            rows.append(
                {
                    "name": adapter.name,
                    "origin": origin,
                    "trainer_group": adapter.trainer_group,
                    "trained": trained,
                    "num_steps": adapter.num_steps,
                    "state": state,
                }
            )
    return rows


def _recorded_run(run_dir: str | Path) -> tuple[RunDir, RunConfig]:
    """The multi-LoRA run directory and the config of its last start."""
    directory = RunDir(run_dir)
    recorded = directory.recorded_config()
    if recorded is None or not directory.adapters_path.is_dir():
        raise ConfigError(f"{run_dir}: no multi-LoRA run has started there; start one first (miles run multi-lora)")
    return directory, RunConfig.model_validate(recorded)
