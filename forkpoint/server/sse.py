"""Server-sent events of the streaming endpoints: compact JSON (`ensure_ascii=False`, no spaces) framed
as `data: <json>\n\n`, the text `json.dumps(payload, ensure_ascii=False, separators=(",", ":"))` gives.

Every generated token of every stream is one chunk built on the event loop (issue 26: at 256 chat streams
the server held the GIL 53% of the time), so the chunk path avoids per-chunk setup: the C encoder is
built once (`json.dumps` with options builds a `JSONEncoder`, and its `encode` a C encoder, per call),
and a chat or completions chunk's constant part (id, created, model, object) is serialised once per
request (`ChunkFrame`), each chunk encoding only its choice.
"""

from __future__ import annotations

import json
from json.encoder import c_make_encoder, encode_basestring
from typing import Any

_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
# circular-reference checks off (markers None): a payload is plain data built per chunk, and the bytes
# of an acyclic value are the same either way
_C_ENCODE = (c_make_encoder(None, _ENCODER.default, encode_basestring, None, ":", ",", False, False, True)
             if c_make_encoder is not None else None)


def encode_json(value: Any) -> str:
    """`json.dumps(value, ensure_ascii=False, separators=(",", ":"))` for acyclic plain data."""
    if _C_ENCODE is None or not isinstance(value, (dict, list)):  # the C encoder takes containers only
        return _ENCODER.encode(value)
    return "".join(_C_ENCODE(value, 0))


def sse(payload: dict[str, Any] | str) -> str:
    """One event: `payload` as compact JSON, or a string as it is (`[DONE]`)."""
    return f"data: {payload if isinstance(payload, str) else encode_json(payload)}\n\n"


class ChunkFrame:
    """The events of one streamed response whose chunks are `{**header, "object": object_name,
    "choices": [...], **extra}`: the part before the choices is serialised once."""

    def __init__(self, header: dict[str, Any], object_name: str) -> None:
        self.base = {**header, "object": object_name}
        opening = encode_json({**self.base, "choices": []})
        assert opening.endswith("[]}"), opening
        self._prefix = f"data: {opening[:-2]}"  # 'data: {"id":...,"object":...,"choices":['

    def event(self, choice: dict[str, Any]) -> str:
        """The event of a chunk with one choice: `sse({**header, "object": ..., "choices": [choice]})`."""
        return f"{self._prefix}{encode_json(choice)}]}}\n\n"

    def with_fields(self, choices: list[dict[str, Any]], **fields: Any) -> str:
        """An event with other fields after the choices (the usage chunk): built whole, once a stream."""
        return sse({**self.base, "choices": choices, **fields})
