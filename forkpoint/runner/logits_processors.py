"""Logits processors with vLLM's semantics: logit_bias, allowed_token_ids, bad_words, min_tokens and
structured-output grammars, applied in place to a step's logits before penalties and sampling.

Per request, `build_request_processors` (called once when the request is added) turns the
SamplingParams into token ids checked against the vocabulary and, for structured outputs, a
grammar matcher. Per step, `apply_logits_processors` gathers the rows' ids on the host into a few
index tensors and edits the logits with a fixed number of device ops, whatever R is:

    1. logit_bias          logits[r, t] += b                              (one index_put_, accumulate)
    2. grammar             -inf where the row's bitmask disallows t       (one bitmask copy host->device)
    3. allowed_token_ids   -inf outside the row's allowed set             (one scatter into a keep mask)
    4. bad_words,          -inf at each bad word's last token when the output ends with its other
       min_tokens          tokens; -inf at EOS / stop_token_ids while fewer than min_tokens are out

The grammar is a hard constraint; 3 and 4 are soft, in that order: in a row where one would leave
no token at all (e.g. min_tokens while the grammar allows only EOS), that row keeps what the steps
before left, so the sampler never sees a row of -inf. Nothing is copied device->host.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from transformers import PreTrainedTokenizerBase

from forkpoint.sampling_params import SamplingParams
from forkpoint.structured import (
    GrammarCompiler,
    GrammarMatcher,
    apply_bitmask_,
    fill_bitmasks,
)


@dataclass
class RequestProcessors:
    """One sequence's processor state (token ids checked against the vocabulary).

    bias: {token id: bias}; allowed: allowed ids (None: all); bad_words: token-id sequences never to
    complete; min_tokens and stop_ids: ids masked while fewer than min_tokens tokens are out (EOS
    unless ignore_eos, plus stop_token_ids); matcher: the grammar state (None: unconstrained).
    `release()` drops the matcher; the engine calls it when the sequence leaves.
    """

    bias: dict[int, float]
    allowed: list[int] | None
    bad_words: tuple[tuple[int, ...], ...]
    min_tokens: int
    stop_ids: tuple[int, ...]
    matcher: GrammarMatcher | None

    @property
    def needs_output_tokens(self) -> bool:
        """Whether a step's masks depend on the values of the tokens output so far (the grammar, bad
        words), not only on their number: then the step before must have reached the host."""
        return self.matcher is not None or bool(self.bad_words)

    def accept(self, token_id: int) -> None:
        """Advance the grammar by the sampled token (no-op without a grammar)."""
        if self.matcher is not None:
            self.matcher.accept(token_id)

    def release(self) -> None:
        self.matcher = None


class ProcessorRow(NamedTuple):
    """One logits row's processors: its state, the output token ids so far on the host, and how many
    further output tokens are sampled but still on the device (asynchronous scheduling; only rows
    whose state does not `needs_output_tokens` may have any)."""

    state: RequestProcessors
    output: Sequence[int]
    num_unseen: int = 0


def build_request_processors(params: SamplingParams, *, tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                             eos_token_ids: Iterable[int], grammars: GrammarCompiler) -> RequestProcessors | None:
    """The processor state of one sequence, or None when `params` asks for no processor.
    Raises ValueError naming the field when a token id is outside the vocabulary or the grammar
    does not compile."""
    if not params.has_logits_processors:
        return None
    bias = dict(params.logit_bias or {})
    _check_ids("logit_bias", bias, vocab_size)
    allowed = sorted(set(params.allowed_token_ids)) if params.allowed_token_ids else None
    if allowed is not None:
        _check_ids("allowed_token_ids", allowed, vocab_size)
    stop_ids: tuple[int, ...] = ()
    if params.min_tokens:
        ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        stop_ids = tuple(sorted(i for i in ids if i < vocab_size))
    matcher = grammars.matcher(params.structured_outputs) if params.structured_outputs is not None else None
    return RequestProcessors(bias, allowed, bad_words_token_ids(params.bad_words or [], tokenizer),
                             params.min_tokens, stop_ids, matcher)


def bad_words_token_ids(words: Sequence[str], tokenizer: PreTrainedTokenizerBase) -> tuple[tuple[int, ...], ...]:
    """vLLM's tokenisation of bad words: each word as written (leading space stripped) and with one
    leading space, the latter kept only when it tokenises to as many tokens with a different first
    token (so "  foo" and "foo" at the start of a word are both blocked)."""
    result: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        result.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            result.append(spaced)
    return tuple(r for r in result if r)


def apply_logits_processors(logits: torch.Tensor, rows: Sequence[ProcessorRow | tuple | None]) -> None:
    """Edit logits [R, V] float32 in place for the rows that have processors (see the module doc).
    rows[r]: `ProcessorRow` (or a plain (state, output ids) tuple) of row r, or None for an
    unconstrained row."""
    if len(rows) != logits.shape[0]:
        raise ValueError(f"{len(rows)} processor rows for {logits.shape[0]} logits rows")
    active = [(r, ProcessorRow(*row)) for r, row in enumerate(rows) if row is not None]
    if not active:
        return
    for _, row in active:
        if row.num_unseen and row.state.needs_output_tokens:
            raise ValueError("a grammar or bad_words row needs its output tokens on the host: sample it "
                             "after the step before has reached the host")
    device, vocab = logits.device, logits.shape[1]
    bias_rows, bias_ids, bias_values = [], [], []
    grammar_rows, matchers = [], []
    for r, (state, _, _) in active:
        for token, value in state.bias.items():
            bias_rows.append(r)
            bias_ids.append(token)
            bias_values.append(value)
        if state.matcher is not None:
            grammar_rows.append(r)
            matchers.append(state.matcher)
    if bias_rows:
        logits.index_put_((_long(bias_rows, device), _long(bias_ids, device)),
                          torch.tensor(bias_values, dtype=logits.dtype, device=device), accumulate=True)
    if matchers:
        bitmask = torch.empty((len(matchers), (vocab + 31) // 32), dtype=torch.int32,
                              pin_memory=device.type == "cuda")
        fill_bitmasks(matchers, bitmask)
        apply_bitmask_(logits, _long(grammar_rows, device), bitmask)
    _apply_soft_masks(logits, active)


def _apply_soft_masks(logits: torch.Tensor, active: list[tuple[int, ProcessorRow]]) -> None:
    """allowed_token_ids, then bad_words and min_tokens, each undone in the rows it would leave empty."""
    device = logits.device
    allow_rows, allow_ids, ban_rows, ban_ids = [], [], [], []
    for r, (state, output, unseen) in active:
        if state.allowed is not None:
            allow_rows.extend([r] * len(state.allowed))
            allow_ids.extend(state.allowed)
        banned = _banned_ids(state, output, len(output) + unseen)
        ban_rows.extend([r] * len(banned))
        ban_ids.extend(banned)
    if allow_rows:
        local = {r: i for i, r in enumerate(sorted(set(allow_rows)))}  # row -> row of `keep`
        keep = torch.zeros((len(local), logits.shape[1]), dtype=torch.bool, device=device)
        keep.index_put_((_long([local[r] for r in allow_rows], device), _long(allow_ids, device)),
                        torch.tensor(True, device=device))
        rows = _long(list(local), device)
        _replace_unless_empty(logits, rows, logits.index_select(0, rows).masked_fill(~keep, float("-inf")))
    if ban_rows:
        local = {r: i for i, r in enumerate(sorted(set(ban_rows)))}
        rows = _long(list(local), device)
        banned = logits.index_select(0, rows)
        banned.index_put_((_long([local[r] for r in ban_rows], device), _long(ban_ids, device)),
                          torch.tensor(float("-inf"), dtype=logits.dtype, device=device))
        _replace_unless_empty(logits, rows, banned)


def _replace_unless_empty(logits: torch.Tensor, rows: torch.Tensor, masked: torch.Tensor) -> None:
    """logits[rows] = masked, except in rows where `masked` is all -inf (those keep their logits)."""
    empty = torch.isneginf(masked).all(dim=1, keepdim=True)
    logits.index_copy_(0, rows, torch.where(empty, logits.index_select(0, rows), masked))


def _banned_ids(state: RequestProcessors, output: Sequence[int], num_output: int) -> list[int]:
    """Ids banned for the next token of this row (`num_output` tokens out, the last of them
    `output`): bad words' completions and, below min_tokens, the stop ids."""
    banned = list(state.stop_ids) if num_output < state.min_tokens else []
    for word in state.bad_words:
        prefix = word[:-1]
        if len(output) >= len(prefix) and (not prefix or tuple(output[len(output) - len(prefix):]) == prefix):
            banned.append(word[-1])
    return banned


def _check_ids(field: str, ids: Iterable[int], vocab_size: int) -> None:
    bad = sorted(i for i in ids if i >= vocab_size)
    if bad:
        raise ValueError(f"{field} has token ids outside the vocabulary (size {vocab_size}): {bad[:8]}")


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)
