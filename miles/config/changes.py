"""Changes to a run's config: the pause form of the values a paused run may change (made from the fields marked
`mid_run`), and what differs between a run's starts (compared unless marked CHANGES_FREELY)."""

from __future__ import annotations

import json
import time
from typing import Any

import pydantic
from pydantic import BaseModel, Field
from pydantic.fields import FieldInfo

from miles.config.base import Section, along, changes_freely
from miles.config.run import ConfigChange, RunConfig, mid_run_fields
from miles.state.run_dir import RunDir

# The form's names of the fields a paused run may change, in the config's order: {'num_rollout': 'num_rollout', ...}.
MID_RUN_FIELDS = mid_run_fields()


def field_value(config: BaseModel, field: str) -> Any:
    """The value of the dotted `field` (e.g. train.lr) of `config`."""
    for name in field.split("."):
        config = getattr(config, name)
    return config


class _MidRunForm(Section):
    @classmethod
    def of(cls, config: RunConfig, rollout_id: int) -> _MidRunForm:
        """The values in effect at `rollout_id`."""
        config = config.at(rollout_id)
        return cls(**{name: field_value(config, field) for name, field in MID_RUN_FIELDS.items()})

    def change(self, config: RunConfig, rollout_id: int) -> ConfigChange | None:
        """The values that differ from those in effect at `rollout_id`, as a change from `rollout_id` on (None: none)."""
        current = config.at(rollout_id)
        values = {
            field: getattr(self, name)
            for name, field in MID_RUN_FIELDS.items()
            if getattr(self, name) != field_value(current, field)
        }
        if not values:
            return None
        return ConfigChange(
            rollout_id=rollout_id, values=values, by=self.changed_by, reason=self.reason, time=time.time()
        )


def _form_field(field: str) -> tuple[Any, FieldInfo]:
    """A form field with the config field's type and bounds, described by its dotted name."""
    info = along(RunConfig, field.split("."))[0][-1][0]
    return info.annotation, FieldInfo.merge_field_infos(
        info, description=f"{field}: {info.description}", json_schema_extra=None
    )


# The values a paused run may change, by their name in the pause form, with who changes them and why.
MidRunSettings: type[_MidRunForm] = pydantic.create_model(
    "MidRunSettings",
    __base__=_MidRunForm,
    __doc__="The values a paused run may change, with who changes them and why.",
    **{name: _form_field(field) for name, field in MID_RUN_FIELDS.items()},
    changed_by=(str, Field("", description="who makes the change (recorded with it)")),
    reason=(str, Field("", description="why (recorded with it)")),
)


def config_changes(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """'field: recorded -> current' for each field (of the JSON forms of two RunConfigs) that differs and is not one
    that changes freely. Adapters are matched by name: one added or removed is no change of the others."""
    before, after = _flat(recorded), _flat(current)
    return [
        f"{field}: {json.dumps(before[field])} -> {json.dumps(after[field])}"
        for field in sorted(before.keys() & after.keys())
        if before[field] != after[field] and not changes_freely(RunConfig, field)
    ]


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for name, value in config.items():
        field = f"{prefix}{name}"
        if field == "adapters":
            value = {adapter["name"]: adapter for adapter in value}
        if isinstance(value, dict):
            flat |= _flat(value, f"{field}.")
        else:
            flat[field] = value
    return flat


def recorded_changes(run_dir: RunDir) -> list[ConfigChange]:
    """The changes made in the middle of the run in `run_dir` (run.json), to apply on top of a start's config."""
    return [ConfigChange.model_validate(change) for change in run_dir.recorded_changes()]
