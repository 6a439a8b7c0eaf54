"""Loading a config: a YAML file, then `a.b=value` overrides typed by the field they set, then explicit fields; a
config that does not validate raises ConfigError naming the field and the file."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from miles.config.adapters import AdapterConfig
from miles.config.base import ConfigError, Section, along, format_validation_error
from miles.config.run import RunConfig


def _parse_override(text: str, schema: type[BaseModel]) -> tuple[list[str], Any]:
    """`a.b=value` as (keys, value): a string field takes the text as it is (`null` unsets an optional one); any
    other field takes the text as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {text!r} is not of the form a.b=value")
    keys = key.split(".")
    found, complete = along(schema, keys)
    kind = found[-1][1] if complete else None
    if kind in (str, str | None):
        return keys, None if kind is not str and raw in ("null", "~") else raw
    try:
        return keys, yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: the value is not valid YAML ({_yaml_problem(exc)})") from None


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """What is wrong, and where, in one line."""
    mark = getattr(exc, "problem_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return f"{getattr(exc, 'problem', None) or str(exc).splitlines()[0]}{where}"


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, **fields: Any) -> RunConfig:
    """Build a RunConfig from an optional YAML file, `a.b=value` overrides, then explicit top-level fields."""
    return _load(RunConfig, path, overrides, fields)


def load_adapter_config(path: str | Path | None = None, overrides: list[str] | None = None) -> AdapterConfig:
    """Build an AdapterConfig (a tenant's) from an optional YAML file and `a.b=value` overrides."""
    return _load(AdapterConfig, path, overrides, {})


def _load(schema: type[Section], path: str | Path | None, overrides: list[str] | None, fields: dict[str, Any]) -> Any:
    source = str(path) if path else "defaults"
    data: dict[str, Any] = {}
    if path:
        try:
            content = Path(path).read_bytes()
            loaded = yaml.safe_load(content.decode("utf-8"))
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
        except UnicodeDecodeError as exc:
            line = content[: exc.start].count(b"\n") + 1
            raise ConfigError(f"config file {path} is not UTF-8 text (line {line}: {exc.reason})") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {_yaml_problem(exc)}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        data = loaded or {}
    return _apply(schema, data, overrides, fields, source)


def override_config(base: RunConfig, overrides: list[str], **fields: Any) -> RunConfig:
    """`base` with `a.b=value` overrides, then explicit top-level fields, applied."""
    return _apply(RunConfig, base.model_dump(mode="json"), overrides, fields, "overrides")


def _apply(
    schema: type[Section], data: dict[str, Any], overrides: list[str] | None, fields: dict[str, Any], source: str
) -> Any:
    for text in overrides or []:
        keys, value = _parse_override(text, schema)
        node: Any = data
        for key, child in pairwise(keys):
            node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
            if isinstance(node, list) and not (child.isdigit() and int(child) < len(node)):
                raise ConfigError(f"override {text!r}: {key} holds {len(node)} items; {child} is not one of them")
            if not isinstance(node, dict | list):
                raise ConfigError(f"override {text!r}: {key} is not a section")
        node[int(keys[-1]) if isinstance(node, list) else keys[-1]] = value
    data.update({k: v for k, v in fields.items() if v is not None})
    try:
        return schema.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source)) from None
