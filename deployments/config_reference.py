"""The configuration reference, docs/configuration.md, written from the pydantic models themselves.

    python -m deployments.config_reference > docs/configuration.md    (or: make docs)

Every field of the app config, walked recursively through the models it nests: its type (with the
bounds the model enforces), its default and its description. A nested model is a section of its own.
The page is generated so it cannot drift from the code; tests/test_docs.py checks that the committed
page equals this module's output.
"""

from __future__ import annotations

import sys
import types
import typing
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from deployments.config import AppConfig

REGENERATE = "python -m deployments.config_reference > docs/configuration.md"

INTRO = f"""# Configuration reference

<!-- Generated from the pydantic models by `{REGENERATE}` (make docs). Do not edit by hand. -->

A config file is a Ray Serve config (`serve run configs/<name>.yaml`); the whisper-disagg
application's `args` are the fields below. They are validated once, when the app is built: an
unknown or bad field stops start-up with a message that names the field and says why. Every
section is optional; a field left out takes its default.

```yaml
applications:
  - name: whisper
    route_prefix: /
    import_path: deployments.app:build_app
    args:
      engine: {{model: tiny.en, device: cpu}}
      encoder: {{num_replicas: 1, max_batch_size: 8}}
      decoder: {{num_replicas: 1}}
```

That app serves one model. An app that serves several lists them under `models:`, each with its own
`engine`, `transfer`, `placement`, `encoder` and `decoder` (its own deployments), its name and
aliases; requests choose one by `model` (`configs/default.yaml` serves two):

```yaml
    args:
      models:
        - {{name: tiny.en, aliases: [whisper-1], default: true, engine: {{model: tiny.en, device: cpu}}}}
        - {{name: base, engine: {{model: base, device: cpu}}, decoder: {{num_replicas: 2}}}}
```

Some defaults read `auto` or `None` and are resolved at start-up (against the device, the CPU's
instructions or an installed package); the description says how.
"""

_BOUNDS = (
    (annotated_types.Gt, ">", "gt"),
    (annotated_types.Ge, ">=", "ge"),
    (annotated_types.Lt, "<", "lt"),
    (annotated_types.Le, "<=", "le"),
)


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds (``Model`` or ``Model | None``), or None for a plain value."""
    candidates = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _listed_model(annotation: Any) -> type[BaseModel] | None:
    """The model a list field holds items of (``list[Model]``), or None."""
    if typing.get_origin(annotation) is not list:
        return None
    return _nested_model(typing.get_args(annotation)[0])


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def type_name(annotation: Any) -> str:
    """A field's type as a reader writes it: ``int | None``, ``'auto' | 'cpu'``, ``dict[str, float]``."""
    if annotation is type(None):
        return "None"
    if _is_union(annotation):
        return " | ".join(type_name(arg) for arg in typing.get_args(annotation))
    if typing.get_origin(annotation) is Literal:
        return " | ".join(repr(value) for value in typing.get_args(annotation))
    origin = typing.get_origin(annotation)
    if origin is not None:
        args = ", ".join(type_name(arg) for arg in typing.get_args(annotation))
        return f"{origin.__name__}[{args}]"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation)


def _bounds(field: FieldInfo) -> str:
    found = []
    for constraint in field.metadata:
        for kind, symbol, attribute in _BOUNDS:
            if isinstance(constraint, kind):
                found.append(f"{symbol} {getattr(constraint, attribute)}")
    return ", ".join(found)


def _default(field: FieldInfo) -> Any:
    if field.default_factory is not None:
        return field.default_factory()
    return None if field.default is PydanticUndefined else field.default


def _format_value(value: Any) -> str:
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, str):
        return f"`{value!r}`"
    return f"`{value}`"


def _sentence(text: str) -> str:
    """A description as prose under a heading: one line, a capital first, a full stop last."""
    text = " ".join(text.split())
    return text[0].upper() + text[1:] + ("" if text.endswith(".") else ".")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _section_defaults(field: FieldInfo) -> dict[str, Any]:
    """The values a section's own default sets apart from its model's defaults: a field whose
    default_factory builds the model with arguments (the ingress's replica options, for one).
    A factory that is the model class itself sets nothing; its validators may resolve ``auto``
    values against this machine, which the page must not record."""
    factory = field.default_factory
    model = _nested_model(field.annotation)
    if factory is None or factory is model:
        return {}
    instance = factory()
    if not isinstance(instance, BaseModel):
        return {}
    return {name: getattr(instance, name) for name in instance.model_fields_set}


def _table(model: type[BaseModel], overrides: dict[str, Any]) -> list[str]:
    rows = []
    for name, field in model.model_fields.items():
        if _nested_model(field.annotation) is not None:
            continue
        value = overrides[name] if name in overrides else _default(field)
        kind = type_name(field.annotation)
        bounds = _bounds(field)
        if bounds:
            kind = f"{kind} ({bounds})"
        description = field.description or ""
        rows.append(f"| `{name}` | {_cell(kind)} | {_cell(_format_value(value))} | {_cell(description)} |")
    if not rows:
        return []
    return ["| field | type | default | description |", "|---|---|---|---|", *rows, ""]


def _section(
    model: type[BaseModel], path: str, depth: int, overrides: dict[str, Any], description: str | None
) -> list[str]:
    lines = [f"{'#' * depth} `{path}`", ""] if path else []
    notes = [text.strip() for text in (description, model.__doc__) if text and text.strip()]
    for note in notes:
        lines += [_sentence(note), ""]
    lines += _table(model, overrides)
    for name, field in model.model_fields.items():
        nested = _nested_model(field.annotation)
        if nested is None:
            continue
        child = f"{path}.{name}" if path else name
        lines += _section(nested, child, min(depth + 1, 4), _section_defaults(field), field.description)
    return lines


def _list_section(item: type[BaseModel], path: str, top_level: dict[type, str]) -> list[str]:
    """A list's items: their own fields, and the sections they share with the top level by name."""
    lines = [f"## `{path}[]`", "", _sentence(item.__doc__.strip()), ""]
    lines += _table(item, {})
    shared = [
        f"`{name}`"
        for name, field in item.model_fields.items()
        if top_level.get(_nested_model(field.annotation)) == name
    ]
    if shared:
        lines += [
            f"Each item's {', '.join(shared)} take the fields of the top-level sections of those names.",
            "",
        ]
    return lines


def render(model: type[BaseModel] = AppConfig) -> str:
    """The whole page for ``model`` (the app config), as Markdown."""
    lines = [INTRO, "## Top level", ""]
    lines += _table(model, {})
    top_level = {}
    for name, field in model.model_fields.items():
        nested = _nested_model(field.annotation)
        if nested is not None:
            top_level[nested] = name
            lines += _section(nested, name, 2, _section_defaults(field), field.description)
    for name, field in model.model_fields.items():
        item = _listed_model(field.annotation)
        if item is not None:
            lines += _list_section(item, name, top_level)
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
