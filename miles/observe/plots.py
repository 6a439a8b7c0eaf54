"""A run's curves as PNGs, drawn from its metrics.jsonl records: the reward curve and each eval data set's curve."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def running_mean(values: list[float], window: int) -> list[float]:
    """Each value's mean with the values before it, over at most `window` of them."""
    return [sum(values[max(0, i - window + 1) : i + 1]) / min(i + 1, window) for i in range(len(values))]


def _saved(fig, ax, xlabel: str, ylabel: str, title: str, out: Path, legend_size: str | None = None) -> Path:
    """The figure with its labels, title, grid and legend, saved to `out` as a PNG (and closed)."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=legend_size)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    _pyplot().close(fig)
    return out


def plot_reward_curve(records: list[dict[str, Any]], title: str, out: Path, window: int = 20) -> Path:
    """The iterations' mean sampled reward, and its running mean over `window` rollouts."""
    ids = [r["rollout_id"] for r in records]
    rewards = [r["reward_mean"] for r in records]
    fig, ax = _pyplot().subplots(figsize=(7, 4), dpi=100)
    ax.plot(ids, rewards, color="#9bb7d4", linewidth=1, label="reward per rollout")
    ax.plot(ids, running_mean(rewards, window), color="#1f4e79", linewidth=2, label=f"mean of the last {window}")
    return _saved(fig, ax, "rollout_id", "mean sampled reward", title, out)


def plot_eval_curve(records: list[dict[str, Any]], title: str, out: Path) -> Path:
    """One eval data set's mean reward and pass@k at each evaluation."""
    ids = [r["rollout_id"] for r in records]
    fig, ax = _pyplot().subplots(figsize=(7, 4), dpi=100)
    ax.plot(ids, [r["reward_mean"] for r in records], marker="o", color="#1f4e79", linewidth=2, label="mean reward")
    pass_keys = sorted((k for k in records[-1] if k.startswith("pass_at_")), key=lambda k: int(k.rsplit("_", 1)[1]))
    for key in pass_keys if len(pass_keys) > 1 else []:  # pass@1 alone is the mean reward of a 0/1 reward
        ax.plot(ids, [r.get(key) for r in records], marker=".", linewidth=1, label=key.replace("_at_", "@"))
    return _saved(fig, ax, "rollout_id (weights trained on the rollouts before it)", "evaluation", title, out)


def data_uri(png: Path) -> str:
    """The PNG inline, as a `data:` URI: a markdown image that needs no file server (the Prefect UI shows it)."""
    return "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode("ascii")


def plot_reward_curves(runs: dict[str, list[dict[str, Any]]], title: str, out: Path, window: int = 5) -> Path:
    """Several runs' reward curves in one image: each run's running mean over `window` rollouts, by its name."""
    fig, ax = _pyplot().subplots(figsize=(8, 4.5), dpi=100)
    for name, records in runs.items():
        smoothed = running_mean([r["reward_mean"] for r in records], window)
        ax.plot([r["rollout_id"] for r in records], smoothed, linewidth=2, label=name)
    ylabel = f"mean sampled reward (mean of the last {window})"
    return _saved(fig, ax, "rollout_id", ylabel, title, out, legend_size="small")
