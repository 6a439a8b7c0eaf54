"""What every config section shares: the marks a field carries (what it names, when it may change) and the error a
config that cannot run raises."""

from __future__ import annotations

import inspect
from types import UnionType
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.fields import FieldInfo

# A field's marks sit in its `json_schema_extra`; a field may carry several (`IMPORT_PATH | CHANGES_FREELY`).
# Names the user's code as 'pkg.mod:name' (Section.import_paths lists them; deployments allow only some).
IMPORT_PATH = {"import_path": True}
# Chooses a program a worker starts (Section.launch_settings lists them; deployments refuse changes to them).
LAUNCH = {"launch": True}
# Names a file or directory the run reads or writes (Section.file_paths lists them; deployments confine them).
FILE_PATH = {"file_path": True}
# May differ between a run's starts (docs/getting-started.md, "Resuming a run"): it says how long the run goes, where it
# runs and with what resources, how it is evaluated and logged, how the engines and the trainer compute (the same
# samples and steps, up to float rounding), or how long a reward may take. On a section: every field in it. Any other
# field changes what a rollout or a step means: a start that changes it is refused unless accept_config_change.
CHANGES_FREELY = {"changes_freely": True}


def mid_run(form_name: str) -> dict[str, str]:
    """Marks a field a paused run may change, named `form_name` in the pause form (docs/guides/control.md, "Change
    settings mid-run, on the record"). Such a field changes how the rollouts after the change are sampled and trained,
    how long the run goes or what is due, never what a stored rollout means."""
    return {"mid_run": form_name}


def marks(info: FieldInfo) -> dict[str, Any]:
    return info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}


def has_mark(info: FieldInfo, mark: dict[str, Any]) -> bool:
    return mark.items() <= marks(info).items()


def section_type(annotation: Any) -> type[Section] | None:
    """The section class a field holds (alone, optional, or as a list's item); None for a plain setting."""
    for candidate in (annotation, *get_args(annotation)):
        if get_origin(candidate) is list:
            candidate = get_args(candidate)[0]
        if inspect.isclass(candidate) and issubclass(candidate, BaseModel):
            return candidate
    return None


def list_item(annotation: Any) -> Any:
    """The item type of a field that holds a list (alone or optional); None for any other field."""
    for candidate in (annotation, *(get_args(annotation) if get_origin(annotation) in (Union, UnionType) else ())):
        if get_origin(candidate) is list:
            return get_args(candidate)[0]
    return None


def holds_list(annotation: Any) -> bool:
    """Whether a field holds a list (alone or optional)."""
    return list_item(annotation) is not None


def along(schema: type[BaseModel], keys: list[str]) -> tuple[list[tuple[FieldInfo, Any]], bool]:
    """The fields the dotted path `keys` passes through in `schema`, outermost first, each with the type the path
    holds after it: the field's own, or its list's item type where the next key names an item (an index, or an
    adapter's name); and whether the whole path is in the schema (the walk stops before a key it does not have)."""
    found, model, rest = [], schema, list(keys)
    while rest and model is not None and rest[0] in model.model_fields:
        info = model.model_fields[rest.pop(0)]
        kind = info.annotation
        if holds_list(kind) and rest:
            rest.pop(0)
            kind = list_item(kind)
        found.append((info, kind))
        model = section_type(kind)
    return found, not rest


class Section(BaseModel):
    """A config section: unknown keys are refused, and a value set later is validated as one given at the start."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def marked(self, mark: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        """Every field carrying `mark` (in sections, and in lists of sections), by its dotted name, with its value."""
        found = {}
        for name, info in type(self).model_fields.items():
            value = getattr(self, name)
            field = f"{prefix}{name}"
            if isinstance(value, Section):
                found |= value.marked(mark, f"{field}.")
            elif isinstance(value, list) and value and isinstance(value[0], Section):
                for index, item in enumerate(value):
                    found |= item.marked(mark, f"{field}.{index}.")
            elif has_mark(info, mark):
                found[field] = value
        return found

    def import_paths(self) -> dict[str, str]:
        """Every 'pkg.mod:name' the config names, by field: {'data.reward': 'my_rewards:score', ...}."""
        return {f: v for f, v in self.marked(IMPORT_PATH).items() if isinstance(v, str) and ":" in v}

    def launch_settings(self) -> dict[str, Any]:
        """Every field that chooses a program a worker starts, with its value: {'rollout.sglang.python': ..., ...}."""
        return self.marked(LAUNCH)

    def file_paths(self) -> dict[str, str]:
        """Every file or directory the config names, by field: {'run_dir': ..., 'data.path': ..., ...}."""
        return {f: v for f, v in self.marked(FILE_PATH).items() if v is not None}


def changes_freely(schema: type[Section], field: str) -> bool:
    """Whether the dotted `field` of `schema` may differ between starts: it, or a section holding it, is marked
    CHANGES_FREELY. A list's item is named by any key (its index, or an adapter's name); an unknown field is compared."""
    found, _ = along(schema, field.split("."))
    return any(has_mark(info, CHANGES_FREELY) for info, _ in found)


class ConfigError(ValueError):
    """A config that cannot run; the message names the field (and the file, when there is one)."""


def format_validation_error(err: ValidationError, source: str) -> str:
    problems = []
    for item in err.errors():
        message = item["msg"].removeprefix("Value error, ")
        field = ".".join(str(p) for p in item["loc"])
        problems.append(f"{field}: {message}" if field else message)
    if len(problems) == 1:
        return f"invalid config ({source}): {problems[0]}"
    return "\n  ".join([f"invalid config ({source}):", *problems])
