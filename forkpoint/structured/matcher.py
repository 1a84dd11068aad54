"""One constrained sequence's parser state (an llguidance `LLMatcher`), and the per-step fill of
the bitmasks of all constrained rows in one parallel call."""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import torch


class GrammarMatcher:
    """The grammar state of one sequence: which tokens may come next, advanced by each sampled token.

    Made by `GrammarCompiler.matcher`; `executor` is the compiler's thread pool for mask fills.
    After the grammar is complete only the EOS tokens are allowed (the sequence then stops as on
    any EOS). A token the grammar refuses (possible only when the caller ignores the mask) puts
    the matcher in an error state: `error` says why, and later masks allow only EOS.
    """

    def __init__(self, matcher: llguidance.LLMatcher, executor: llguidance.LLExecutor,
                 eos_token_ids: Sequence[int]) -> None:
        self._matcher = matcher
        self._executor = executor
        self._eos = list(eos_token_ids)

    @property
    def eos_token_ids(self) -> list[int]:
        return self._eos

    @property
    def executor(self) -> llguidance.LLExecutor:
        return self._executor

    @property
    def llmatcher(self) -> llguidance.LLMatcher:
        return self._matcher

    @property
    def is_finished(self) -> bool:
        """The grammar is complete (or broken): nothing but EOS may follow."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() or None if self._matcher.is_error() else None

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False when the grammar refused it (see the class doc).
        EOS after a complete grammar is accepted."""
        if self._matcher.is_stopped() and token_id in self._eos:
            return True
        return bool(self._matcher.consume_token(token_id))

    def allowed_token_ids(self, vocab_size: int) -> list[int]:
        """The ids allowed next (for tests and debugging; the step path uses `fill_bitmasks`)."""
        from forkpoint.structured.bitmask import unpack_bitmask

        mask = torch.full((1, (vocab_size + 31) // 32), -1, dtype=torch.int32)
        fill_bitmasks([self], mask)
        return unpack_bitmask(mask, vocab_size)[0].nonzero()[:, 0].tolist()


def fill_bitmasks(matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor) -> None:
    """Fill row i of `bitmask` [len(matchers), W] int32 (host, contiguous) with matchers[i]'s
    allowed tokens, all rows in one call on the compiler's threads. A matcher in an error state
    allows only EOS, so a broken sequence ends instead of running on unconstrained."""
    if not matchers:
        return
    if bitmask.device.type != "cpu" or bitmask.dtype != torch.int32 or not bitmask.is_contiguous():
        raise ValueError("bitmask must be a contiguous int32 CPU tensor")
    if bitmask.shape[0] != len(matchers):
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows for {len(matchers)} matchers")
    executor = matchers[0].executor
    pairs = [(m.llmatcher, i) for i, m in enumerate(matchers)]
    executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])
    for i, m in enumerate(matchers):
        if m.llmatcher.is_error():
            bitmask[i].zero_()
            for eos in m.eos_token_ids:
                _set_bit(bitmask[i], eos)


def _set_bit(row: torch.Tensor, token_id: int) -> None:
    """Allow `token_id` in one packed int32 row (bit 31 is the sign bit)."""
    word, bit = divmod(token_id, 32)
    if word < row.shape[0]:
        value = (int(row[word]) & 0xFFFFFFFF) | (1 << bit)
        row[word] = value - (1 << 32) if value >= 1 << 31 else value
