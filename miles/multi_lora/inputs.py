"""The multi-LoRA run's inputs, checked before any work: its adapters (the configured ones, or on the embedded model
one per built-in task), each adapter's view of the run, data, reward and prompts, and the base model's tokenizer.
Errors name the adapter."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from miles.config import AdapterConfig, ConfigError, RunConfig, embedded_adapters
from miles.iterations import PolicyInputs
from miles.preflight import check_start
from miles.run import check_context, check_inputs, starting_tokenizer
from miles.train.algorithms import resolve_estimator


def resolve_adapters(config: RunConfig) -> list[AdapterConfig]:
    """The configured adapters; on the embedded model with none configured, one per built-in task."""
    if config.adapters:
        return list(config.adapters)
    if config.model.path is None:
        return embedded_adapters()
    raise ConfigError("adapters: the multi-LoRA flow needs at least one adapter")


def check_adapter_inputs(config: RunConfig) -> dict[str, PolicyInputs]:
    """Each adapter's view of the run, dataset and reward, checked before any work; errors name the adapter."""
    adapters = resolve_adapters(config)
    try:
        if resolve_estimator(config.algo).needs_critic:
            config.check_critic_group()  # refuses: adapters have no critic
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    checked = {a.name: check_adapter(config, a, f"adapters.{i}") for i, a in enumerate(adapters)}
    check_start(config)
    start = base_tokenizer(config)
    for index, adapter in enumerate(adapters):
        with naming(f"adapters.{index}", adapter):
            check_context(checked[adapter.name], start)
    return checked


def check_adapter(config: RunConfig, adapter: AdapterConfig, where: str) -> PolicyInputs:
    """The adapter's view of the run, its data and reward, checked (`where`: how errors name it)."""
    if config.model.path is None and adapter.data.task is None:
        raise ConfigError(
            f"{where}.data.task: the embedded base model is built for built-in tasks; "
            f"set a task for adapter {adapter.name!r} or set model.path"
        )
    with naming(where, adapter):
        return check_inputs(config.adapter_view(adapter))


@contextmanager
def naming(where: str, adapter: AdapterConfig) -> Iterator[None]:
    """A ConfigError raised in the block, naming the adapter (`where`)."""
    try:
        yield
    except ConfigError as exc:
        raise ConfigError(f"{where} ({adapter.name}): {exc}") from None


def base_tasks(config: RunConfig) -> list[str]:
    """The built-in tasks the embedded base model is built for: the configured adapters' (a tenant's never change it)."""
    return sorted({a.data.task for a in resolve_adapters(config) if a.data.task is not None})


def base_tokenizer(config: RunConfig):
    return starting_tokenizer(config, base_tasks(config))
