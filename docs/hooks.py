"""MkDocs hook: the configuration reference's tables, made from `miles.config.RunConfig`'s own fields at build time:
each setting's type, default, when it may change (its marks) and description."""

from __future__ import annotations

import inspect
import types
import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from miles.config import RunConfig
from miles.config.base import CHANGES_FREELY, has_mark, holds_list, marks, section_type

MARKER = "<!-- the configuration tables -->"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, "\n".join(_section_tables(RunConfig, "", "The run", freely=False)))


def _section_tables(model: type[BaseModel], prefix: str, title: str, freely: bool) -> list[str]:
    """A table of `model`'s own settings, then one per section it holds (a list of sections: its item's fields).
    `freely`: the section is marked as changing freely between starts, and so is every field in it."""
    rows, sections = [], []
    for name, field in model.model_fields.items():
        field_freely = freely or has_mark(field, CHANGES_FREELY)
        section = section_type(field.annotation)
        if section is not None:
            listed = holds_list(field.annotation)
            sections.append((section, f"{prefix}{name}.{'N.' if listed else ''}", f"`{prefix}{name}`", field_freely))
            continue
        default = "required" if field.default is PydanticUndefined and field.default_factory is None else ""
        if not default:
            value = field.default_factory() if field.default_factory is not None else field.default
            default = f"`{value!r}`"
        description = (field.description or "").replace("|", "\\|").replace("\n", " ")
        rows.append(
            f"| `{prefix}{name}` | `{_type_name(field.annotation)}` | {default} | {_when(field, field_freely)} | "
            f"{description} |"
        )
    lines = [f"## {title}", ""]
    doc = model.__dict__.get("__doc__")  # its own, not pydantic's BaseModel's
    if doc:
        lines += [" ".join(doc.split()), ""]
    if rows:
        lines += ["| setting | type | default | changes | what |", "|---|---|---|---|---|", *rows, ""]
    for section, section_prefix, section_title, section_freely in sections:
        lines += _section_tables(section, section_prefix, section_title, section_freely)
    return lines


def _when(field, freely: bool) -> str:
    """When a setting may change: in a paused run (its name in the pause form), between starts, or neither (a start
    that changes it is refused unless accept_config_change)."""
    when = [f"mid-run (`{marks(field)['mid_run']}`)"] if "mid_run" in marks(field) else []
    if freely:
        when.append("between starts")
    return ", ".join(when)


def _type_name(annotation) -> str:
    if inspect.isclass(annotation) and not typing.get_args(annotation):
        return annotation.__name__
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return " | ".join(_type_name(a) for a in typing.get_args(annotation))
    return str(annotation).replace("typing.", "")
