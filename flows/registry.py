"""The RL flows by name, for the `miles` CLI and the deployments: where each flow lives and what checks its config.

Import paths, not imports: the CLI checks the config before Prefect is configured and imported.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RLFlow:
    name: str  # `miles run <name>`, deployment `rl-<name>/...`
    flow: str  # "module:function" of the Prefect flow
    checks: tuple[str, ...]  # "module:function"s that reject a bad config before any work

    def check(self, config) -> None:
        for check in self.checks:
            _load(check)(config)

    def load(self) -> Any:
        return _load(self.flow)


def _load(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


FLOWS = {
    flow.name: flow
    for flow in (
        RLFlow("sync", "flows.sync_rl:sync_rl", ("miles.run:check_run",)),
        RLFlow("async", "flows.async_rl:async_rl", ("miles.run:check_off_policy_correction", "miles.run:check_run")),
        RLFlow(
            "fully-async",
            "flows.fully_async_rl:fully_async_rl",
            ("miles.run:check_fully_async", "miles.run:check_run"),
        ),
        RLFlow("multi-lora", "flows.multi_lora:multi_lora", ("miles.multi_lora:check_adapter_inputs",)),
    )
}
