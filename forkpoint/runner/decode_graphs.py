"""Decode and verify steps as full CUDA graphs: one replay per step, attention and recurrent cores inside it.

A *decode step* is a step whose every segment is one token of a running sequence: no recurrent
phase, no copy-on-write, no image rows. Its metadata differs from step to step only in values, not
in shapes, once the number of sequences N is rounded up to a bucket Nb and the block tables are
padded to a fixed width. So the whole forward (embedding, every layer's projections, GDN conv and
in-place delta rule, KV write and paged attention, MoE, final norm and lm_head) is captured once
per bucket and replayed: one launch per step instead of ~2,400 (35B-A3B).

A *uniform verify step* (speculative decoding, `drafts` = k > 0) is one whose every sequence
verifies exactly k drafts (engine/speculative.py): N x (k + 1) one-token rows, packed in k + 1
groups of N rows (step/batch.py's order): group 0 the decode group (each sequence's last token,
from and into its own state row), group g >= 1 the single-token recurrent phase g (draft g, from
the row group g - 1 wrote into a row of its own). Every row is also its own attention segment of
one query, so attention is a decode's. Its shapes depend only on N and k, and it is the decode
step above with each group padded to Nb rows (a decode step is the case k = 0)::

    row     0 ..  N-1   N .. Nb-1 | Nb .. Nb+N-1  Nb+N .. 2Nb-1 | ... | k Nb .. (k+1) Nb - 1
            group 0     padding   | group 1       padding       | ... | group k
            (decodes)             | (phase 1)                   |     | (phase k)

Static buffers (Nmax = the largest bucket, R = (k + 1) Nmax rows; a bucket reads rows [:(k + 1) Nb],
viewed as [k + 1, Nb]); each step copies its ForwardBatch into them, then replays::

    input_ids, positions, slot_mapping, seq_lens          [R] long
    block_tables                                          [R, max_blocks] int32 (columns past the
                                                          step's own width keep stale block ids: a
                                                          row reads only its first ceil(seq_len / bs))
    slots [k + 1, Nmax] long                              group 0: the decode group's state rows;
                                                          group g: phase g's destination rows
    initial_slots [k, Nmax] long                          phase g's initial rows (row g - 1)
    cu_q = 0, 1, ..., R; row_indices = 0, ..., R - 1      constant (one query per row)
    output                                                k = 0: logits [Nmax, vocab] float32 (a
                                                          decode step samples every row); k > 0:
                                                          hidden [R, hidden], the stream leaving
                                                          the last layer (the speculative step reads
                                                          every row of it, runner/speculative.py)

Padding rows (N..Nb-1 of every group) decode token 0 at position 0 on the pools' scratch rows: KV
slot = the first slot of `BlockPool.scratch_block` (block table row [scratch_block], seq_len 1),
state rows (decode slot, and a phase's initial and destination row) = `StatePool.scratch_slot`.
They write only those scratch rows (all at once, so the values there race; nothing ever reads them
but padding rows), so every other pool row is written exactly as by the eager forward of the real
rows, and everything the padding rows compute stays finite. The padding is reset on every step (a
larger step may have left real slots in those rows).

The forward inside the graph is the model's own `forward` (k = 0) or `forward_hidden` (k > 0) on a
ForwardBatch of static views, so graph and eager steps run the same code; they differ only where
kernels see (k + 1) Nb instead of (k + 1) N rows (GEMM tiling), i.e. to bf16 rounding. The graphs of
one instance share one memory pool of their own (largest bucket first; they never run concurrently,
and nothing allocated in a capture outlives it: the output is copied into the static buffer), apart
from the piecewise graphs' pool.

`capture=False` runs the same static-buffer path eagerly (CPU tests of the plumbing and padding).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence

import torch

from forkpoint.models.interface import CausalLM
from forkpoint.step.batch import AttentionMetadata, DecodeGroup, ForwardBatch, RecurrentPhase
from forkpoint.step.caches import LayerCaches

logger = logging.getLogger("forkpoint")


def decode_bucket_sizes(graph_sizes: Sequence[int], max_seqs: int) -> tuple[int, ...]:
    """The buckets of `graph_sizes` a decode step of at most `max_seqs` sequences can need: those
    below max_seqs and the first one at or above it (all of them when none is)."""
    sizes = sorted({int(s) for s in graph_sizes})
    cut = bisect.bisect_left(sizes, max_seqs)
    return tuple(sizes[: cut + 1])


class DecodeGraphs:
    """For the steps it `accepts`: with drafts = 0, `forward(batch) -> logits [N, vocab]` float32,
    equal (to bf16 rounding on CUDA) to `model(batch, caches)`; with drafts = k > 0 (uniform verify
    steps), `forward_hidden(batch) -> hidden [N (k + 1), hidden]`, equal to
    `model.forward_hidden(batch, caches)`. Same pool writes as the model's.

    sizes: bucket sequence counts; max_blocks: block-table width the buffers hold (steps with wider
    tables are not accepted); scratch_block, block_size: the padding rows' KV block (their KV slot is
    its first); scratch_state_slot: their state row; drafts: k, the drafts every sequence of an
    accepted step verifies (0: decode steps). capture: record one graph per bucket now (CUDA) into
    `pool` on `stream`; else run eagerly.
    """

    def __init__(self, model: CausalLM, caches: LayerCaches, sizes: Sequence[int], max_blocks: int, *,
                 scratch_block: int, block_size: int, scratch_state_slot: int, device: torch.device,
                 capture: bool, drafts: int = 0, pool=None, stream: torch.cuda.Stream | None = None) -> None:
        self.model, self.caches, self.device = model, caches, device
        self.sizes = tuple(sorted({int(s) for s in sizes}))
        if not self.sizes or self.sizes[0] < 1:
            raise ValueError(f"decode bucket sizes must be sequence counts >= 1, got {list(sizes)}")
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        if drafts < 0:
            raise ValueError(f"drafts must be >= 0 (0: decode steps), got {drafts}")
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}: use capture=False")
        self.max_blocks = max_blocks
        self.drafts = drafts
        self.groups = drafts + 1  # rows per sequence
        self.scratch_block = scratch_block
        self.scratch_kv_slot = scratch_block * block_size
        self.scratch_state_slot = scratch_state_slot
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = 0  # steps served by a replay (or, without capture, by the static path)
        seqs = self.sizes[-1]
        rows = self.groups * seqs
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(rows, **long)
        self.positions = torch.zeros(rows, **long)
        self.slot_mapping = torch.zeros(rows, **long)
        self.seq_lens = torch.zeros(rows, **long)
        self.block_tables = torch.zeros(rows, max_blocks, dtype=torch.int32, device=device)
        self.slots = torch.zeros(self.groups, seqs, **long)
        self.initial_slots = torch.zeros(drafts, seqs, **long)
        self.cu_q = torch.arange(rows + 1, **long)
        self.row_indices = torch.arange(rows, **long)
        self.no_copies = torch.zeros(0, **long)
        self.logits: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None
        if drafts == 0:
            self.logits = torch.zeros(seqs, model.config.vocab_size, dtype=torch.float32, device=device)
        else:
            token = torch.zeros(1, **long)
            probe, _ = model.embed(token, token)  # the stream's width and dtype
            self.hidden = probe.new_zeros(rows, *probe.shape[1:])
        self._pad(0, seqs)
        if capture:
            torch.cuda.synchronize(device)
            free_before, _ = torch.cuda.mem_get_info(device)
            start = time.perf_counter()
            with torch.inference_mode(), torch.cuda.device(device):
                self._capture(pool, stream)
            free_after, _ = torch.cuda.mem_get_info(device)
            logger.info("%s CUDA graphs: %d buckets (%d..%d sequences) captured in %.1f s, %.0f MiB of GPU memory",
                        self.kind, len(self.sizes), self.sizes[0], self.sizes[-1], time.perf_counter() - start,
                        (free_before - free_after) / 2**20)

    @property
    def kind(self) -> str:
        """"decode", or "verify (k drafts)" (logs, errors)."""
        return "decode" if self.drafts == 0 else f"verify ({self.drafts} drafts)"

    # ------------------------------------------------------------------ metadata
    def accepts(self, batch: ForwardBatch) -> bool:
        """Text steps of N <= the largest bucket sequences and at most max_blocks table columns that
        are decode steps (drafts = 0) or uniform verify steps: a decode group of N rows, then `drafts`
        single-token phases of N rows each (every row its own attention segment)."""
        decode, meta, phases = batch.decode, batch.attention, batch.phases
        if decode is None or batch.mrope_positions is not None or batch.embedding_overrides is not None:
            return False
        n = decode.num_tokens
        if not (0 < n <= self.sizes[-1] and batch.num_tokens == self.groups * n and len(phases) == self.drafts
                and meta.cow_src.numel() == 0 and meta.block_tables.shape[1] <= self.max_blocks
                and meta.block_tables.shape[0] == batch.num_tokens):
            return False
        if self.drafts == 0:
            return batch.logits_indices.shape[0] == n  # the logits of every row, in order
        return all(p.single_tokens and p.token_start == g * n and p.token_end == (g + 1) * n
                   and len(p.cu_seqlens_host) == n + 1 for g, p in enumerate(phases, start=1))

    def bucket(self, num_seqs: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, num_seqs)]

    def _grouped(self, buffer: torch.Tensor, seqs: int) -> torch.Tensor:
        """Rows [:(k + 1) seqs] of a row buffer as [k + 1, seqs, ...] (group g: rows g seqs ..)."""
        return buffer[: self.groups * seqs].view(self.groups, seqs, *buffer.shape[1:])

    def _pad(self, lo: int, seqs: int) -> None:
        """Rows lo..seqs-1 of every group of bucket `seqs` become padding rows (module docstring)."""
        if seqs <= lo:
            return
        self._grouped(self.input_ids, seqs)[:, lo:].zero_()
        self._grouped(self.positions, seqs)[:, lo:].zero_()
        self._grouped(self.slot_mapping, seqs)[:, lo:].fill_(self.scratch_kv_slot)
        self._grouped(self.seq_lens, seqs)[:, lo:].fill_(1)
        self._grouped(self.block_tables, seqs)[:, lo:, 0].fill_(self.scratch_block)
        self.slots[:, lo:seqs].fill_(self.scratch_state_slot)
        self.initial_slots[:, lo:seqs].fill_(self.scratch_state_slot)

    def _load(self, batch: ForwardBatch, seqs: int) -> None:
        """The step's metadata into the real rows of bucket `seqs`, padding into the others (device
        copies only, no host sync)."""
        n, meta, groups = batch.decode.num_tokens, batch.attention, self.groups
        self._grouped(self.input_ids, seqs)[:, :n].copy_(batch.input_ids.view(groups, n))
        self._grouped(self.positions, seqs)[:, :n].copy_(batch.positions.view(groups, n))
        self._grouped(self.slot_mapping, seqs)[:, :n].copy_(meta.slot_mapping.view(groups, n))
        self._grouped(self.seq_lens, seqs)[:, :n].copy_(meta.seq_lens.view(groups, n))
        width = meta.block_tables.shape[1]
        self._grouped(self.block_tables, seqs)[:, :n, :width].copy_(meta.block_tables.view(groups, n, width))
        self.slots[0, :n].copy_(batch.decode.slots)
        for g, phase in enumerate(batch.phases, start=1):
            self.slots[g, :n].copy_(phase.dest_slots)
            self.initial_slots[g - 1, :n].copy_(phase.initial_slots)
        self._pad(n, seqs)

    def _static_batch(self, seqs: int, seq_lens_host: Sequence[int]) -> ForwardBatch:
        """A ForwardBatch of static views for bucket `seqs` ((k + 1) seqs rows). The host tuples
        matter only to the CPU reference kernels (the GPU kernels read the device tensors), so
        captured graphs keep the capture-time ones."""
        rows = self.groups * seqs
        attention = AttentionMetadata(
            slot_mapping=self.slot_mapping[:rows], block_tables=self.block_tables[:rows],
            cu_seqlens_q=self.cu_q[: rows + 1], cu_seqlens_q_host=tuple(range(rows + 1)),
            seq_lens=self.seq_lens[:rows], seq_lens_host=tuple(seq_lens_host),
            cow_src=self.no_copies, cow_dst=self.no_copies)
        phases = tuple(RecurrentPhase(
            token_start=g * seqs, token_end=(g + 1) * seqs, cu_seqlens=self.cu_q[: seqs + 1],
            cu_seqlens_host=tuple(range(seqs + 1)), initial_slots=self.initial_slots[g - 1, :seqs],
            dest_rows=self.row_indices[:seqs], dest_slots=self.slots[g, :seqs], single_tokens=True)
            for g in range(1, self.groups))
        return ForwardBatch(input_ids=self.input_ids[:rows], positions=self.positions[:rows],
                            decode=DecodeGroup(seqs, self.slots[0, :seqs]), phases=phases, attention=attention,
                            logits_indices=self.row_indices[:rows])

    def _run(self, batch: ForwardBatch, seqs: int) -> None:
        """What a graph records: the model's forward on the static batch, its output into the buffer."""
        if self.logits is not None:
            self.logits[:seqs].copy_(self.model(batch, self.caches))
        else:
            self.hidden[: self.groups * seqs].copy_(self.model.forward_hidden(batch, self.caches))

    # ------------------------------------------------------------------ forward
    def _step(self, batch: ForwardBatch) -> tuple[int, int]:
        """Load, then replay (or run) the step's bucket -> (N, Nb). ValueError if not `accepts`."""
        if not self.accepts(batch):
            raise ValueError(f"the {self.kind} graphs take text steps of at most {self.sizes[-1]} sequences and "
                             f"{self.max_blocks} block-table columns, "
                             + ("decode steps only" if self.drafts == 0 else
                                f"every sequence verifying exactly {self.drafts} drafts"))
        n = batch.decode.num_tokens
        seqs = self.bucket(n)
        self._load(batch, seqs)
        graph = self.graphs.get(seqs)
        if graph is None:
            host = batch.attention.seq_lens_host
            padded = [x for g in range(self.groups) for x in (*host[g * n: (g + 1) * n], *(1,) * (seqs - n))]
            self._run(self._static_batch(seqs, padded), seqs)
        else:
            graph.replay()
        self.replays += 1
        return n, seqs

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Decode graphs: logits [N, vocab] float32 (a view of the static buffer, valid until the next
        step); reads and writes the pools like `model(batch, caches)`. ValueError if not `accepts`."""
        if self.logits is None:
            raise ValueError("the verify graphs hold the last layer's stream, not logits: call forward_hidden")
        n, _ = self._step(batch)
        return self.logits[:n]

    @torch.inference_mode()
    def forward_hidden(self, batch: ForwardBatch) -> torch.Tensor:
        """Verify graphs: the stream leaving the last layer [N (k + 1), hidden] in the batch's row order
        (valid until the next step); reads and writes the pools like `model.forward_hidden(batch,
        caches)`. ValueError if not `accepts`."""
        if self.hidden is None:
            raise ValueError("the decode graphs hold logits, not the last layer's stream: call forward")
        n, seqs = self._step(batch)
        rows = self._grouped(self.hidden, seqs)
        return rows.flatten(0, 1) if n == seqs else rows[:, :n].reshape(self.groups * n, *rows.shape[2:])

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        return self.forward(batch)

    # ------------------------------------------------------------------ capture
    def _capture(self, pool, stream: torch.cuda.Stream | None) -> None:
        """One graph per bucket, largest first, every row a padding row (so the warm-up runs and
        the captures write only the scratch rows). Each bucket first runs eagerly on the capture
        stream, so kernels compile and libraries initialise outside the capture."""
        device = self.device
        stream = stream or torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        for seqs in reversed(self.sizes):
            batch = self._static_batch(seqs, (1,) * (self.groups * seqs))
            with torch.cuda.stream(stream):
                self._run(batch, seqs)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._run(batch, seqs)
            except RuntimeError as err:
                raise RuntimeError(f"CUDA graph capture of the {self.kind} step at {seqs} sequences failed ({err}); "
                                   "run with enforce_eager=True (--enforce-eager)") from err
            self.graphs[seqs] = graph
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
