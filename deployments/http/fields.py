"""Multipart form fields of the HTTP API read one way everywhere: flags, bounded numbers and list
fields as OpenAI's client sends them, each wrong value a 400 naming its field."""

from __future__ import annotations

from starlette.datastructures import FormData

from deployments.http.errors import APIError
from engine.errors import quoted


def parse_flag(raw, name: str, default: bool) -> bool:
    if raw in (None, ""):
        return default
    if str(raw).lower() in ("true", "1"):
        return True
    if str(raw).lower() in ("false", "0"):
        return False
    raise APIError(400, f"Invalid {name} {quoted(raw)}; expected true or false.", param=name)


def parse_number(raw, name: str, kind: type, low: float, high: float, default):
    """A numeric vendor field within [low, high]; absent: ``default``."""
    if raw in (None, ""):
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        expected = "a whole number" if kind is int else "a number"
        raise APIError(
            400, f"Invalid {name} {quoted(raw)}; expected {expected} from {low:g} to {high:g}.", param=name
        )
    return value


def list_field(form: FormData, name: str) -> list[str]:
    """A list field as OpenAI's client sends it (``name[]`` once per item), or as ``name``."""
    return form.getlist(f"{name}[]") or form.getlist(name)
