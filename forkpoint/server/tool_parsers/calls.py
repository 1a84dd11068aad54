"""The values the tool-call readers produce: one parsed call, and what a stream adds with each piece."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# tool name -> its `parameters` JSON schema ({} when the tool has none)
Schemas = Mapping[str, Mapping[str, Any]]


def schemas_of(tools: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """The request's function definitions ({"name", "parameters"?, ...}) by name."""
    return {t["name"]: (t.get("parameters") or {}) for t in tools}


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: `arguments` is a JSON object text, as OpenAI's API carries it."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolDelta:
    """New output of a stream: content text and the calls completed by this piece."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
