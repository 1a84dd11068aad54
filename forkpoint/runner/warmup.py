"""Start-up warm-up: synthetic steps on the pools' scratch rows, so serving never compiles.

The token-wise pieces and the decode steps are compiled when their graphs are captured. What is
left are the varlen cores of prefill and mixed steps (conv, fla's chunked gated delta rule, paged
attention's autotuned prefill tiles), whose Triton kernels compile (and, for attention, autotune)
per *variant*: Triton specialises integer arguments on == 1 and on divisibility by 16 and pointers
on 16-byte alignment, and the autotuner keys on the GQA group, head dim and short/long query
segments. Which variant a step needs depends on its token counts and segment layout, so a served
step of a new layout used to compile in the middle of a run (the seed's shape: a 3.1 s step).

`warm_up` runs a fixed, seeded mix of synthetic steps through `ModelRunner.forward`: one segment
and many, one recurrent phase and two, with and without decodes before them, short and long query
segments, token counts odd, even and multiples of 16, contexts of none to several blocks, up to the
largest step the runner takes. Every synthetic token reads and writes only scratch rows: KV slots of
`BlockPool.scratch_block` (every block-table entry is that block), recurrent states from the zero
row (read only) or `StatePool.scratch_slot`, final states into the scratch slot. So no request's
KV or state row, nor the zero row, changes (tests/runner/test_warmup.py checks that on CPU), and
the scratch rows' content stays meaningless but finite.

Not covered, by design: steps above the largest graph bucket run the model's plain forward (its
token-wise kernels compile for new row counts; those steps exist only when max_num_batched_tokens
is above 8192).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from forkpoint.cache.state_pool import ZERO_SLOT
from forkpoint.step.batch import AttentionMetadata, DecodeGroup, ForwardBatch, RecurrentPhase

WARMUP_MAX_CONTEXT = 4096


def warmup_max_context(max_position_embeddings: int, max_tokens: int) -> int:
    """The longest cached context a synthetic segment starts after: synthetic contexts live in the
    scratch block (every table entry), so only the model's context length bounds them."""
    return min(WARMUP_MAX_CONTEXT, max_position_embeddings - max_tokens)


@dataclass(frozen=True)
class SyntheticSegment:
    """One synthetic segment: `q_len` new tokens after `context` cached ones, in recurrent phase
    `phase` (-1: a decode, q_len 1)."""

    q_len: int
    context: int
    phase: int


@dataclass(frozen=True)
class WarmupReport:
    steps: int
    tokens: int
    seconds: float


def synthetic_batch(segments: list[SyntheticSegment], *, vocab_size: int, block_size: int, scratch_block: int,
                    scratch_slot: int, device: torch.device, seed: int = 0) -> ForwardBatch:
    """A ForwardBatch of `segments` (decodes first, then by phase) on the scratch rows only.

    Token ids are seeded random; block tables are [N, ceil(max kv len / block_size)] of
    `scratch_block`; decodes and phase segments start from the zero row (phase 0) or the scratch
    slot (decodes, later phases) and write their final states into the scratch slot."""
    segments = sorted(segments, key=lambda s: s.phase)
    rng = np.random.default_rng(seed)
    lengths = np.array([s.q_len for s in segments], dtype=np.int64)
    cu_q = np.concatenate([[0], np.cumsum(lengths)])
    num_tokens = int(cu_q[-1])
    positions = np.concatenate([np.arange(s.context, s.context + s.q_len) for s in segments])
    seq_lens = np.array([s.context + s.q_len for s in segments], dtype=np.int64)
    width = int(-(-seq_lens.max() // block_size))

    def long(values) -> torch.Tensor:
        return torch.as_tensor(np.asarray(values, dtype=np.int64), device=device)

    num_decodes = sum(1 for s in segments if s.phase < 0)
    phases = []
    first = num_decodes
    while first < len(segments):
        last = first
        while last < len(segments) and segments[last].phase == segments[first].phase:
            last += 1
        cu = cu_q[first: last + 1] - cu_q[first]
        initial = ZERO_SLOT if segments[first].phase == 0 else scratch_slot
        phases.append(RecurrentPhase(
            token_start=int(cu_q[first]), token_end=int(cu_q[last]), cu_seqlens=long(cu),
            cu_seqlens_host=tuple(int(v) for v in cu), initial_slots=long([initial] * (last - first)),
            dest_rows=long(np.arange(last - first)), dest_slots=long([scratch_slot] * (last - first))))
        first = last
    attention = AttentionMetadata(
        slot_mapping=long(scratch_block * block_size + positions % block_size),
        block_tables=torch.full((len(segments), width), scratch_block, dtype=torch.int32, device=device),
        cu_seqlens_q=long(cu_q), cu_seqlens_q_host=tuple(int(v) for v in cu_q),
        seq_lens=long(seq_lens), seq_lens_host=tuple(int(v) for v in seq_lens),
        cow_src=long([]), cow_dst=long([]))
    return ForwardBatch(
        input_ids=long(rng.integers(0, vocab_size, num_tokens)), positions=long(positions),
        decode=DecodeGroup(num_decodes, long([scratch_slot] * num_decodes)) if num_decodes else None,
        phases=tuple(phases), attention=attention, logits_indices=long(cu_q[1:] - 1))


def warmup_layouts(max_tokens: int, max_seqs: int, max_context: int, block_size: int, *, seed: int = 0,
                   random_steps: int = 24) -> list[list[SyntheticSegment]]:
    """The step layouts of the warm-up: two representative ones first (for the autotuners), fixed
    edge cases, then `random_steps` seeded random ones.

    Every layout has at most `max_tokens` tokens and `max_seqs` segments, contexts below
    `max_context` (a block multiple apart, and not)."""
    max_context = max(0, max_context)
    # First, for the autotuners: Triton's (paged attention's prefill tiles) and fla's pick a config
    # on the first call of each key and keep it, so the first call must look like the steps that
    # dominate serving time, not a toy one. A full step of two long prefills, one after a long
    # cached prefix (consumers of a checkpoint), tunes fla's chunked kernels and the long-query
    # attention tiles; then short query segments after long contexts next to decodes tune the
    # short-query tiles. (On 35B-A3B, with toy steps first -- 1, 2, 3, ... 17 tokens -- the
    # 8192-token step's attention took 26.0 ms and fla's kernels 23.3 ms, against 11.5 and 15.5 ms
    # in the run before, whose first prefill was a 4,352-token prompt: docs/e2e_h200.md.)
    half = max(1, max_tokens // 2) if max_seqs > 1 else max_tokens
    layouts: list[list[SyntheticSegment]] = [
        [SyntheticSegment(half, 0, 0)] + ([SyntheticSegment(max_tokens - half, max_context, 0)]
                                          if max_tokens > half else []),
        [SyntheticSegment(1, max_context, -1) for _ in range(min(max_seqs - 1, 32, max(max_tokens - 16, 0)))]
        + [SyntheticSegment(min(16, max_tokens), max_context, 0)],
    ]
    # the widest two-phase step: a producer's prefix, then as many consumer segments after it as the
    # step takes, splitting the rest of the tokens. Its per-segment buffers (gathered initial states
    # and final states of every recurrent layer, [segments, H, K, V] fp32 each) are the largest a
    # step allocates: first met while serving, growing the allocator's and the core graph's pools
    # took one such step 3.99x its fitted time (35B-A3B, 256 consumers of 32 tokens; docs/e2e_h200.md)
    if max_seqs > 2 and max_tokens > max_seqs:
        producer = min(64, max_tokens - (max_seqs - 1))
        share = (max_tokens - producer) // (max_seqs - 1)
        layouts.append([SyntheticSegment(producer, 0, 0)]
                       + [SyntheticSegment(share, min(max_context, producer), 1) for _ in range(max_seqs - 1)])
    # single segments of lengths around the integer specialisations (1, odd, multiples of 16), up to
    # the largest step; short ones below and above the attention's short/long autotune split (16)
    for q_len in sorted({1, 2, 3, 7, 16, 17, 63, 64, 65, 200, 256, max_tokens // 2 + 1, max_tokens}):
        if q_len <= max_tokens:
            layouts.append([SyntheticSegment(q_len, 0, 0)])
    rng = np.random.default_rng(seed)
    for index in range(random_steps):
        budget = max_tokens if index % 3 else int(rng.integers(1, max(2, max_tokens // 8)))
        segments: list[SyntheticSegment] = []
        num_decodes = int(rng.integers(0, min(max_seqs, 64) + 1)) if index % 2 else 0
        segments += [SyntheticSegment(1, int(rng.integers(0, max_context + 1)), -1) for _ in range(num_decodes)]
        budget -= num_decodes
        num_phases = 1 + (index % 4 == 1 or index % 4 == 2)
        for phase in range(num_phases):
            for _ in range(int(rng.integers(1, 6))):
                if budget < 1 or len(segments) >= max_seqs:
                    break
                q_len = int(min(budget, np.exp(rng.uniform(0, np.log(max(budget, 1) + 1)))))
                q_len = max(1, q_len)
                context = 0 if phase == 0 and rng.random() < 0.5 else int(rng.integers(0, max_context + 1))
                if rng.random() < 0.3:
                    context -= context % block_size
                segments.append(SyntheticSegment(q_len, context, phase))
                budget -= q_len
        if any(s.phase >= 0 for s in segments):
            layouts.append(segments)
    return layouts


def warm_up(runner, *, max_tokens: int, max_seqs: int, max_context: int, seed: int = 0,
            random_steps: int = 24) -> WarmupReport:
    """Run `warmup_layouts(...)` through `runner.forward` on the scratch rows (module docstring).
    runner: a ModelRunner; max_tokens / max_seqs: the largest step and the most sequences it takes;
    max_context: the longest cached context a synthetic segment starts after."""
    model = runner.model
    block_size = runner.block_size
    scratch_block, scratch_slot = runner.scratch_block, runner.scratch_slot
    start = time.perf_counter()
    steps = tokens = 0
    for index, layout in enumerate(warmup_layouts(max_tokens, max_seqs, max_context, block_size, seed=seed,
                                                  random_steps=random_steps)):
        batch = synthetic_batch(layout, vocab_size=model.config.vocab_size, block_size=block_size,
                                scratch_block=scratch_block, scratch_slot=scratch_slot, device=runner.device,
                                seed=seed + index)
        runner.forward(batch)
        steps += 1
        tokens += batch.num_tokens
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return WarmupReport(steps, tokens, time.perf_counter() - start)
