"""Speculative decoding's configuration (`SpeculativeConfig`, vLLM's `speculative_config`), an engine
knob (`EngineConfig.speculative_config`, config.py)."""

from __future__ import annotations

from dataclasses import dataclass

# speculative_config methods: vLLM's "mtp" and its older per-architecture name for the Qwen MTP heads
MTP_METHODS = ("mtp", "qwen3_next_mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config`): `method` "mtp" drafts with the model's own
    multi-token-prediction head (models/mtp.py), `num_speculative_tokens` k tokens per step, verified in
    one target forward of k + 1 tokens per sequence (engine/speculative.py, runner/speculative.py).
    `from_value` also takes vLLM's older per-architecture name "qwen3_next_mtp" (Qwen3-Next's model
    card uses it), stored as "mtp"."""

    method: str
    num_speculative_tokens: int

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict | None) -> SpeculativeConfig | None:
        """From a `SpeculativeConfig`, a dict such as {"method": "mtp", "num_speculative_tokens": 3}, or
        None (off). Raises ValueError naming the key that is wrong and what it takes."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict such as {{\"method\": \"mtp\", "
                             f"\"num_speculative_tokens\": 3}}, got {type(value).__name__}")
        unknown = sorted(set(value) - {"method", "num_speculative_tokens"})
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}: known are ['method', "
                             "'num_speculative_tokens']")
        method = value.get("method", "mtp")
        if method not in MTP_METHODS:
            raise ValueError(f"speculative_config method {method!r} is not supported: forkpoint drafts with the "
                             "model's MTP head, method 'mtp' (or vLLM's older name 'qwen3_next_mtp')")
        k = value.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(f"speculative_config num_speculative_tokens must be an integer from 1 to 16, got {k!r}")
        return cls("mtp", k)

