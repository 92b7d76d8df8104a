"""Validate a request against botocore's service model before it is sent.

botocore's own client-side validation rejects missing required fields, wrong types, unknown keys
and too-short values, but not maximum lengths, `pattern`s or enums: AWS refuses those only once the
request arrives, and moto accepts most of them. This checks every constraint the model declares, so
a job name one character too long or a misspelt instance type fails before anything is submitted,
with the field's path in the message.
"""

from __future__ import annotations

import datetime
import functools
import re
from typing import Any

try:  # AWS writes its patterns in Java syntax; \p{L} and friends need the `regex` module.
    import regex as _regex
except ImportError:  # pragma: no cover - then patterns using \p{...} are not checked
    _regex = None


class AwsRequestError(ValueError):
    """The request breaks the service model; the message lists each field and what is wrong."""

    def __init__(self, operation: str, problems: list[str]):
        self.operation = operation
        self.problems = problems
        super().__init__(f"{operation} request is invalid:\n  " + "\n  ".join(problems))


@functools.lru_cache(maxsize=None)
def service_model(service: str):
    """botocore's model for `service`, without credentials or a network call."""
    import botocore.session

    return botocore.session.get_session().get_service_model(service)


def validate_request(service: str, operation: str, params: dict[str, Any]) -> None:
    """Raise AwsRequestError unless `params` satisfies every constraint of the operation's input."""
    shape = service_model(service).operation_model(operation).input_shape
    problems: list[str] = []
    _check(shape, params, operation, problems)
    if problems:
        raise AwsRequestError(f"{service}.{operation}", problems)


@functools.lru_cache(maxsize=None)
def _compile(pattern: str):
    # Java allows a quantifier after `$` (e.g. `(...)${1,128}` in SageMaker's tag shapes): it is a
    # no-op there, an error here.
    pattern = re.sub(r"\$\{\d+(,\d*)?\}", "$", pattern)
    if "\\p{" in pattern:
        if _regex is None:
            return None
        pattern = pattern.replace("\\p{Alnum}", "[A-Za-z0-9]")
        return _regex.compile(pattern)
    try:
        return re.compile(pattern)
    except re.error:
        if _regex is None:
            return None
        try:
            return _regex.compile(pattern)
        except _regex.error:
            return None


def _check(shape: Any, value: Any, path: str, problems: list[str]) -> None:
    kind = shape.type_name
    meta = shape.metadata
    if kind == "structure":
        if not isinstance(value, dict):
            problems.append(f"{path}: expected an object, got {type(value).__name__}")
            return
        for key in sorted(set(value) - set(shape.members)):
            problems.append(f"{path}.{key}: unknown field (known: {', '.join(shape.members)})")
        for key in shape.required_members:
            if key not in value:
                problems.append(f"{path}.{key}: required field is missing")
        for key, member in shape.members.items():
            if key in value:
                _check(member, value[key], f"{path}.{key}", problems)
        if meta.get("union") and len(value) != 1:
            problems.append(f"{path}: exactly one member must be set, got {sorted(value)}")
    elif kind == "list":
        if not isinstance(value, (list, tuple)):
            problems.append(f"{path}: expected a list, got {type(value).__name__}")
            return
        _check_size(meta, len(value), path, "items", problems)
        for i, item in enumerate(value):
            _check(shape.member, item, f"{path}[{i}]", problems)
    elif kind == "map":
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a map, got {type(value).__name__}")
            return
        _check_size(meta, len(value), path, "entries", problems)
        for key, item in value.items():
            _check(shape.key, key, f"{path} key {key!r}", problems)
            _check(shape.value, item, f"{path}[{key!r}]", problems)
    elif kind == "string":
        if not isinstance(value, str):
            problems.append(f"{path}: expected a string, got {type(value).__name__} {value!r}")
            return
        _check_size(meta, len(value), path, "characters", problems)
        enum = getattr(shape, "enum", None)
        if enum and value not in enum:
            close = [e for e in enum if e.lower().startswith(value.lower()[:5])][:8]
            hint = f" (did you mean one of {close}?)" if close else f" (one of {len(enum)} values)"
            problems.append(f"{path}: {value!r} is not an allowed value{hint}")
        pattern = meta.get("pattern")
        if pattern:
            compiled = _compile(pattern)
            if compiled is not None and not compiled.fullmatch(value):
                problems.append(f"{path}: {value!r} does not match the pattern {pattern}")
    elif kind in ("integer", "long"):
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{path}: expected an integer, got {type(value).__name__} {value!r}")
            return
        _check_range(meta, value, path, problems)
    elif kind in ("float", "double"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(f"{path}: expected a number, got {type(value).__name__} {value!r}")
            return
        _check_range(meta, value, path, problems)
    elif kind == "boolean":
        if not isinstance(value, bool):
            problems.append(f"{path}: expected true or false, got {type(value).__name__} {value!r}")
    elif kind == "timestamp":
        if not isinstance(value, (datetime.datetime, str, int, float)):
            problems.append(f"{path}: expected a timestamp, got {type(value).__name__}")
    elif kind == "blob":
        if not isinstance(value, (bytes, bytearray, str)):
            problems.append(f"{path}: expected bytes, got {type(value).__name__}")


def _check_size(meta: dict, size: int, path: str, unit: str, problems: list[str]) -> None:
    if "min" in meta and size < meta["min"]:
        problems.append(f"{path}: {size} {unit}, fewer than the minimum {meta['min']}")
    if "max" in meta and size > meta["max"]:
        problems.append(f"{path}: {size} {unit}, more than the maximum {meta['max']}")


def _check_range(meta: dict, value: float, path: str, problems: list[str]) -> None:
    if "min" in meta and value < meta["min"]:
        problems.append(f"{path}: {value} is below the minimum {meta['min']}")
    if "max" in meta and value > meta["max"]:
        problems.append(f"{path}: {value} is above the maximum {meta['max']}")
