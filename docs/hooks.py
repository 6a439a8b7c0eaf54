"""MkDocs hook: the configuration reference's tables, made from `miles.config.RunConfig`'s own fields at build time."""

from __future__ import annotations

import inspect
import types
import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

MARKER = "<!-- the configuration tables -->"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    from miles.config import RunConfig

    return markdown.replace(MARKER, "\n".join(_section_tables(RunConfig, "", "The run")))


def _section_tables(model: type[BaseModel], prefix: str, title: str) -> list[str]:
    """A table of `model`'s own settings, then one per section it holds (a list of sections: its item's fields)."""
    rows, sections = [], []
    for name, field in model.model_fields.items():
        section = _section_type(field.annotation)
        if section is not None:
            listed = typing.get_origin(field.annotation) is list
            sections.append((section, f"{prefix}{name}.{'N.' if listed else ''}", f"`{prefix}{name}`"))
            continue
        default = "required" if field.default is PydanticUndefined and field.default_factory is None else ""
        if not default:
            value = field.default_factory() if field.default_factory is not None else field.default
            default = f"`{value!r}`"
        description = (field.description or "").replace("|", "\\|").replace("\n", " ")
        rows.append(f"| `{prefix}{name}` | `{_type_name(field.annotation)}` | {default} | {description} |")
    lines = [f"## {title}", ""]
    doc = model.__dict__.get("__doc__")  # its own, not pydantic's BaseModel's
    if doc:
        lines += [" ".join(doc.split()), ""]
    if rows:
        lines += ["| setting | type | default | what |", "|---|---|---|---|", *rows, ""]
    for section, section_prefix, section_title in sections:
        lines += _section_tables(section, section_prefix, section_title)
    return lines


def _section_type(annotation) -> type[BaseModel] | None:
    """The section class a field holds (alone, optional, or as a list's item); None for a plain setting."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if inspect.isclass(candidate) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _type_name(annotation) -> str:
    if inspect.isclass(annotation) and not typing.get_args(annotation):
        return annotation.__name__
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return " | ".join(_type_name(a) for a in typing.get_args(annotation))
    return str(annotation).replace("typing.", "")
