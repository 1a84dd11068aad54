"""How JSON schemas become grammars (`StructuredOutputsConfig`, vLLM's `structured_outputs_config`),
an engine knob (`EngineConfig.structured_outputs_config`, config.py) read by structured/compiler.py."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """How JSON schemas become grammars; vLLM's `structured_outputs_config` keys, with defaults that give
    what vLLM's default backend does with additional properties.

    disable_additional_properties: True (default, as vLLM's xgrammar backend): an object schema that
        lists `properties` and does not mention `additionalProperties` allows no other properties.
        False: strict JSON Schema semantics (any other property allowed unless the schema forbids it;
        a model may then add properties until max_tokens).
    disable_any_whitespace: True (default): compact JSON, no whitespace between tokens. False (vLLM's
        default): any whitespace between tokens; weak or random models may then write whitespace until
        max_tokens (on the embedded random-weight model 7 of 8 runs of a one-boolean schema did).
    """

    disable_additional_properties: bool = True
    disable_any_whitespace: bool = True

    @classmethod
    def from_value(cls, value: StructuredOutputsConfig | dict | None) -> StructuredOutputsConfig:
        """From a `StructuredOutputsConfig`, a dict of its keys (as vLLM's `--structured-outputs-config`),
        or None (the defaults). Raises ValueError naming unknown keys or non-boolean values."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs_config must be a dict such as "
                             f"{{\"disable_any_whitespace\": false}}, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"structured_outputs_config has unknown keys {unknown}: known are {sorted(known)}")
        for key, flag in value.items():
            if not isinstance(flag, bool):
                raise ValueError(f"structured_outputs_config[{key!r}] must be true or false, got {flag!r}")
        return cls(**value)

