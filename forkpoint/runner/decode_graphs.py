"""Decode steps as full CUDA graphs: one replay per step, attention and recurrent cores inside it.

A *decode step* is a step whose every segment is one token of a running sequence: no recurrent
phase, no copy-on-write, no image rows. Its metadata differs from step to step only in values, not
in shapes, once the number of sequences N is rounded up to a bucket Nb and the block tables are
padded to a fixed width. So the whole forward (embedding, every layer's projections, GDN conv and
in-place delta rule, KV write and paged attention, MoE, final norm and lm_head) is captured once
per bucket and replayed: one launch per step instead of ~2,400 (35B-A3B).

Static buffers (Nmax = the largest bucket; every bucket reads rows [:Nb]); each step copies its
ForwardBatch into them, then replays::

    input_ids, positions, slot_mapping, seq_lens, slots   [Nmax] long
    block_tables                                          [Nmax, max_blocks] int32 (columns past the
                                                          step's own width keep stale block ids: a
                                                          row reads only its first ceil(seq_len / bs))
    cu_q = 0, 1, ..., Nmax; logits_indices = 0, ..., Nmax-1    constant (one query per row)
    logits                                                [Nmax, vocab] float32, the graph's output

Padding rows N..Nb-1 decode token 0 at position 0 on the pools' scratch rows: KV slot = the first
slot of `BlockPool.scratch_block` (block table row [scratch_block], seq_len 1), state slot =
`StatePool.scratch_slot`. They write only those scratch rows (all at once, so the values there race;
nothing ever reads them but padding rows), so every other pool row is written exactly as by the
eager decode of the N real rows, and everything the padding rows compute stays finite. The padding
is reset on every step (a larger step may have left real slots in those rows).

The forward inside the graph is `HybridForCausalLM.forward` itself on a ForwardBatch of static
views, so graph and eager decodes run the same code; they differ only where kernels see Nb instead
of N rows (GEMM tiling), i.e. to bf16 rounding. The decode graphs share one memory pool of their own
(largest bucket first; they never run concurrently, and nothing allocated in a capture outlives it:
the logits are copied into the static buffer), apart from the piecewise graphs' pool.

`capture=False` runs the same static-buffer path eagerly (CPU tests of the plumbing and padding).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence

import torch

from forkpoint.models.interface import CausalLM
from forkpoint.step.batch import AttentionMetadata, DecodeGroup, ForwardBatch
from forkpoint.step.caches import LayerCaches

logger = logging.getLogger("forkpoint")


def decode_bucket_sizes(graph_sizes: Sequence[int], max_seqs: int) -> tuple[int, ...]:
    """The buckets of `graph_sizes` a decode step of at most `max_seqs` sequences can need: those
    below max_seqs and the first one at or above it (all of them when none is)."""
    sizes = sorted({int(s) for s in graph_sizes})
    cut = bisect.bisect_left(sizes, max_seqs)
    return tuple(sizes[: cut + 1])


class DecodeGraphs:
    """`forward(batch) -> logits [N, vocab]` float32 for the decode steps it `accepts`, equal (to bf16
    rounding on CUDA) to `model(batch, caches)`, with the same pool writes.

    sizes: bucket sequence counts; max_blocks: block-table width the buffers hold (steps with wider
    tables are not accepted); scratch_kv_slot: flat KV slot of the padding rows (a slot of the
    scratch block, whose index is `scratch_block`); scratch_state_slot: their state row. capture:
    record one graph per bucket now (CUDA) into `pool` on `stream`; else run eagerly.
    """

    def __init__(self, model: CausalLM, caches: LayerCaches, sizes: Sequence[int], max_blocks: int, *,
                 scratch_block: int, block_size: int, scratch_state_slot: int, device: torch.device,
                 capture: bool, pool=None, stream: torch.cuda.Stream | None = None) -> None:
        self.model, self.caches, self.device = model, caches, device
        self.sizes = tuple(sorted({int(s) for s in sizes}))
        if not self.sizes or self.sizes[0] < 1:
            raise ValueError(f"decode bucket sizes must be sequence counts >= 1, got {list(sizes)}")
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}: use capture=False")
        self.max_blocks = max_blocks
        self.scratch_block = scratch_block
        self.scratch_kv_slot = scratch_block * block_size
        self.scratch_state_slot = scratch_state_slot
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = 0  # steps served by a replay (or, without capture, by the static path)
        rows = self.sizes[-1]
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(rows, **long)
        self.positions = torch.zeros(rows, **long)
        self.slot_mapping = torch.zeros(rows, **long)
        self.seq_lens = torch.zeros(rows, **long)
        self.slots = torch.zeros(rows, **long)
        self.block_tables = torch.zeros(rows, max_blocks, dtype=torch.int32, device=device)
        self.cu_q = torch.arange(rows + 1, **long)
        self.logits_indices = torch.arange(rows, **long)
        self.no_copies = torch.zeros(0, **long)
        self.logits = torch.zeros(rows, model.config.vocab_size, dtype=torch.float32, device=device)
        self._pad(0, rows)
        if capture:
            torch.cuda.synchronize(device)
            free_before, _ = torch.cuda.mem_get_info(device)
            start = time.perf_counter()
            with torch.inference_mode(), torch.cuda.device(device):
                self._capture(pool, stream)
            free_after, _ = torch.cuda.mem_get_info(device)
            logger.info("decode CUDA graphs: %d buckets (%d..%d sequences) captured in %.1f s, %.0f MiB of GPU memory",
                        len(self.sizes), self.sizes[0], self.sizes[-1], time.perf_counter() - start,
                        (free_before - free_after) / 2**20)

    # ------------------------------------------------------------------ metadata
    def accepts(self, batch: ForwardBatch) -> bool:
        """Text decode steps of at most the largest bucket's sequences and max_blocks table columns."""
        decode, meta = batch.decode, batch.attention
        n = batch.num_tokens
        return (decode is not None and decode.num_tokens == n and not batch.phases and 0 < n <= self.sizes[-1]
                and batch.mrope_positions is None and batch.embedding_overrides is None
                and meta.cow_src.numel() == 0 and meta.block_tables.shape[1] <= self.max_blocks
                and batch.logits_indices.shape[0] == n)

    def bucket(self, num_seqs: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, num_seqs)]

    def _pad(self, lo: int, hi: int) -> None:
        """Rows lo..hi-1 become padding rows (module docstring)."""
        if hi <= lo:
            return
        self.input_ids[lo:hi].zero_()
        self.positions[lo:hi].zero_()
        self.slot_mapping[lo:hi].fill_(self.scratch_kv_slot)
        self.seq_lens[lo:hi].fill_(1)
        self.slots[lo:hi].fill_(self.scratch_state_slot)
        self.block_tables[lo:hi, 0].fill_(self.scratch_block)

    def _load(self, batch: ForwardBatch, rows: int) -> None:
        """The step's metadata into rows [:N] of the static buffers, padding into rows N..rows-1
        (device copies only, no host sync)."""
        n, meta = batch.num_tokens, batch.attention
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.slots[:n].copy_(batch.decode.slots)
        self.block_tables[:n, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        self._pad(n, rows)

    def _static_batch(self, rows: int, seq_lens_host: Sequence[int]) -> ForwardBatch:
        """A ForwardBatch of static views for `rows` rows. The host tuples matter only to the CPU
        reference kernels (the GPU kernels read the device tensors), so captured graphs keep the
        capture-time ones."""
        attention = AttentionMetadata(
            slot_mapping=self.slot_mapping[:rows], block_tables=self.block_tables[:rows],
            cu_seqlens_q=self.cu_q[: rows + 1], cu_seqlens_q_host=tuple(range(rows + 1)),
            seq_lens=self.seq_lens[:rows], seq_lens_host=tuple(seq_lens_host),
            cow_src=self.no_copies, cow_dst=self.no_copies)
        return ForwardBatch(input_ids=self.input_ids[:rows], positions=self.positions[:rows],
                            decode=DecodeGroup(rows, self.slots[:rows]), phases=(), attention=attention,
                            logits_indices=self.logits_indices[:rows])

    def _run(self, batch: ForwardBatch, rows: int) -> None:
        """What a graph records: the model's forward on the static batch, logits into the buffer."""
        self.logits[:rows].copy_(self.model(batch, self.caches))

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [N, vocab] float32 (a view of the static buffer, valid until the next step);
        reads and writes the pools like `model(batch, caches)`. ValueError if not `accepts`."""
        if not self.accepts(batch):
            raise ValueError("the decode graphs take text decode steps of at most "
                             f"{self.sizes[-1]} sequences and {self.max_blocks} block-table columns")
        n = batch.num_tokens
        rows = self.bucket(n)
        self._load(batch, rows)
        graph = self.graphs.get(rows)
        if graph is None:
            self._run(self._static_batch(rows, tuple(batch.attention.seq_lens_host) + (1,) * (rows - n)), rows)
        else:
            graph.replay()
        self.replays += 1
        return self.logits[:n]

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
        for rows in reversed(self.sizes):
            batch = self._static_batch(rows, (1,) * rows)
            with torch.cuda.stream(stream):
                self._run(batch, rows)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._run(batch, rows)
            except RuntimeError as err:
                raise RuntimeError(f"CUDA graph capture of the decode step at {rows} sequences failed ({err}); "
                                   "run with enforce_eager=True (--enforce-eager)") from err
            self.graphs[rows] = graph
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
