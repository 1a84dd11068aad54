"""A model's `generation_config.json` as request defaults, as vLLM honours it.

Only `max_new_tokens` is read: it becomes the default `max_tokens` of requests that give none
(offline: `SamplingParams(max_tokens=None)` or no SamplingParams at all; over HTTP: a request
without `max_tokens`), capped by the room the prompt leaves in `max_model_len`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

FILE_NAME = "generation_config.json"


@dataclass(frozen=True)
class GenerationDefaults:
    """max_new_tokens: the default max_tokens (None: the model sets none)."""

    max_new_tokens: int | None = None

    @classmethod
    def from_model_dir(cls, directory: Path) -> GenerationDefaults:
        """Read `directory/generation_config.json`; a missing file means no defaults. Raises
        ValueError naming the file when it is not JSON or max_new_tokens is not a positive int."""
        path = Path(directory) / FILE_NAME
        if not path.is_file():
            return cls()
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON: {err}") from None
        value = data.get("max_new_tokens") if isinstance(data, dict) else None
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{path}: max_new_tokens must be a positive integer, got {value!r}")
        return cls(max_new_tokens=value)
