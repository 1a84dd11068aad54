"""The distribution a sampled row is drawn from and the draw itself (runner/sampler.py's random rows).

    logits [S, V] --sampling_weights--> weights [S, W]: exp(l / T - max), zero outside the kept set
                                        of min-p / top-k / top-p, W = V padded to whole blocks
                  --draw--------------> [S] token ids: two-level exponential race

A block is `block_size(V)` tokens (the power of two at or above sqrt(V)): a row draws one Exp(1)
per block, then one per token of the chosen block, from its own generator when it has one, so a
seeded row's tokens depend on nothing else in its batch. On CPU the rows go through in chunks of
`chunk_rows` (cache-sized temporaries) and top-p finds its set with `topk` bounds that grow 8x; on
CUDA all rows at once and top-p sorts (no host round trip).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from forkpoint.sampling_params import SamplingParams

CHUNK_BYTES = 1 << 24  # CPU: logits rows sampled together (`chunk_rows`)
EXP_FLOOR = -87.0  # l / T - max below this counts as this (`sampling_weights`): exp stays a normal float32


def on_device(device: torch.device, values: Sequence, dtype: torch.dtype) -> torch.Tensor:
    """`values` as a tensor on `device`, copied without a host synchronisation (`torch.tensor(...,
    device=cuda)` would wait for the queued forward)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def chunk_rows(num_rows: int, vocab: int, device: torch.device) -> int:
    """Rows sampled together, of `num_rows`: on CPU about `CHUNK_BYTES` of float32 logits (16 rows
    of a 248k vocabulary), elsewhere all. 128 temperature rows on 2 shared cores
    (bench/sampler_cost.py --chunk-mib): at load ~1.2, 4 MiB chunks 30.5 ms, 16 MiB 24.6-40.9 ms, all
    at once 90.7 ms (a temporary over glibc's 32 MiB mmap ceiling faults in fresh pages); at load
    ~2.8, 1,530, 448 and 179 ms, as every parallel op waits ~8 ms for its second thread and fewer,
    larger ops win. 16 MiB keeps the temporaries under the ceiling with a quarter of 4 MiB's ops."""
    if device.type != "cpu":
        return max(1, num_rows)
    return max(1, min(num_rows, CHUNK_BYTES // (4 * vocab)))


def block_size(vocab: int) -> int:
    """Tokens per block of the two-level race: the power of two at or above sqrt(vocab), so a row
    draws about 2 sqrt(vocab) exponentials (248,320 tokens: blocks of 512, 485 blocks)."""
    return 1 << math.ceil(math.log2(max(vocab, 2)) / 2)


def sampling_weights(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits: [S, V] (penalised) -> [S, W] float32 unnormalised weights the rows are sampled from,
    W = V padded to whole blocks (`block_size`) with zeros: exp(l / T - max), zero outside the kept
    set of vLLM's filters, all of them thresholds in one ordering (no full-vocabulary sort on CPU):

        min-p   keep l / T >= max + log(min_p)                (probability >= min_p x the largest)
        top-k   keep l / T >= the k-th largest                (ties kept)
        top-p   keep weight >= the weight at which the descending mass first reaches top_p x the
                mass left by min-p and top-k                  (the smallest such set; ties kept)

    Every row keeps its largest token. A kept weight is at least e^EXP_FLOOR (1.6e-38 of the
    largest; the whole vocabulary's excess under 4e-33 of the mass): the CPU's exp takes a slow path
    for a result below float32's normal range (measured with torch 2.13: 12x for 0, 27x for a denormal).
    """
    rows, vocab = logits.shape
    device, dtype = logits.device, logits.dtype
    temperature = on_device(device, [p.temperature for p in params], dtype)[:, None]
    pad = -vocab % block_size(vocab)
    scaled = (logits / temperature) if not pad else F.pad(logits, (0, pad), value=float("-inf")).div_(temperature)
    top = scaled.amax(dim=-1, keepdim=True)
    floor = None
    if any(p.min_p > 0.0 for p in params):
        floor = top + torch.log(on_device(device, [p.min_p for p in params], dtype))[:, None]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if any(k < vocab for k in top_k):
        bound = max(k for k in top_k if k < vocab)
        kth = scaled.topk(bound, dim=-1).values.gather(1, on_device(device, [min(k, bound) - 1 for k in top_k],
                                                               torch.long)[:, None])
        kth = kth.masked_fill(on_device(device, [k == vocab for k in top_k], torch.bool)[:, None], float("-inf"))
        floor = kth if floor is None else torch.maximum(floor, kth)
    dropped = scaled < floor if floor is not None else None
    weights = scaled.sub_(top).clamp_(min=EXP_FLOOR).exp_()
    if dropped is not None:
        weights = torch.where(dropped, 0.0, weights)
    if pad:
        weights[:, vocab:] = 0.0
    if any(p.top_p < 1.0 for p in params):
        _top_p(weights, [p.top_p for p in params])
    return weights


def _top_p(weights: torch.Tensor, top_p: Sequence[float]) -> None:
    """Zero, in place, the weights [S, W] outside each row's top-p set (`sampling_weights`). The
    descending weights come from a full sort on CUDA (no host round trip) and on CPU from `topk` with
    a bound that grows 8x until every row's mass is reached (host checks cost nothing there): the
    same values and the same sequential cumulative sums as the sort's first entries."""
    device, dtype = weights.device, weights.dtype
    width = weights.shape[1]
    keep_all = on_device(device, [p >= 1.0 for p in top_p], torch.bool)[:, None]
    target = on_device(device, list(top_p), dtype)[:, None] * block_masses(weights).sum(dim=-1, keepdim=True)
    bound = width if device.type != "cpu" else min(width, 256)
    while True:
        if bound == width:
            ordered = weights.sort(dim=-1, descending=True).values
        else:
            ordered = weights.topk(bound, dim=-1).values
        before = (ordered.cumsum(dim=-1) < target).sum(dim=-1, keepdim=True)  # entries before the mass is reached
        if bound == width or bool((before < bound).logical_or(keep_all).all()):
            break
        bound = min(width, bound * 8)
    cut = ordered.gather(1, before.clamp_(max=bound - 1)).masked_fill_(keep_all, 0.0)
    weights.copy_(torch.where(weights < cut, 0.0, weights))


def block_masses(weights: torch.Tensor) -> torch.Tensor:
    """weights: [S, W] (W whole blocks) -> [S, W / block] the mass of each block (float32: relative
    error ~1e-7, each block summed alone in the same order whatever the batch)."""
    rows, width = weights.shape
    return weights.view(rows, -1, block_size(width)).sum(dim=-1)


def draw(weights: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """weights: [S, W] unnormalised (W whole blocks, `sampling_weights`) -> [S] long, token t with
    probability weights[t] / sum, by a two-level exponential race: the block argmax(mass / q) with
    q ~ Exp(1) per block, then within it the token argmax(weight / q') with q' ~ Exp(1) per token:
    P(block) x P(token | block) = weight / sum, from 2 sqrt(V) draws instead of V. A row with a
    generator draws only from it (its block draws, then its token draws); the others from the
    default generator."""
    rows, width = weights.shape
    block = block_size(width)
    if width % block:
        raise ValueError(f"{width} weights a row: not whole blocks of {block} (pad them as sampling_weights does)")
    blocks = weights.view(rows, -1, block)
    chosen = block_masses(weights).div_(_exponentials(rows, width // block, generators, weights)).argmax(dim=-1)
    inner = blocks[torch.arange(rows, device=weights.device), chosen]
    return chosen * block + inner.div_(_exponentials(rows, block, generators, weights)).argmax(dim=-1)


def _exponentials(rows: int, count: int, generators: Sequence[torch.Generator | None],
                  like: torch.Tensor) -> torch.Tensor:
    """[rows, count] Exp(1) draws, row r from generators[r] (the default one where None), kept
    above zero (an exact 0 would divide a zero mass into NaN)."""
    out = torch.empty(rows, count, dtype=like.dtype, device=like.device)
    if any(g is None for g in generators):
        out.exponential_()
    for row, generator in enumerate(generators):
        if generator is not None:
            out[row].exponential_(generator=generator)
    return out.clamp_(min=torch.finfo(like.dtype).tiny)


def sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits: [S, V] (penalised) -> [S, V] float probabilities the rows are sampled from (the
    normalised `sampling_weights`). Rejection sampling (runner/speculative.py) reads them."""
    weights = sampling_weights(logits, params)[:, : logits.shape[1]]
    return weights / weights.sum(dim=-1, keepdim=True)
