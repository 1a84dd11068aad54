"""Applies a `StepPlan`'s device writes, turns it into one `ForwardBatch`, runs the model, samples and
scores its logits (runner/step_sampler.py) and hands back a pending `StepResult`.

All metadata is built here, once per step, on the host (numpy, no per-token Python loop over long
segments), packed into one int64 buffer and moved to the device in a single copy (pinned,
non-blocking on CUDA); the batch's tensors are views of that one device buffer, and the layers
only index with them.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from forkpoint.models.interface import CausalLM
from forkpoint.runner.decode_graphs import DecodeGraphs, decode_bucket_sizes
from forkpoint.runner.piecewise import PiecewiseForward
from forkpoint.runner.step_sampler import PendingStep, StepSampler
from forkpoint.runner.storage import DeviceStorage
from forkpoint.runner.warmup import WarmupReport, warm_up, warmup_max_context
from forkpoint.step.batch import AttentionMetadata, DecodeGroup, ForwardBatch, RecurrentPhase
from forkpoint.step.plan import DeviceWrite, KVCopy, Segment, SegmentKind, StepPlan

logger = logging.getLogger("forkpoint")

# The longest cached context a warm-up segment starts after (attention kernels loop over the
# context on the device: its length picks no kernel variant, so a few blocks' worth is enough).

if TYPE_CHECKING:  # annotations only: a tensor-parallel worker imports this module without the image stack
    from forkpoint.runner.multimodal import MultimodalInputs
    from forkpoint.runner.speculative import FinishedStep, MTPDrafter


class _Staging:
    """Host int64 arrays gathered into one buffer, uploaded with one copy.

    Each array starts at a multiple of 16 elements (128 bytes), so every device view is as aligned
    as a fresh allocation (Triton specialises kernels on pointer alignment; a misaligned view
    would compile another variant in the middle of a run).
    """

    ALIGN = 16

    def __init__(self) -> None:
        self._parts: list[tuple[int, np.ndarray]] = []
        self._size = 0

    def add(self, values) -> tuple[int, int, tuple[int, ...]]:
        """Stage `values`; returns the handle (offset, size, shape) that `get` reads back."""
        array = np.asarray(values, dtype=np.int64)
        offset, size = self._size, array.size
        self._parts.append((offset, array.reshape(-1)))
        self._size += -(-max(size, 1) // self.ALIGN) * self.ALIGN
        return offset, size, array.shape

    def upload(self, device: torch.device) -> torch.Tensor:
        pinned = device.type == "cuda"
        host = torch.empty(self._size, dtype=torch.int64, pin_memory=pinned)
        view = host.numpy()
        for offset, array in self._parts:
            view[offset: offset + array.size] = array
        return host.to(device, non_blocking=True) if device.type != "cpu" else host

    @staticmethod
    def get(buffer: torch.Tensor, handle: tuple[int, int, tuple[int, ...]]) -> torch.Tensor:
        offset, size, shape = handle
        flat = buffer.narrow(0, offset, size)
        return flat if len(shape) == 1 else flat.view(shape)


def build_forward_batch(plan: StepPlan, block_size: int, device: torch.device,
                        feed: torch.Tensor | None = None) -> tuple[ForwardBatch, list[Segment]]:
    """Returns the batch and the segments whose sampled logits it yields (rows 0 .. len - 1, in that
    order); further rows hold the prompt-logit rows of the segments with `prompt_logit_rows`, in
    packed order (`plan.ordered()`).

    feed: [R'] long on `device`, the token ids the step before sampled, for the segments with a
    `fed_row` (asynchronous scheduling): copied into `input_ids` on the device, no host sync."""
    segments = plan.ordered()
    num_segments = len(segments)
    lengths = np.fromiter((s.end - s.start for s in segments), dtype=np.int64, count=num_segments)
    cu_q = np.zeros(num_segments + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu_q[1:])
    num_tokens = int(cu_q[-1])
    token_ids = np.empty(num_tokens, dtype=np.int64)
    positions = np.empty(num_tokens, dtype=np.int64)
    slot_mapping = np.empty(num_tokens, dtype=np.int64)
    # block tables: every row's list in one pass, laid into the padded table with one mask
    table_lens = np.fromiter((len(s.block_table) for s in segments), dtype=np.int64, count=num_segments)
    block_tables = np.zeros((num_segments, int(table_lens.max())), dtype=np.int64)
    block_tables[np.arange(block_tables.shape[1]) < table_lens[:, None]] = np.fromiter(
        itertools.chain.from_iterable(s.block_table for s in segments), dtype=np.int64, count=int(table_lens.sum()))
    # single-token segments (the decodes, and fed ones): vectorised over the rows
    single = np.flatnonzero(lengths == 1)
    if single.size:
        ones = [segments[row] for row in single.tolist()]
        lo = cu_q[single]
        starts = np.fromiter((s.start for s in ones), dtype=np.int64, count=len(ones))
        token_ids[lo] = np.fromiter((0 if s.fed_row is not None else s.token_ids[0] for s in ones), dtype=np.int64,
                                    count=len(ones))  # fed ones: overwritten on the device from `feed` below
        positions[lo] = starts
        slot_mapping[lo] = block_tables[single, starts // block_size] * block_size + starts % block_size
    fed = [(int(cu_q[row]), s.fed_row) for row, s in enumerate(segments) if s.fed_row is not None]
    if any(s.num_tokens != 1 for s in segments if s.fed_row is not None):
        raise ValueError("a segment fed from the step before (fed_row) must be a single token")
    for row in np.flatnonzero(lengths > 1).tolist():
        segment = segments[row]
        lo, hi = int(cu_q[row]), int(cu_q[row + 1])
        token_ids[lo:hi] = segment.token_ids
        span = np.arange(segment.start, segment.end, dtype=np.int64)
        positions[lo:hi] = span
        slot_mapping[lo:hi] = block_tables[row, span // block_size] * block_size + span % block_size
    samples = np.fromiter((s.samples for s in segments), dtype=bool, count=num_segments)
    logits_indices = cu_q[1:][samples] - 1
    sampled = [s for s in segments if s.samples]
    scored = [(row, s) for row, s in enumerate(segments) if s.prompt_logit_rows]
    if scored:  # prompt logprobs: rows after the sampled ones, segment by segment
        logits_indices = np.concatenate([logits_indices] + [
            np.arange(cu_q[row], cu_q[row] + s.prompt_logit_rows, dtype=np.int64) for row, s in scored])
    seq_lens = np.fromiter((s.end for s in segments), dtype=np.int64, count=num_segments)

    staging = _Staging()
    staged = {name: staging.add(values) for name, values in (
        ("input_ids", token_ids), ("positions", positions), ("slot_mapping", slot_mapping),
        ("block_tables", block_tables), ("cu_q", cu_q), ("seq_lens", seq_lens), ("logits_indices", logits_indices),
    )}
    src, dst = _copy_slots(plan.kv_copies, block_size)
    staged["cow_src"], staged["cow_dst"] = staging.add(src), staging.add(dst)
    num_decodes = sum(1 for s in segments if s.kind is SegmentKind.DECODE)
    staged["decode_slots"] = staging.add([s.initial_slot for s in segments[:num_decodes]])
    if fed:
        if feed is None:
            raise ValueError("the plan has decodes fed from the step before (fed_row) but no feed tensor was given")
        staged["fed_to"], staged["fed_from"] = staging.add([t for t, _ in fed]), staging.add([r for _, r in fed])
    phase_makers = []
    verifying = {v.request_id for v in plan.verifies}
    first = num_decodes
    while first < num_segments:
        last = first
        while last < num_segments and segments[last].phase == segments[first].phase:
            last += 1
        phase_makers.append(_stage_phase(staging, segments[first:last], int(cu_q[first]), int(cu_q[last]),
                                         verifying))
        first = last

    buffer = staging.upload(device)
    on_device = {name: _Staging.get(buffer, handle) for name, handle in staged.items()}
    if fed:
        on_device["input_ids"].index_copy_(0, on_device["fed_to"], feed.index_select(0, on_device["fed_from"]))
    attention = AttentionMetadata(
        slot_mapping=on_device["slot_mapping"],
        block_tables=on_device["block_tables"].to(torch.int32),
        cu_seqlens_q=on_device["cu_q"],
        cu_seqlens_q_host=tuple(cu_q.tolist()),
        seq_lens=on_device["seq_lens"],
        seq_lens_host=tuple(seq_lens.tolist()),
        cow_src=on_device["cow_src"],
        cow_dst=on_device["cow_dst"],
    )
    batch = ForwardBatch(
        input_ids=on_device["input_ids"],
        positions=on_device["positions"],
        decode=DecodeGroup(num_decodes, on_device["decode_slots"]) if num_decodes else None,
        phases=tuple(make(buffer) for make in phase_makers),
        attention=attention,
        logits_indices=on_device["logits_indices"],
    )
    return batch, sampled


def _stage_phase(staging: _Staging, segments: Sequence[Segment], token_start: int, token_end: int,
                 verifying: set[str]) -> Callable[[torch.Tensor], RecurrentPhase]:
    """Stage one phase's metadata; returns a function building the phase from the device buffer.
    `verifying`: the requests whose segments verify drafts (a phase of only theirs is `single_tokens`)."""
    cu = [0]
    dest_rows: list[int] = []
    dest_slots: list[int] = []
    for row, segment in enumerate(segments):
        cu.append(cu[-1] + segment.end - segment.start)
        for slot in segment.dest_slots:
            dest_rows.append(row)
            dest_slots.append(slot)
    handles = [staging.add(values) for values in (cu, [s.initial_slot for s in segments], dest_rows, dest_slots)]
    single = (all(s.request_id in verifying and s.num_tokens == 1 and len(s.dest_slots) == 1 for s in segments)
              and len(set(dest_slots)) == len(dest_slots))

    def make(buffer: torch.Tensor) -> RecurrentPhase:
        cu_seqlens, initial_slots, rows, slots = (_Staging.get(buffer, handle) for handle in handles)
        return RecurrentPhase(token_start=token_start, token_end=token_end, cu_seqlens=cu_seqlens,
                              cu_seqlens_host=tuple(cu), initial_slots=initial_slots, dest_rows=rows,
                              dest_slots=slots, single_tokens=single)

    return make


def _copy_slots(copies: Sequence[KVCopy], block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Flat source and destination KV slots of the step's copy-on-write copies, chains resolved.

    A copy may read slots that an earlier copy of the same step writes. A producer that resumes from a
    checkpoint at position p inside a block gets a private copy of that block's first p % block_size
    slots; a consumer that, in the same step, shares the producer's own checkpoint at q (same block,
    q > p) then copies the first q % block_size slots of that private block::

        checkpoint's block   [a . . .]     copy 1: slot a
        producer's block     [a b c .]     a: copy 1, b c: this step's KV write
        consumer's block     [a b c .]     copy 2: slots a b c of the producer's block

    `copy_kv_slots` gathers every source before it writes any destination (its sources must not be
    destinations), so each source is followed back through the copies to the slot that holds the data
    once this step's KV is written: copy 2 reads a from the checkpoint's block, b c from the producer's.
    """
    if not copies:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    src = np.concatenate([c.src_block * block_size + np.arange(c.num_tokens, dtype=np.int64) for c in copies])
    dst = np.concatenate([c.dst_block * block_size + np.arange(c.num_tokens, dtype=np.int64) for c in copies])
    chained = np.isin(src, dst)
    if chained.any():
        origin = dict(zip(dst.tolist(), src.tolist()))
        for index in np.flatnonzero(chained).tolist():
            slot = int(src[index])
            for _ in range(len(copies)):  # a chain passes each copy at most once
                slot = origin.get(slot, slot)
            if slot in origin:
                raise RuntimeError(f"copy-on-write chain through KV slot {slot} does not end: the plan's copies "
                                   "form a cycle")
            src[index] = slot
    return src, dst


class ModelRunner:
    """Owns the model, the cache tensors (`storage`) and the sampling state (`sampling`); each step
    applies the plan's device writes to the storage, then runs the forward on it and samples.

    With `piecewise` (CUDA graphs, runner/piecewise.py), the steps it accepts run through it (text
    and image steps alike) and the others (more tokens than its largest bucket) through the model's
    plain forward. When its graphs are captured, decode steps run as whole-forward graphs
    (`decode_graphs`, runner/decode_graphs.py; captured here, after the pools exist), one replay
    per step; a plain attribute, so benchmarks can detach it (None). With a drafter, the uniform verify
    steps (every sequence verifies k drafts) run the same way (`verify_graphs`: DecodeGraphs with
    k drafts, the target forward of the speculative step). Then the varlen cores of
    prefill and mixed steps are compiled and autotuned by a warm-up on the pools' scratch rows
    (runner/warmup.py; `warmup` reports it), so no served step compiles.

    With a `drafter` (speculative decoding, runner/speculative.py) every step runs through it: the
    plain forward, sampling, verification of the plan's drafts and the MTP head's next drafts.
    """

    def __init__(self, model: CausalLM, storage: DeviceStorage, device: torch.device,
                 multimodal: MultimodalInputs | None = None, piecewise: PiecewiseForward | None = None,
                 drafter: MTPDrafter | None = None) -> None:
        self.model = model
        self.device = device
        self.storage = storage
        self.block_size = storage.block_size
        self.caches = storage.caches
        self.multimodal = multimodal  # image positions and vision-tower rows; None for text-only engines
        self.piecewise = piecewise
        self.drafter = drafter
        self.sampling = StepSampler(model.config.vocab_size, device)  # penalty counts, generators across steps
        self.scratch_block, self.scratch_slot = storage.scratch_block, storage.scratch_slot
        self.decode_graphs: DecodeGraphs | None = None
        self.verify_graphs: DecodeGraphs | None = None  # with a drafter: its uniform verify steps
        self.warmup: WarmupReport | None = None
        if piecewise is not None and piecewise.captured:
            # with a drafter every step runs `forward_hidden` (runner/speculative.py): no decode graphs
            if drafter is None:
                self.decode_graphs = self._capture_decode_graphs()
            else:
                self.verify_graphs = self._capture_decode_graphs(drafts=drafter.k)
            max_context = warmup_max_context(model.config.max_position_embeddings, piecewise.sizes[-1])
            self.warmup = warm_up(self, max_tokens=piecewise.sizes[-1], max_seqs=storage.num_request_slots,
                                  max_context=max_context)
            logger.info("warm-up: %d synthetic steps (%d tokens) in %.1f s", self.warmup.steps, self.warmup.tokens,
                        self.warmup.seconds)

    def graph_summary(self) -> str:
        """One line on what runs through CUDA graphs, and what runs eagerly and why (start-up log)."""
        piecewise = self.piecewise
        if piecewise is None or not piecewise.captured:
            return "CUDA graphs: none, every step runs eagerly"
        parts = [f"CUDA graphs: {len(piecewise.sizes)} piecewise buckets ({piecewise.sizes[0]}..{piecewise.sizes[-1]} "
                 "tokens)"]
        for graphs in (self.decode_graphs, self.verify_graphs):
            if graphs is not None:
                sizes = sorted(graphs.graphs)
                parts.append(f"{len(sizes)} {graphs.kind} buckets ({sizes[0]}..{sizes[-1]} sequences)" if sizes
                             else f"{graphs.kind} graphs empty")
        if not piecewise.capture_cores:
            parts.append("recurrent cores eager (core graphs off)")
        elif piecewise.core_capture_failures:
            parts.append(f"recurrent cores EAGER in {piecewise.core_capture_failures} steps so far, capture failed: "
                         f"{piecewise.core_capture_failure_cause}")
        else:
            parts.append(f"recurrent core graph captured per step ({piecewise.core_graph_steps} steps so far)")
        return ", ".join(parts)

    def _capture_decode_graphs(self, drafts: int = 0) -> DecodeGraphs:
        """Decode buckets (drafts = 0), or verify buckets of `drafts` drafts per sequence, up to the
        most sequences such a step can hold (a verifying sequence holds 1 + drafts request slots),
        block tables as wide as the model's context (or the whole pool, if smaller)."""
        piecewise, storage = self.piecewise, self.storage
        max_blocks = min(storage.num_blocks, -(-self.model.config.max_position_embeddings // self.block_size))
        max_seqs = max(1, storage.num_request_slots // (1 + drafts))
        return DecodeGraphs(self.model, self.caches, decode_bucket_sizes(piecewise.sizes, max_seqs), max_blocks,
                            scratch_block=storage.scratch_block, block_size=self.block_size,
                            scratch_state_slot=storage.scratch_slot, device=self.device, capture=True, drafts=drafts,
                            pool=torch.cuda.graph_pool_handle(), stream=piecewise.capture_stream)

    def prepare(self, plan: StepPlan, feed: torch.Tensor | None = None) -> tuple[ForwardBatch, list[Segment]]:
        """Apply the plan's device writes (first; a failed step's come again and are skipped), then
        the step's batch (images encoded and attached) and the segments its logits
        rows belong to; `feed` as in `build_forward_batch`."""
        self.storage.apply(plan.writes, plan.first_write, forward=plan)
        batch, sampled = build_forward_batch(plan, self.block_size, self.device, feed)
        if self.multimodal is not None:
            batch = self.multimodal.attach(plan.ordered(), batch)
        return batch, sampled

    def apply_writes(self, writes: Sequence[DeviceWrite], first: int) -> None:
        """Apply device writes outside a step (an idle engine's last ones; step/plan.py numbering)."""
        self.storage.apply(writes, first)

    def execute(self, plan: StepPlan, feed: torch.Tensor | None = None) -> PendingStep | FinishedStep:
        """Run one step: forward, then sample and score as `plan.sampling` says (runner/step_sampler.py).
        Enqueues the step; only prompt scores are read back here. `feed`: the token ids the step before
        sampled (its `PendingStep.feed`), for a plan scheduled while that step ran (see
        `build_forward_batch`). With a drafter, the whole speculative step runs here (no `feed`)."""
        if self.drafter is not None:
            if feed is not None:
                raise ValueError("speculative steps are never scheduled ahead: no feed is taken")
            return self.drafter.execute(self, plan)
        batch, sampled = self.prepare(plan, feed)
        return self.sampling.launch(plan, sampled, self.forward(batch))

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [R, vocab] float32 of one prepared batch, through the graphs when they take it."""
        if self.decode_graphs is not None and self.decode_graphs.accepts(batch):
            return self.decode_graphs(batch)
        if self.piecewise is not None and self.piecewise.accepts(batch):
            return self.piecewise(batch, self.caches)
        return self.model(batch, self.caches)

    def forward_hidden(self, batch: ForwardBatch) -> torch.Tensor:
        """The stream leaving the last layer [T, hidden] of one prepared batch (the speculative step's
        forward): uniform verify steps through the verify graphs, the others through the piecewise
        graphs when they take it (never the decode graphs: they hold logits only). Valid until the
        next forward."""
        if self.verify_graphs is not None and self.verify_graphs.accepts(batch):
            return self.verify_graphs.forward_hidden(batch)
        if self.piecewise is not None and self.piecewise.accepts(batch):
            return self.piecewise.forward_hidden(batch, self.caches)
        return self.model.forward_hidden(batch, self.caches)

    def release(self, request_ids: Iterable[str]) -> None:
        """Drop the sampling state of sequences that have ended (every path out)."""
        self.sampling.release(request_ids)

    def check_integrity(self, live_ids: set[str]) -> None:
        """Sampling state is held only for live sequences; raises AssertionError."""
        self.sampling.check_integrity(live_ids)

    def metrics(self) -> dict[str, int | float]:
        """The CUDA-graph, image-encoder and disk-writer counters (none when none runs)."""
        values: dict[str, int | float] = {}
        if self.storage.disk is not None:
            values.update(self.storage.disk.metrics())
        piecewise = self.piecewise
        if piecewise is not None:
            values.update(cuda_graph_core_capture_failures=piecewise.core_capture_failures,
                          cuda_graph_core_replay_steps=piecewise.core_graph_steps)
        vision = self.multimodal
        if vision is not None:
            values.update(vision.metrics())
        return values
