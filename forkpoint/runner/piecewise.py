"""Piecewise forward: the token-wise parts over static buffers, replayed as CUDA graphs per bucket.

A forward of L decoder layers splits into an eager prologue, L + 1 token-wise *pieces* and L varlen
*cores* (`HybridForCausalLM.embed / project / core / finish / compute_logits`)::

    embed       token embeddings (+ image rows), rotary cos/sin, on the first T rows   eager
    piece 0     input norm + projections of layer 0                                   graph
    core 0      layer 0's mixer core on the first T rows (reads the ForwardBatch)       eager
    piece 1     finish of layer 0 (mixer out, residual, MLP/MoE), project layer 1       graph
    ...
    piece L     finish of layer L-1: the stream leaving the last layer                  graph
    logits      final norm + lm_head on the logits_indices rows                         eager

Pieces depend on the number of rows only through shapes, so one CUDA graph per piece and bucket
(a padded token count Tb >= T) replays them: L + 1 replays and L eager cores per step instead of
~100 launches per layer. The embedding runs eagerly (a handful of launches) because what it reads
differs per step in ways a graph cannot hold: image steps replace rows with vision-tower outputs
(`embedding_overrides`, M rows) and rotate by [3, T] multi-axis positions. So text and image steps
take the same graphs. Cores are the ops whose launches depend on the step's metadata (decode group,
phases, block tables, host offsets); they run on the real rows only.

Static buffers, allocated once with Tmax = the largest bucket rows and shared by all buckets
(views [:Tb]); every tensor that crosses a piece boundary lives in one of them::

    residual [Tmax, hidden]                   embed writes rows [:T] (rows T..Tb-1 zeroed); piece i > 0:
                                              the stream entering layer i; piece L: the final one
    cos, sin [Tmax, rotary_dim]               embed writes rows [:T]
    projection[kind]: GDNProjection or        piece i writes layer i's projections; core i reads rows [:T];
      AttentionProjection of [Tmax, ...]      piece i+1 reads z / gate
    core_out[kind] [Tmax, heads, dim]         core i writes rows [:T]; piece i+1 reads

One set of projection / core buffers per mixer kind (GDN, attention), shared by the layers of that
kind: piece i+1 reads layer i's buffers before it writes layer i+1's (its outputs are `copy_`-ed
in at its end), and stream order, captured or not, keeps that order. Because every piece copies its
outputs into static buffers, nothing allocated inside a graph outlives its capture, so all graphs
share one memory pool (captured largest bucket first; at replay they never run concurrently).

GDN cores: within one step every GDN layer's core runs the same metadata on the same projection /
core buffers and differs only in its states and conv weight. The pool stacks the states of all L
GDN layers (`LayerCaches.conv_stack / ssm_stack`, flattened to [L * S, ...]), so the core of GDN
layer j is `gdn_core` with two static inputs, `gdn_row_offset` = j * S (a device scalar) and
`gdn_conv_weight` (layer j's conv weight copied in). With graphs, each step runs its first GDN
core eagerly (Triton / fla compile and autotune, chunk indices upload, outside any capture),
captures one graph of it on the step's metadata into the shared pool, and for every later GDN
layer copies the offset and weight in and replays: 2 small copies and a replay instead of ~20
eager launches per phase. The graph is dropped at the end of the step. Everything it allocates is
transient (its output goes into core_out, final states into the pool by `index_copy_`), so sharing
the pieces' memory pool is safe; a step whose capture fails runs its cores eagerly (warned once).

Padding rows (T..Tb-1) compute token-wise garbage that stays finite: the stream enters piece 0 as
zeros, cos/sin rows only ever hold cos/sin values, core rows hold an earlier step's real outputs (or
zeros); no core, pool or logits row ever reads them. Steps above the largest bucket take the
model's plain forward.

`capture=False` runs the same pieces eagerly on the same buffers, and every GDN core through
`gdn_core` with the static offset and weight set per layer, as the replays do (the CPU tests of this
plumbing).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence

import torch

from forkpoint.config import ModelConfig
from forkpoint.kernels import select_variant
from forkpoint.models.qwen3_5 import AttentionProjection, GDNProjection, HybridForCausalLM, LayerCaches
from forkpoint.step.batch import ForwardBatch

logger = logging.getLogger("forkpoint")

# The default buckets stop here (the default max_num_batched_tokens). A step's GPU work grows with
# its tokens, its eager launch time does not: from ~4k tokens on (35B-A3B on an H200,
# docs/e2e_h200.md) the GPU work hides the launches and graphs gain a few percent, while the static
# buffers and the graph pool grow with the largest bucket.
MAX_DEFAULT_GRAPH_TOKENS = 8192


def default_cuda_graph_sizes(max_num_batched_tokens: int) -> tuple[int, ...]:
    """Buckets 1, 2, 4, ..., 256, 384, 512, then multiples of 512, up to
    min(max_num_batched_tokens, 8192), which is always a bucket.

    Trade-off: a step of T tokens computes its token-wise part on the next bucket's rows. Small
    steps (decodes, short prefills) are bound by reading the weights, so rounding them up to a power
    of two costs little; from 512 tokens on the work grows with the rows, and steps of 512 multiples
    waste at most 511 rows (< 12.5% above 4k). Each bucket costs L + 1 captures at start-up (time)
    and CUDA graph objects; the graph memory pool is shared, sized by the largest bucket.
    """
    cap = min(max_num_batched_tokens, MAX_DEFAULT_GRAPH_TOKENS)
    sizes = {1 << i for i in range(9)} | {384} | set(range(512, cap + 1, 512)) | {cap}
    return tuple(sorted(size for size in sizes if size <= cap))


def graph_blocker(config: ModelConfig, dtype: torch.dtype) -> str | None:
    """Why the token-wise pieces of this model cannot be captured on CUDA, or None if they can.

    A captured piece must not synchronise with the host. The routed experts' GPU variant
    (kernels/moe/grouped.py) is sync-free but takes bfloat16 only; other dtypes fall back to the
    reference, which reads per-expert counts on the host. The pieces exist for the Qwen families
    only; the Mamba2 hybrids run eagerly.
    """
    if config.mamba2 is not None:
        return f"piecewise CUDA graphs cover the Qwen families only, not {config.model_type!r}"
    if any(config.moe_layers):
        grouped = select_variant("moe", "grouped", True).__name__.endswith(".grouped")
        if not grouped:
            return ("the grouped MoE kernel does not import (torch._grouped_mm or Triton missing), "
                    "the reference MoE syncs")
        if dtype != torch.bfloat16:
            return f"the grouped MoE kernel needs bfloat16 (dtype is {dtype}), the reference MoE syncs"
    return None


class PiecewiseForward:
    """`forward(batch, caches) -> logits [R, vocab]` float32, equal to `model(batch, caches)` for the
    batches it `accepts`. See the module docstring for the pieces and buffers.

    sizes: bucket token counts (sorted, deduplicated); capture: record one CUDA graph per piece and
    bucket now (device must be CUDA), else run the pieces eagerly on the static buffers;
    capture_cores (with capture): one graph of the GDN core per step, replayed for every GDN layer
    (a plain attribute: the GPU tests time steps with and without it).
    """

    def __init__(self, model: HybridForCausalLM, sizes: Sequence[int], device: torch.device, *,
                 capture: bool, capture_cores: bool = True) -> None:
        self.model = model
        self.sizes = tuple(sorted({int(size) for size in sizes}))
        if not self.sizes or self.sizes[0] < 1:
            raise ValueError(f"bucket sizes must be token counts >= 1, got {list(sizes)}")
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}: use capture=False")
        self.device = device
        self.num_layers = model.config.num_layers
        self._recurrent = [model.is_recurrent(i) for i in range(self.num_layers)]  # buffer set of each layer
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self._gdn_index = {layer_id: j for j, layer_id in enumerate(model.config.gdn_layer_ids)}
        self.capture_cores = capture_cores
        self.core_graph_steps = 0  # steps whose later GDN cores replayed a captured core
        self.core_capture_failures = 0
        self._pool = None  # the graphs' shared memory pool, and the capture stream (CUDA only)
        self._stream: torch.cuda.Stream | None = None
        if capture:
            torch.cuda.synchronize(device)
            free_before, _ = torch.cuda.mem_get_info(device)
            start = time.perf_counter()
        with torch.inference_mode():
            self._allocate()
            if capture:
                with torch.cuda.device(device):  # graphs replay on their capture device's current stream
                    self._capture()
        if capture:
            free_after, _ = torch.cuda.mem_get_info(device)
            logger.info("CUDA graphs: %d buckets (%d..%d tokens) x %d pieces captured in %.1f s, %.0f MiB of GPU "
                        "memory (static buffers %.0f MiB; the rest is the shared graph pool and the graphs)",
                        len(self.sizes), self.sizes[0], self.sizes[-1], self.num_layers + 1,
                        time.perf_counter() - start, (free_before - free_after) / 2**20, self.num_bytes / 2**20)

    # ------------------------------------------------------------------ buffers
    def _allocate(self) -> None:
        """Static buffers of Tmax rows; dtypes and trailing shapes from a one-token probe of the
        model's own parts (so they follow whatever the parts return)."""
        rows, model, device = self.sizes[-1], self.model, self.device
        token = torch.zeros(1, dtype=torch.long, device=device)
        hidden, (cos, sin) = model.embed(token, token)
        self.residual = hidden.new_zeros(rows, *hidden.shape[1:])
        self.cos = cos.new_zeros(rows, *cos.shape[1:])
        self.sin = sin.new_zeros(rows, *sin.shape[1:])
        self.projection: dict[bool, GDNProjection | AttentionProjection] = {}
        self.core_out: dict[bool, torch.Tensor] = {}
        for layer_id, kind in enumerate(self._recurrent):
            if kind not in self.projection:
                probe = model.project(layer_id, hidden, (cos, sin))
                self.projection[kind] = type(probe)(*(t.new_zeros(rows, *t.shape[1:]) for t in probe))
                self.core_out[kind] = hidden.new_zeros(rows, *model.core_shape(layer_id))
        # the static inputs that select the GDN layer of `_gdn_core` (module docstring)
        self.gdn_row_offset = torch.zeros((), dtype=torch.long, device=device)
        if self._gdn_index:
            self.gdn_conv_weight = torch.zeros_like(model.gdn_conv_weight(next(iter(self._gdn_index))))

    def _projection_rows(self, layer_id: int, rows: int) -> GDNProjection | AttentionProjection:
        buffers = self.projection[self._recurrent[layer_id]]
        return type(buffers)(*(t[:rows] for t in buffers))

    def _core_rows(self, layer_id: int, rows: int) -> torch.Tensor:
        return self.core_out[self._recurrent[layer_id]][:rows]

    @property
    def num_bytes(self) -> int:
        """Bytes of the static buffers."""
        tensors = [self.residual, self.cos, self.sin, *self.core_out.values()]
        tensors += [self.gdn_conv_weight] if self._gdn_index else []
        tensors += [t for buffers in self.projection.values() for t in buffers]
        return sum(t.numel() * t.element_size() for t in tensors)

    # ------------------------------------------------------------------ pieces
    def _piece(self, index: int, rows: int) -> None:
        """Piece `index` (0..L) on the first `rows` rows of the static buffers; what it records in a
        graph. Reads only static buffers and weights, writes only static buffers (copy_ at the end)."""
        model = self.model
        hidden = self.residual[:rows]
        if index > 0:
            layer_id = index - 1
            hidden = model.finish(layer_id, hidden, self._projection_rows(layer_id, rows),
                                  self._core_rows(layer_id, rows))
        if index < self.num_layers:
            projection = model.project(index, hidden, (self.cos[:rows], self.sin[:rows]))
            for dst, src in zip(self._projection_rows(index, rows), projection):
                dst.copy_(src)
        if index > 0:
            self.residual[:rows].copy_(hidden)

    def _embed(self, batch: ForwardBatch, rows: int) -> None:
        """The eager prologue: the step's embeddings (image rows replaced) into residual[:T] and its
        rotary tables (from the [3, T] multi-axis positions when present) into cos / sin[:T]; the
        stream's padding rows T..rows-1 are zeroed (cos / sin padding rows keep an earlier step's
        values, finite by construction), so the garbage the pieces compute there stays finite."""
        num_tokens = batch.num_tokens
        positions = batch.positions if batch.mrope_positions is None else batch.mrope_positions
        hidden, (cos, sin) = self.model.embed(batch.input_ids, positions, batch.embedding_overrides)
        self.residual[:num_tokens].copy_(hidden)
        self.cos[:num_tokens].copy_(cos)
        self.sin[:num_tokens].copy_(sin)
        if rows > num_tokens:
            self.residual[num_tokens:rows].zero_()

    def _run_piece(self, index: int, rows: int) -> None:
        graphs = self.graphs.get(rows)
        if graphs is None:
            self._piece(index, rows)
        else:
            graphs[index].replay()

    # ------------------------------------------------------------------ GDN cores
    def _stacked_states(self, caches: LayerCaches) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """(conv [L * S, conv_dim, W-1], ssm [L * S, HV, K, V], S) of the pools' stacked states, or None
        when the caches do not stack them (the GDN cores then run per layer)."""
        conv, ssm = caches.conv_stack, caches.ssm_stack
        if conv is None or ssm is None or not self._gdn_index:
            return None
        conv_row, ssm_row = conv.stride(0) * conv.element_size(), ssm.stride(0) * ssm.element_size()
        for j, (layer_conv, layer_ssm) in enumerate(zip(caches.conv, caches.ssm)):
            if (layer_conv.data_ptr() != conv.data_ptr() + j * conv_row
                    or layer_ssm.data_ptr() != ssm.data_ptr() + j * ssm_row):
                raise ValueError(f"LayerCaches.conv[{j}] / ssm[{j}] are not views of conv_stack[{j}] / "
                                 f"ssm_stack[{j}]: build the caches from one StatePool")
        return conv.flatten(0, 1), ssm.flatten(0, 1), conv.shape[1]

    def _select_gdn_layer(self, layer_id: int, rows_per_layer: int) -> None:
        """Point the static inputs at GDN layer `layer_id` (two device writes, no host sync)."""
        self.gdn_row_offset.fill_(self._gdn_index[layer_id] * rows_per_layer)
        self.gdn_conv_weight.copy_(self.model.gdn_conv_weight(layer_id))

    def _gdn_core(self, batch: ForwardBatch, num_tokens: int, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """The core of the GDN layer that the static inputs select, on the GDN buffers' first
        `num_tokens` rows; what the core graph records. Writes core_out and the pools' rows only."""
        projection = self.projection[True]
        self.model.gdn_core(type(projection)(*(t[:num_tokens] for t in projection)), batch, conv, ssm,
                            self.gdn_conv_weight, self.gdn_row_offset, out=self.core_out[True][:num_tokens])

    def _capture_gdn_core(self, batch: ForwardBatch, num_tokens: int, conv: torch.Tensor,
                          ssm: torch.Tensor) -> torch.cuda.CUDAGraph | None:
        """One graph of `_gdn_core` on this step's metadata, or None (warned once) if capture fails.
        Called right after the step's first, eager GDN core, so nothing compiles, autotunes or uploads
        inside the capture. Not `torch.cuda.graph`: that synchronises and empties the caches."""
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(self._stream):
                # thread_local: a server's other threads may use CUDA while a step captures
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    self._gdn_core(batch, num_tokens, conv, ssm)
                finally:
                    graph.capture_end()
        except RuntimeError as err:
            if not self.core_capture_failures:
                logger.warning("CUDA graph capture of the GDN core failed (%s); steps whose capture fails run "
                               "their GDN cores eagerly", err)
            self.core_capture_failures += 1
            return None
        return graph

    @property
    def captured(self) -> bool:
        """Whether the pieces were captured as CUDA graphs (else they run eagerly)."""
        return bool(self.graphs)

    @property
    def memory_pool(self):
        """The graphs' shared memory pool handle (None without capture): other whole-step graphs that
        never run concurrently with these (runner/decode_graphs.py) share it."""
        return self._pool

    @property
    def capture_stream(self) -> torch.cuda.Stream | None:
        """The side stream the graphs were captured on (None without capture)."""
        return self._stream

    # ------------------------------------------------------------------ forward
    def bucket(self, num_tokens: int) -> int:
        """The smallest bucket holding `num_tokens` rows (`accepts` must hold)."""
        return self.sizes[bisect.bisect_left(self.sizes, num_tokens)]

    def accepts(self, batch: ForwardBatch) -> bool:
        """Steps (text or images) of at most the largest bucket's tokens."""
        return batch.num_tokens <= self.sizes[-1]

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, caches: LayerCaches) -> torch.Tensor:
        """Logits [R, vocab] float32 of `batch.logits_indices`; reads and writes the pools like the
        model's forward. Raises ValueError for a batch it does not accept."""
        if not self.accepts(batch):
            raise ValueError(f"the piecewise forward takes steps of at most {self.sizes[-1]} tokens, "
                             f"got {batch.num_tokens} tokens: run the model's forward")
        num_tokens = batch.num_tokens
        rows = self.bucket(num_tokens)
        stacked = self._stacked_states(caches)
        capture_core = self.capture_cores and rows in self.graphs
        core_graph: torch.cuda.CUDAGraph | None = None
        self._embed(batch, rows)
        for index in range(self.num_layers + 1):
            self._run_piece(index, rows)
            if index == self.num_layers:
                break
            if stacked is None or not self._recurrent[index]:
                self.model.core(index, self._projection_rows(index, num_tokens), batch, caches,
                                out=self._core_rows(index, num_tokens))
                continue
            conv, ssm, rows_per_layer = stacked
            self._select_gdn_layer(index, rows_per_layer)
            if core_graph is not None:
                core_graph.replay()
                continue
            self._gdn_core(batch, num_tokens, conv, ssm)
            if capture_core:
                capture_core = False  # one attempt per step
                core_graph = self._capture_gdn_core(batch, num_tokens, conv, ssm)
                self.core_graph_steps += core_graph is not None
        return self.model.compute_logits(self.residual[:num_tokens], batch.logits_indices)

    def __call__(self, batch: ForwardBatch, caches: LayerCaches) -> torch.Tensor:
        return self.forward(batch, caches)

    # ------------------------------------------------------------------ capture
    def _capture(self) -> None:
        """One graph per piece and bucket, largest bucket first, all in one memory pool. Each bucket
        first runs its pieces eagerly on the capture stream, so kernels compile and autotune and
        libraries initialise (cuBLAS workspaces) outside the capture."""
        device = self.device
        stream = torch.cuda.Stream(device)
        pool = torch.cuda.graph_pool_handle()
        self._stream, self._pool = stream, pool  # the per-step GDN core graphs use them too
        stream.wait_stream(torch.cuda.current_stream(device))
        for rows in reversed(self.sizes):
            with torch.cuda.stream(stream):
                for index in range(self.num_layers + 1):
                    self._piece(index, rows)
            stream.synchronize()
            graphs = []
            for index in range(self.num_layers + 1):
                graph = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        self._piece(index, rows)
                except RuntimeError as err:
                    raise RuntimeError(
                        f"CUDA graph capture of piece {index} at {rows} tokens failed ({err}); a token-wise op "
                        "probably synchronises with the host: run with enforce_eager=True (--enforce-eager)"
                    ) from err
                graphs.append(graph)
            self.graphs[rows] = graphs
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the warm-ups' cached blocks: free again for the pools' sizing
