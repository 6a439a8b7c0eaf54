"""Sweeps: config variants of one run, each a run of its own, and their comparison.

A variant is a set of `a.b=value` overrides on the base config, named by them (`train.lr=0.001,seed=1`); its run
directory is `<base run_dir>/<index>-<name, made file-safe>`. `variants(grid, listed)` gives the grid's product (in
the grid's key order) followed by the listed ones. `compare` reads each variant's metrics.jsonl.
"""

from __future__ import annotations

import itertools
import re
import statistics
from pathlib import Path
from typing import Any

import yaml

from miles.config import ConfigError, RunConfig, override_config
from miles.observe.plots import plot_reward_curves
from miles.state.run_dir import RunDir

# The last iterations whose mean reward the comparison reports.
LAST = 10


def variants(grid: dict[str, list[Any]] | None, listed: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    keys = list(grid or {})
    product = (
        [dict(zip(keys, values, strict=True)) for values in itertools.product(*(grid[k] for k in keys))] if keys else []
    )
    found = product + list(listed or [])
    if not found:
        raise ConfigError("a sweep needs variants: a grid (field -> values) or a list of variants (field -> value)")
    return found


def variant_name(values: dict[str, Any]) -> str:
    return ",".join(_overrides(values))


def _overrides(values: dict[str, Any]) -> list[str]:
    return [
        f"{field}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}"
        for field, value in values.items()
    ]


def variant_config(base: RunConfig, index: int, values: dict[str, Any]) -> RunConfig:
    """The base config with the variant's values, in a run directory of its own."""
    name = variant_name(values)
    run_dir = Path(base.run_dir) / f"{index}-{re.sub(r'[^A-Za-z0-9.=,_-]+', '_', name)}"
    try:
        return override_config(base, _overrides(values), run_dir=str(run_dir))
    except ConfigError as exc:
        raise ConfigError(f"sweep variant {index} ({name}): {exc}") from None


def compare(configs: dict[str, RunConfig], title: str, out: Path) -> tuple[list[dict[str, Any]], Path]:
    """One row per variant (its final and last-LAST mean reward, rollouts trained, last evaluation), and an image of
    every variant's reward curve."""
    rows, curves = [], {}
    for name, config in configs.items():
        run_dir = RunDir(config.run_dir)
        records = run_dir.metrics()
        curves[name] = records
        rewards = [r["reward_mean"] for r in records]
        row: dict[str, Any] = {
            "variant": name,
            "rollouts": len(records),
            "final_reward": rewards[-1] if rewards else None,
            f"reward_last_{LAST}": statistics.mean(rewards[-LAST:]) if rewards else None,
        }
        for evaluation in _last_evaluations(run_dir):
            row[f"eval_{evaluation['eval']}"] = evaluation["reward_mean"]
        rows.append(row)
    return rows, plot_reward_curves(curves, title, out)


def _last_evaluations(run_dir: RunDir) -> list[dict[str, Any]]:
    last: dict[str, dict[str, Any]] = {}
    for record in run_dir.evaluations():
        last[record["eval"]] = record
    return list(last.values())
