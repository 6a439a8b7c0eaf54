"""The reward curve of a run as a PNG, drawn from metrics.jsonl."""

from __future__ import annotations

import base64
import json
from pathlib import Path


def plot_reward_curve(metrics_path: Path, out: Path, window: int = 20) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in metrics_path.read_text().splitlines()]
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
    ax.set_title(metrics_path.parent.name)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def data_uri(png: Path) -> str:
    """The PNG inline, as a `data:` URI: a markdown image that needs no file server (the Prefect UI shows it)."""
    return "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode("ascii")
