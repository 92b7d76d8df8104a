"""A run's data pipeline, built from its DataPrepConfig: the always-on steps (binary junk,
Unicode normalisation, minimum length), then the quality filters the config names, the
blocklist and PII redaction, each with its thresholds overridden by name.

The steps themselves are in tasks/data/steps.py (the base classes and the always-on steps),
tasks/data/filters.py and tasks/data/pii.py; this module only composes them, so the steps know
nothing of one another.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tasks.configs import ConfigError
from tasks.data.filters import QUALITY_FILTERS, Blocklist
from tasks.data.pii import RedactPII
from tasks.data.steps import BinaryJunk, MinChars, MinCharsParams, Normalize, Step


def make_params(step_cls: type[Step], overrides: dict) -> Any:
    """The step's params with `overrides` applied; unknown keys are refused by name."""
    known = {f.name for f in dataclasses.fields(step_cls.Params)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ConfigError(f"DataPrepConfig.filter_params[{step_cls.name!r}]: unknown key(s) {unknown}. "
                          f"Known keys: {sorted(known)}.")
    return step_cls.Params(**overrides)


def build_pipeline(config: Any) -> list[Step]:
    """The ordered steps for `config` (a DataPrepConfig). Raises ConfigError on bad params."""
    overrides = dict(config.filter_params)
    optional = {**QUALITY_FILTERS, "blocklist": Blocklist, "pii": RedactPII}
    unknown = sorted(set(overrides) - set(optional) - {"binary"})
    if unknown:
        raise ConfigError(f"DataPrepConfig.filter_params: unknown step(s) {unknown}. "
                          f"Known: {sorted({*optional, 'binary'})}.")
    for name, value in overrides.items():
        if not isinstance(value, dict):
            raise ConfigError(f"DataPrepConfig.filter_params[{name!r}] must be an object of "
                              f"threshold overrides, got {type(value).__name__}.")

    def make(cls: type[Step]) -> Step:
        return cls(make_params(cls, overrides.get(cls.name, {})))

    steps: list[Step] = [make(BinaryJunk), Normalize(), MinChars(MinCharsParams(min_chars=config.min_chars))]
    steps += [make(QUALITY_FILTERS[name]) for name in config.filters]
    if config.blocklist:
        steps.append(Blocklist(make_params(Blocklist, {"words": list(config.blocklist),
                                                       **overrides.get("blocklist", {})})))
    if config.redact_pii:
        steps.append(make(RedactPII))
    return steps
