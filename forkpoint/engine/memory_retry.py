"""A step that fails for lack of memory is retried smaller, so one request's memory never fails its
step-mates.

When a step's forward or sampling raises an out-of-memory error (`is_out_of_memory`), the engine
does not fail the step: its sequences go back to the front of the queue to recompute
(`Scheduler.requeue`: the failed forward may have written their state rows) and the next steps are
capped (`StepLimits`). What is capped is what grew the step's memory, not the step's tokens:

- the sequences that computed more than `floor_tokens` (a prefill chunk, scored prompt rows): their
  tokens a step (`max_chunk`, for `StepLimits.chunked`) become a quarter (CHUNK_SHRINK) of the
  largest such share (the memory grows with the chunk: its activations, its attention scores, its
  prompt-logit rows); the step-mates that were decoding are not cut;
- a step of decodes alone (or chunks already at the floor): the sequences of a step (`max_seqs`)
  become half the step's (the memory grows with the rows).

The step's total tokens are not capped: its step-mates' recomputes (their context, computed before)
then run whole in one step beside the culprit's smaller chunk. Capping the total (as before: half
the failed step's tokens, and one sequence half of that) spread them over many steps: a scored
prompt's 64-row chunk beside 8 streams failed (72 tokens), and the streams' 27-token recomputes ran
36 tokens a step, 8 steps, a 0.95 s gap (5.6x their own) on the CPU (docs/server.md). If the retry
step fails too, its recomputes took more than the floor and are capped in turn. Decodes keep running beside a
shrinking prefill. Each further failure lowers a cap again, so the request that needs the memory ends up
alone in the smallest step (a sequence cap of one, at most `floor_tokens` tokens); a step that fails
holding one sequence and at most `floor_tokens` tokens fails that sequence's prompt with
`OutOfMemory`::

    step: 8 decodes + a 4,088-token chunk -> OOM: requeue the 9, one sequence <= 1,022 tokens a step
    step: 8 recomputes + a 1,022-token chunk -> OOM: requeue, <= 255 ... (fits: served)
    step: 64 decodes                      -> OOM: requeue the 64, cap 32 sequences ...
    step: 1 sequence, <= floor tokens     -> OOM: its prompt fails (OutOfMemory), the others run on

A lone sequence's decode (one token) that runs out of memory therefore fails at once: no smaller
step exists for it.

The caps hold until every sequence that was in a failed step has left the engine: lifting them
sooner would run the culprit at full size again, fail again and recompute for ever. Requests that
arrive meanwhile run in the capped steps too (smaller chunks, the same outputs).

Caught: `torch.OutOfMemoryError` (the CUDA caching allocator), Python's `MemoryError` (a host
allocation in Python code) and the RuntimeError of PyTorch's CPU allocator ("DefaultCPUAllocator:
can't allocate memory"). Anything else fails the step as before (engine.py `StepFailed`).
"""

from __future__ import annotations

import sys
from collections import Counter

from forkpoint.engine.request import Request
from forkpoint.engine.step_planning import ScheduledStep, StepLimits

CPU_ALLOCATOR_FAILURE = "DefaultCPUAllocator: can't allocate memory"
# a failed step's largest chunk over the per-sequence cap of the retry: a quarter, not a half, since each
# failure costs the failed step's time and a recompute (8 streams beside a 16k prompt on the CPU: halving
# failed again at 4,092 tokens, 1.3 s more; the earlier rule, a step of half the tokens of which one
# sequence took half, also came to a quarter)
CHUNK_SHRINK = 4


class OutOfMemory(RuntimeError):
    """A prompt ran out of memory with one of its sequences alone in the smallest step: it cannot
    run on this server as it is (the message names the sizes and the fix)."""


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is an allocation failure (see the module doc for the three kinds). The engine
    imports no torch (tests/test_layering.py): its error class is taken from the loaded module, and
    without torch loaded no torch error exists."""
    torch = sys.modules.get("torch")
    if isinstance(error, MemoryError) or (torch is not None and isinstance(error, torch.OutOfMemoryError)):
        return True
    return isinstance(error, RuntimeError) and CPU_ALLOCATOR_FAILURE in str(error)


def step_tokens(step: ScheduledStep) -> int:
    """Tokens the step's forward computes (all its segments)."""
    return sum(segment.end - segment.start for segment in step.plan.segments)


def step_shares(step: ScheduledStep) -> Counter[str]:
    """Tokens each sequence computes in the step (its segments together), by request id."""
    shares: Counter[str] = Counter()
    for segment in step.plan.segments:
        shares[segment.request_id] += segment.end - segment.start
    return shares


class MemoryBackoff:
    """The caps on step size after out-of-memory failures, and the sequences that hold them up.

    floor_tokens: the smallest step the scheduler can plan for a prefill chunk (1, or one scan chunk
    with checkpoint_exact); a lone sequence failing at or below it cannot be helped by a smaller step.
    max_tokens, max_seqs: the configured budgets of a step (max_num_batched_tokens, max_num_seqs)."""

    def __init__(self, floor_tokens: int, max_tokens: int, max_seqs: int) -> None:
        if not 1 <= floor_tokens <= max_tokens or max_seqs < 1:
            raise ValueError(f"need 1 <= floor_tokens <= max_tokens and max_seqs >= 1, got {floor_tokens}, "
                             f"{max_tokens} and {max_seqs}")
        self.floor_tokens = floor_tokens
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs
        self._limits: StepLimits | None = None
        self._suspects: list[Request] = []  # sequences of the failed steps; the caps hold while one is live

    def limits(self) -> StepLimits | None:
        """The caps for the next step (None: none), lifted once every suspect has finished."""
        if self._limits is not None and all(r.is_finished for r in self._suspects):
            self._limits, self._suspects = None, []
        return self._limits

    def culprit(self, steps: list[ScheduledStep]) -> Request | None:
        """The sequence to fail when `steps` (the steps in flight that raised) held it alone in at most
        `floor_tokens` tokens, else None (then `shrink` before retrying)."""
        sequences = list(dict.fromkeys(r for step in steps for r in step.requests))
        if len(sequences) == 1 and max(step_tokens(step) for step in steps) <= self.floor_tokens:
            return sequences[0]
        return None

    def shrink(self, steps: list[ScheduledStep]) -> StepLimits:
        """Lower a cap below `steps` (module doc): the sequences that took more than `floor_tokens` in a
        step (a smaller chunk exists) are capped at a quarter of the largest such share (or join the
        capped ones at the current cap), else halve the sequences (there are two or more: one alone at
        `floor_tokens` or fewer is the culprit), else, a lone sequence above the floor that its chunk
        cap did not bind (a speculative verify), halve the step's tokens. Their sequences hold the caps
        until they leave. Returns the new caps; each call lowers a cap or caps one more sequence, so
        the retries end."""
        sequences = list(dict.fromkeys(r for step in steps for r in step.requests))
        current = self._limits or StepLimits(self.max_tokens, self.max_seqs, self.max_tokens, frozenset())
        max_tokens, max_seqs, max_chunk = current.max_tokens, current.max_seqs, current.max_chunk
        chunked = current.chunked or frozenset()
        shares = Counter()
        for step in steps:
            for request_id, share in step_shares(step).items():
                shares[request_id] = max(shares[request_id], share)
        over = {request_id for request_id, share in shares.items() if share > self.floor_tokens}
        cut = max(self.floor_tokens, max((shares[r] for r in over), default=0) // CHUNK_SHRINK)
        if over and (cut < max_chunk or not over <= chunked):
            max_chunk, chunked = min(max_chunk, cut), chunked | over
        elif len(sequences) > 1:
            max_seqs = min(max_seqs, len(sequences) // 2)
        else:
            max_tokens = min(max_tokens, max(self.floor_tokens, max(step_tokens(step) for step in steps) // 2))
        limits = StepLimits(max_tokens, max_seqs, max_chunk=min(max_chunk, max_tokens), chunked=chunked)
        self._limits = limits
        self._suspects = [r for r in self._suspects if not r.is_finished]
        self._suspects += [r for r in sequences if r not in self._suspects]
        return limits

    def describe(self, culprit: Request, error: BaseException) -> OutOfMemory:
        """The error its prompt fails with: the memory, the sizes, the fix."""
        tokens = len(culprit.prompt_token_ids) + len(culprit.output_token_ids)
        scoring = (f", scoring its prompt (prompt_logprobs={culprit.params.prompt_logprobs})"
                   if culprit.params.prompt_logprobs is not None else "")
        return OutOfMemory(
            f"request {culprit.parent_id!r} ran out of memory running alone in a step of at most "
            f"{self.floor_tokens} token(s) ({tokens} tokens so far{scoring}; {type(error).__name__}: {error}): "
            "it cannot run on this server; send a shorter prompt, fewer sequences (n) or fewer logprobs")
