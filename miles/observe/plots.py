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


def plot_reward_curve(records: list[dict[str, Any]], title: str, out: Path, window: int = 20) -> Path:
    """The iterations' mean sampled reward, and its running mean over `window` rollouts."""
    plt = _pyplot()
    ids = [r["rollout_id"] for r in records]
    rewards = [r["reward_mean"] for r in records]
    smoothed = [
        sum(rewards[max(0, i - window + 1) : i + 1]) / len(rewards[max(0, i - window + 1) : i + 1])
        for i in range(len(rewards))
    ]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(ids, rewards, color="#9bb7d4", linewidth=1, label="reward per rollout")
    ax.plot(ids, smoothed, color="#1f4e79", linewidth=2, label=f"mean of the last {window}")
    ax.set_xlabel("rollout_id")
    ax.set_ylabel("mean sampled reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def plot_eval_curve(records: list[dict[str, Any]], title: str, out: Path) -> Path:
    """One eval data set's mean reward and pass@k at each evaluation."""
    plt = _pyplot()
    ids = [r["rollout_id"] for r in records]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(ids, [r["reward_mean"] for r in records], marker="o", color="#1f4e79", linewidth=2, label="mean reward")
    pass_keys = sorted((k for k in records[-1] if k.startswith("pass_at_")), key=lambda k: int(k.rsplit("_", 1)[1]))
    for key in pass_keys if len(pass_keys) > 1 else []:  # pass@1 alone is the mean reward of a 0/1 reward
        ax.plot(ids, [r.get(key) for r in records], marker=".", linewidth=1, label=key.replace("_at_", "@"))
    ax.set_xlabel("rollout_id (weights trained on the rollouts before it)")
    ax.set_ylabel("evaluation")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def data_uri(png: Path) -> str:
    """The PNG inline, as a `data:` URI: a markdown image that needs no file server (the Prefect UI shows it)."""
    return "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode("ascii")


def plot_reward_curves(runs: dict[str, list[dict[str, Any]]], title: str, out: Path, window: int = 5) -> Path:
    """Several runs' reward curves in one image: each run's running mean over `window` rollouts, by its name."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for name, records in runs.items():
        rewards = [r["reward_mean"] for r in records]
        smoothed = [sum(rewards[max(0, i - window + 1) : i + 1]) / min(i + 1, window) for i in range(len(rewards))]
        ax.plot([r["rollout_id"] for r in records], smoothed, linewidth=2, label=name)
    ax.set_xlabel("rollout_id")
    ax.set_ylabel(f"mean sampled reward (mean of the last {window})")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
