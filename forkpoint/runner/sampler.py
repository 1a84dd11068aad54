"""Token sampling, the rows of a step vectorised on the device (on CPU in chunks of a few rows), one
host copy per step.

vLLM's semantics throughout:

    raw logits [R, V] ----------------------------------------------> logprobs (log_softmax, top-k, rank)
        | (logits processors: the single call site in `Sampler.sample`)
        v
    penalties (repetition, then frequency and presence; counts kept on the device per request)
        |-- greedy rows: argmax
        v
    / temperature -> min-p, top-k (ties kept), top-p (smallest set whose mass reaches p, ties
    kept): thresholds, `sampling_weights` -> weights exp(l / T - max), zero outside the kept set
        v
    two-level exponential race (`draw`): a block of sqrt(V) tokens by argmax(block mass / q), then
    a token in it by argmax(weight / q'), q, q' ~ Exp(1) from the row's generator

The race draws 2 sqrt(V) exponentials a row, not V (one per token: 3.5 ms a row of a 248k vocabulary
on a CPU core, bench/sampler_cost.py), and no filter sorts the vocabulary on CPU (`topk` bounds).

Log-probabilities are those of the model's unmodified distribution (vLLM's default "raw" mode):
the sampled token's and the top-k alternatives'. Everything the host needs (chosen ids, and for
rows that ask, their logprobs, ranks and top-k) is packed into one float64 tensor (ids are exact
below 2**53, float32 values exact in float64) and copied once. `Sampler.sample_async` only enqueues
that copy: its `PendingSample` holds the chosen ids on the device (the next step's inputs under
asynchronous scheduling) until `result()` waits for the host copy.

`Sampler` owns the per-request penalty state across steps (`PenaltyCounts`); `reference_sample`
is the plain per-row spec the tests compare it with.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from forkpoint.outputs import Logprob
from forkpoint.runner.logits_processors import ProcessorRow, RequestProcessors, apply_logits_processors
from forkpoint.runner.random_draw import EXP_FLOOR, block_size, chunk_rows, draw, on_device, sampling_weights
from forkpoint.runner.random_draw import sampling_probs as sampling_probs  # read by runner/speculative.py
from forkpoint.sampling_params import SamplingParams
from forkpoint.step.result import SampledToken


@dataclass(frozen=True)
class SamplingRow:
    """One logits row of a step: whose it is and how to sample it.

    key: the sequence's request id (keys its penalty state across steps); prompt_token_ids /
    output_token_ids: its tokens so far (read only to build penalty state, once per request);
    processors: its logits-processor state (runner/logits_processors.py), None without any;
    num_unseen: output tokens already sampled on the device that `output_token_ids` lacks (a step
    scheduled while the step before was running: asynchronous scheduling).
    """

    key: str
    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    processors: RequestProcessors | None = None
    num_unseen: int = 0


class PenaltyCounts:
    """Per-request token statistics on the device for the rows with penalties.

    counts: [capacity, V] int32, times each token was generated; seen: [capacity, V] bool, tokens
    of the prompt. A request gets a row the first time it is sampled with penalties (built from its
    history: one host-to-device copy per request), then each sampled token is added on the device.
    Invariant: `rows` keys are live requests (the owner calls `free` when one ends), and
    `counted[key] == len(output_token_ids) + num_unseen` when a row is sampled (else the row is
    rebuilt from the host's tokens, which needs num_unseen == 0).
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self.rows: dict[str, int] = {}
        self.counted: dict[str, int] = {}
        self._free_rows: list[int] = []

    def __len__(self) -> int:
        return len(self.rows)

    def row_indices(self, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Rows of `rows` in the state (allocated or rebuilt when stale), as a device index."""
        indices = []
        for row in rows:
            index = self.rows.get(row.key)
            stale = index is None or self.counted[row.key] != len(row.output_token_ids) + row.num_unseen
            if stale and row.num_unseen:
                raise RuntimeError(f"penalty counts of {row.key} are stale and {row.num_unseen} of its output "
                                   "tokens are still on the device: sample it synchronously")
            if index is None:
                index = self._allocate(row.key)
            if stale:
                self._build(index, row)
            indices.append(index)
        return on_device(self.device, indices, torch.long)

    def record(self, keys: Sequence[str], indices: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count the sampled `token_ids` ([len(keys)] on the device) for these rows."""
        flat = indices * self.vocab_size + token_ids
        self.counts.view(-1).index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        for key in keys:
            self.counted[key] += 1

    def free(self, key: str) -> None:
        """Forget a finished or aborted request (unknown keys are ignored)."""
        index = self.rows.pop(key, None)
        if index is not None:
            del self.counted[key]
            self._free_rows.append(index)

    def check_integrity(self, live_keys: set[str]) -> None:
        """Every row belongs to a live request and rows are unique; raises AssertionError."""
        leaked = set(self.rows) - live_keys
        if leaked:
            raise AssertionError(f"penalty state kept for requests that have ended: {sorted(leaked)[:5]}")
        used = list(self.rows.values())
        if len(set(used)) != len(used) or set(used) & set(self._free_rows):
            raise AssertionError("a penalty row has two owners")
        if len(used) + len(self._free_rows) != self.counts.shape[0]:
            raise AssertionError("penalty rows leaked")

    def _allocate(self, key: str) -> int:
        if not self._free_rows:
            old = self.counts.shape[0]
            grown = max(4, 2 * old)
            counts = torch.zeros(grown, self.vocab_size, dtype=torch.int32, device=self.device)
            seen = torch.zeros(grown, self.vocab_size, dtype=torch.bool, device=self.device)
            counts[:old] = self.counts
            seen[:old] = self.seen
            self.counts, self.seen = counts, seen
            self._free_rows.extend(range(grown - 1, old - 1, -1))
        index = self._free_rows.pop()
        self.rows[key] = index
        return index

    def _build(self, index: int, row: SamplingRow) -> None:
        vocab = self.vocab_size
        prompt = torch.tensor([t for t in row.prompt_token_ids if t < vocab], dtype=torch.long)
        output = torch.tensor([t for t in row.output_token_ids if t < vocab], dtype=torch.long)
        self.seen[index] = False
        self.seen[index, prompt.to(self.device, non_blocking=True)] = True
        self.counts[index] = torch.bincount(output, minlength=vocab).to(self.device, torch.int32, non_blocking=True)
        self.counted[row.key] = len(row.output_token_ids)


class Sampler:
    """The runner's sampler (runner/step_sampler.py). It keeps per-request penalty counts across
    steps: its owner calls `free(request_id)` whenever a sequence finishes or is aborted, and
    `check_integrity(live ids)`."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.penalties = PenaltyCounts(vocab_size, device)

    def free(self, key: str) -> None:
        self.penalties.free(key)

    def check_integrity(self, live_keys: set[str]) -> None:
        self.penalties.check_integrity(live_keys)

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampledToken]:
        """logits: [R, V] float32 (one row per entry of `rows`) -> one token per row."""
        return self.sample_async(logits, rows).result()

    def sample_async(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> PendingSample:
        """As `sample`, but returns once the work is enqueued: the chosen ids stay on the device and
        the copy to the host is in flight (`PendingSample.result()` waits for it). Greedy rows without
        penalties or processors: one argmax; the others in chunks of `chunk_rows` (all at once on CUDA),
        a row's result independent of its chunk."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(rows)} sampling rows")
        params = [row.params for row in rows]
        if not rows:
            empty = torch.zeros(0, dtype=torch.long, device=logits.device)
            return PendingSample(empty, empty, params, 0)
        device = logits.device
        penalised = [i for i, p in enumerate(params) if p.has_penalties]
        state_rows = self.penalties.row_indices([rows[i] for i in penalised]) if penalised else None
        # rows beyond a plain argmax (one op for all of them: under load each op costs a thread wake-up)
        work = [i for i, row in enumerate(rows)
                if not row.params.greedy or row.params.has_penalties or row.processors is not None]
        chosen = logits.argmax(dim=-1) if len(work) < len(rows) else torch.empty(len(rows), dtype=torch.long,
                                                                                     device=device)
        step = chunk_rows(len(work), logits.shape[1], device)
        for start in range(0, len(work), step):
            part = work[start: start + step]
            index = on_device(device, part, torch.long)
            scores = logits.index_select(0, index)
            if any(rows[i].processors is not None for i in part):  # logit_bias ... grammar
                apply_logits_processors(scores, [ProcessorRow(rows[i].processors, rows[i].output_token_ids,
                                                              rows[i].num_unseen)
                                                 if rows[i].processors is not None else None for i in part])
            first, last = bisect_left(penalised, part[0]), bisect_left(penalised, part[-1] + 1)
            if last > first:
                scores = self._with_penalties(scores, [part.index(i) for i in penalised[first:last]],
                                              [params[i] for i in part], state_rows[first:last])
            chosen.index_copy_(0, index, _choose(scores, [params[i] for i in part], [rows[i].generator for i in part]))
        if state_rows is not None:
            self.penalties.record([rows[i].key for i in penalised], state_rows,
                                  chosen.index_select(0, on_device(device, penalised, torch.long)))
        packed, k = _pack(logits, chosen, params)
        return PendingSample(chosen, packed, params, k)

    def _with_penalties(self, scores: torch.Tensor, local: list[int], params: Sequence[SamplingParams],
                        state_rows: torch.Tensor) -> torch.Tensor:
        """scores: [C, V], one chunk's own copy, penalised in place (and returned); local: its
        penalised rows; state_rows: their rows of the penalty state."""
        index = on_device(scores.device, local, torch.long)
        counts = self.penalties.counts.index_select(0, state_rows)
        seen = self.penalties.seen.index_select(0, state_rows) | (counts > 0)
        return scores.index_copy_(0, index, _penalise(scores.index_select(0, index), [params[i] for i in local],
                                                      counts, seen))


class PendingSample:
    """A step's sampled tokens on their way to the host.

    token_ids: [R] long on the device (usable at once by later device work); packed: `_pack`'s
    tensor, whose copy to the host starts here (CUDA: into pinned memory, an event recorded after
    it, so work queued later on the stream does not delay `result()`)."""

    def __init__(self, token_ids: torch.Tensor, packed: torch.Tensor, params: Sequence[SamplingParams], k: int):
        self.token_ids = token_ids
        self._params, self._k = params, k
        self._event = None
        if packed.device.type == "cuda":
            self._host = packed.to("cpu", non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = packed

    def result(self) -> list[SampledToken]:
        """One token per row; waits for this step's copy only."""
        if self._event is not None:
            self._event.synchronize()
        return _unpack(self._host.tolist(), self._params, self._k)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None],
           histories: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
           processors: Sequence[RequestProcessors | None] | None = None) -> list[SampledToken]:
    """One-off sampling without state across calls: logits [R, V]; one SamplingParams and
    generator per row; histories[row] = (prompt ids, output ids so far), needed only by rows with
    penalties (their counts are built from it) or processors; processors[row]: the row's
    logits-processor state or None. Same results as `Sampler.sample`."""
    if histories is None and any(p.has_penalties for p in params):
        raise ValueError("penalties need the token histories of their rows")
    states = list(processors) if processors is not None else [None] * len(params)
    rows = [SamplingRow(str(i), p, g, *(histories[i] if histories is not None else ((), ())), processors=state)
            for i, (p, g, state) in enumerate(zip(params, generators, states))]
    return Sampler(logits.shape[-1], logits.device).sample(logits, rows)


def _penalise(logits: torch.Tensor, params: Sequence[SamplingParams], counts: torch.Tensor,
              seen: torch.Tensor) -> torch.Tensor:
    """logits, counts: [P, V]; seen: [P, V] bool (prompt or output) -> penalised logits."""
    device, dtype = logits.device, logits.dtype
    repetition = on_device(device, [p.repetition_penalty for p in params], dtype)[:, None]
    frequency = on_device(device, [p.frequency_penalty for p in params], dtype)[:, None]
    presence = on_device(device, [p.presence_penalty for p in params], dtype)[:, None]
    scaled = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, scaled, logits)
    counts = counts.to(dtype)
    return logits - (frequency * counts + presence * (counts > 0).to(dtype))


def _choose(scores: torch.Tensor, params: Sequence[SamplingParams],
            generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """scores: [C, V] (penalised) -> [C] long: greedy rows their argmax, the others a draw."""
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if len(random_rows) == len(params):
        return draw(sampling_weights(scores, params), generators)
    chosen = scores.argmax(dim=-1)
    if random_rows:
        index = on_device(scores.device, random_rows, torch.long)
        drawn = draw(sampling_weights(scores.index_select(0, index), [params[i] for i in random_rows]),
                     [generators[i] for i in random_rows])
        chosen = chosen.index_copy(0, index, drawn)
    return chosen


def with_logprobs(raw: torch.Tensor, chosen: torch.Tensor, params: Sequence[SamplingParams]) -> list[SampledToken]:
    """raw: [R, V] unmodified logits; chosen: [R] long, the tokens taken -> one SampledToken per row,
    with the raw distribution's logprobs for the rows that ask (as `Sampler.sample` reports them)."""
    packed, k = _pack(raw, chosen, params)
    return _unpack(packed.tolist(), params, k)


def _pack(raw: torch.Tensor, chosen: torch.Tensor, params: Sequence[SamplingParams]) -> tuple[torch.Tensor, int]:
    """Chosen ids (long) alone, or with the raw distribution's logprobs of the rows that ask (then
    float64: ids, then per such row chosen logprob, rank, top-k values, top-k ids); and that k."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return chosen, 0
    k = max(params[i].logprobs for i in rows)
    step = chunk_rows(len(rows), raw.shape[1], raw.device)
    blocks = []
    for start in range(0, len(rows), step):  # CPU: cache-sized chunks, as the sampling
        index = on_device(raw.device, rows[start: start + step], torch.long)
        logprobs = torch.log_softmax(raw.index_select(0, index), dim=-1)
        top_values, top_ids = torch.topk(logprobs, k, dim=-1)
        chosen_values = logprobs.gather(1, chosen.index_select(0, index)[:, None])
        ranks = (logprobs > chosen_values).sum(dim=-1, keepdim=True) + 1
        blocks.append(torch.cat([chosen_values.double(), ranks.double(), top_values.double(), top_ids.double()],
                                dim=1))
    return torch.cat([chosen.double(), torch.cat(blocks).flatten()]), k


def _unpack(host: list, params: Sequence[SamplingParams], k: int) -> list[SampledToken]:
    """The host copy of `_pack`'s tensor -> one SampledToken per row."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return [SampledToken(token_id, None) for token_id in host]
    num_rows = len(params)
    chosen_host = [int(t) for t in host[:num_rows]]
    width = 2 + 2 * k
    entries: dict[int, dict[int, Logprob]] = {}
    for i, row in enumerate(rows):
        block = host[num_rows + i * width: num_rows + (i + 1) * width]
        values, ids = block[2: 2 + k], block[2 + k:]
        count = params[row].logprobs
        entry = {int(token): Logprob(value, rank + 1) for rank, (token, value) in
                 enumerate(zip(ids[:count], values[:count]))}
        entry[chosen_host[row]] = Logprob(block[0], int(block[1]))
        entries[row] = entry
    return [SampledToken(token_id, entries.get(row)) for row, token_id in enumerate(chosen_host)]


# ---------------------------------------------------------------------------------------- reference


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int],
                    output_ids: Sequence[int]) -> torch.Tensor:
    """logits: [vocab] -> penalised copy (vLLM's presence, frequency and repetition penalties)."""
    vocab = logits.shape[0]
    out = logits.clone()
    output = torch.tensor([t for t in output_ids if t < vocab], dtype=torch.long, device=logits.device)
    if params.repetition_penalty != 1.0:
        seen = torch.tensor([t for t in prompt_ids if t < vocab], dtype=torch.long, device=logits.device)
        seen = torch.unique(torch.cat([seen, output]))
        values = out[seen]
        out[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if output.numel() and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(output, minlength=vocab).to(out.dtype)
        out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(out.dtype)
    return out


def reference_sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampledToken]:
    """The spec of `Sampler.sample`, one row at a time in plain PyTorch (tests compare the two).
    Draws from each row's generator exactly as the vectorised pass does, so seeded rows agree."""
    out = []
    for raw, row in zip(logits, rows):
        p = row.params
        scores = apply_penalties(raw, p, row.prompt_token_ids, row.output_token_ids) if p.has_penalties else raw
        token = int(scores.argmax()) if p.greedy else _reference_draw(scores, p, row.generator)
        entry = None
        if p.logprobs is not None:
            logprobs = torch.log_softmax(raw, dim=-1)
            order = sorted(range(raw.numel()), key=lambda t: -float(logprobs[t]))
            entry = {t: Logprob(float(logprobs[t]), rank + 1) for rank, t in enumerate(order[: p.logprobs])}
            entry[token] = Logprob(float(logprobs[token]), int((logprobs > logprobs[token]).sum()) + 1)
        out.append(SampledToken(token, entry))
    return out


def _reference_draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One row's draw, spelled out: the filters of `sampling_weights` with a full sort, then the
    two-level race of `draw` (the same draws from `generator`, so seeded rows agree)."""
    vocab = logits.numel()
    block = block_size(vocab)
    scores = torch.cat([logits, logits.new_full((-vocab % block,), float("-inf"))]) / params.temperature
    top = scores.max()
    device = logits.device
    floor = torch.tensor(float("-inf"), device=device)
    if params.min_p > 0.0:
        floor = top + torch.log(torch.tensor(params.min_p, dtype=scores.dtype, device=device))
    if 0 < params.top_k < vocab:
        floor = torch.maximum(floor, scores.sort(descending=True).values[params.top_k - 1])
    weights = (scores - top).clamp(min=EXP_FLOOR).exp().masked_fill(scores < floor, 0.0)
    weights[vocab:] = 0.0
    if params.top_p < 1.0:
        mass = weights.view(-1, block).sum(dim=-1).sum()  # block by block, as `block_masses`
        target = torch.tensor(params.top_p, dtype=weights.dtype, device=device) * mass
        ordered = weights.sort(descending=True).values
        reached = int((ordered.cumsum(dim=0) < target).sum())  # entries before the mass is reached
        weights = weights.masked_fill(weights < ordered[min(reached, vocab - 1)], 0.0)
    blocks = weights.view(-1, block)
    tiny = torch.finfo(weights.dtype).tiny
    first = torch.empty(blocks.shape[0], device=device).exponential_(generator=generator).clamp_(min=tiny)
    chosen = int((blocks.sum(dim=-1) / first).argmax())
    second = torch.empty(block, device=device).exponential_(generator=generator).clamp_(min=tiny)
    return chosen * block + int((blocks[chosen] / second).argmax())
