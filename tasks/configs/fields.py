"""The config machinery every stage's schema is built with: `bounded` fields whose bounds live in
their metadata (the Airflow Param schema and the config's own validation read the same numbers),
`check_bounds` and `check` for `__post_init__`, `from_dict` (plain JSON in, unknown keys refused so
a typo in an override fails loudly), `to_dict`, `flatten` (MLflow params) and `field_type` (the
type at a dotted path, for the sweep's search space). Standard library only."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import field
from typing import Any, TypeVar, get_type_hints

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value is wrong; the message names the field and how to fix it."""


def check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def bounded(default: Any, *, minimum: float | None = None, maximum: float | None = None,
            help: str = "", choices: tuple | None = None) -> Any:
    """A dataclass field whose bounds live in its metadata, so the Airflow Param schema and the
    config's own validation are generated from the same numbers."""
    meta = {"minimum": minimum, "maximum": maximum, "help": help, "choices": choices}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def check_bounds(cfg: Any) -> None:
    """Check every field declared with `bounded` against its minimum, maximum and choices."""
    name = type(cfg).__name__
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        lo, hi, choices = f.metadata.get("minimum"), f.metadata.get("maximum"), f.metadata.get("choices")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            if choices is not None:
                check(value in choices, f"{name}.{f.name} must be one of {list(choices)}, got {value!r}.")
            continue
        check(math.isfinite(value), f"{name}.{f.name} must be a finite number, got {value!r}.")
        if lo is not None:
            check(value >= lo, f"{name}.{f.name} must be >= {lo}, got {value!r}.")
        if hi is not None:
            check(value <= hi, f"{name}.{f.name} must be <= {hi}, got {value!r}.")


def from_dict(cls: type[T], data: dict[str, Any], *, where: str = "") -> T:
    """Build a (possibly nested) config dataclass from plain JSON data, refusing unknown keys."""
    where = where or cls.__name__
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a JSON object, got {type(data).__name__}.")
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"Unknown config key(s) in {where}: {unknown}. Known keys: {sorted(known)}.")
    hints = get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = from_dict(hint, value, where=f"{where}.{key}")
        else:
            kwargs[key] = _coerce(value, hint, f"{where}.{key}")
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field is missing
        raise ConfigError(f"{where}: {exc}") from None


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Accept what JSON can carry for a field and refuse the rest with the field's name."""
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool):
        if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
            raise ConfigError(f"{where} must be {hint.__name__}, got {type(value).__name__} {value!r}.")
    return value


def field_type(cls: Any, path: str) -> Any:
    """The type of the field at a dotted path of a config dataclass (None if there is none)."""
    for name in path.split("."):
        if not dataclasses.is_dataclass(cls):
            return None
        hints = get_type_hints(cls)
        if name not in hints:
            return None
        cls = hints[name]
    return cls


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"model": {"n_layer": 2}}` -> `{"model.n_layer": 2}`, for MLflow params."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out

