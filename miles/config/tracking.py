"""What a run reports: the logging section (trackers, events, lineage) and the alerts section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from miles.config.base import Section


class LoggingConfig(Section):
    trackers: list[Literal["tensorboard", "mlflow", "wandb"]] = Field(
        default_factory=list,
        description="experiment trackers, each an optional extra (pip install 'miles-flow[tensorboard]', ...)",
    )
    project: str = Field("miles-flow", description="the MLflow experiment and the W&B project")
    events: bool = Field(True, description="a flow emits Prefect events of its iterations, checkpoints and alerts")
    lineage: bool = Field(
        True, description="each checkpoint records what made it: rollouts (sha256), data rows, config, code version"
    )


class AlertsConfig(Section):
    """What a run's iteration records are watched for (miles.observe.alerts); a flow emits an event for each alert, which the
    shipped automations act on (docs/guides/control.md, "Events and automations")."""

    failed_reward_fraction: float = Field(
        0.5, gt=0, le=1, description="an iteration is unhealthy when the reward failed on this share of its samples"
    )
    reward_collapse_window: int = Field(
        5, gt=0, description="iterations averaged: the latest window's mean reward against the best window's"
    )
    reward_collapse_drop: float = Field(
        0.5, gt=0, le=1, description="a collapse: the latest window's mean is below (1 - this) x the best window's"
    )
    stall_factor: float = Field(
        5.0,
        gt=1,
        description="a run is stalled when no iteration has finished for this many times its median iteration time",
    )
    min_stall_s: float = Field(
        30.0, ge=10, description="the shortest time without an iteration that counts as stalled (Prefect's least: 10)"
    )
