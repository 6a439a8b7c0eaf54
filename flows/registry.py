"""The Prefect flow of each graph (miles.graphs), by the graph's name: for the CLI once the config is checked, the
deployments, sweeps and pipelines."""

from __future__ import annotations

from prefect import Flow

from flows.async_rl import async_rl
from flows.fully_async_rl import fully_async_rl
from flows.multi_lora import multi_lora
from flows.sync_rl import sync_rl

FLOWS: dict[str, Flow] = {
    flow.name.removeprefix("rl-"): flow for flow in (sync_rl, async_rl, fully_async_rl, multi_lora)
}
