"""Piecewise forward: the token-wise parts over static buffers, replayed as CUDA graphs per bucket.

A forward of L decoder layers, C of which have a varlen *core* (all of Qwen's; Nemotron-H's MLP and
MoE blocks have none), splits into an eager prologue, C + 1 token-wise *pieces* and C cores
(`embed / project / core / finish / compute_logits` of `HybridForCausalLM` or `Mamba2HybridLM`)::

    embed       token embeddings (+ image rows), rotary cos/sin, on the first T rows   eager
    piece 0     layers before the first core layer (finish only), project core layer 0  graph
    core 0      layer 0's mixer core on the first T rows (reads the ForwardBatch)       eager
    piece 1     finish of layer 0 (mixer out, residual, MLP/MoE) and of the core-less
                layers after it, project the next core layer                          graph
    ...
    piece C     finish of the last core layer and all after it: the stream leaving      graph
    logits      final norm + lm_head on the logits_indices rows                         eager

Pieces depend on the number of rows only through shapes, so one CUDA graph per piece and bucket
(a padded token count Tb >= T) replays them: C + 1 replays and C eager cores per step instead of
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
    projection[kind]: the kind's projection   piece i writes layer i's projections; core i reads rows [:T];
      NamedTuple of [Tmax, ...] tensors       piece i+1 reads z / gate
    stacked[kind] [Tmax, width]               models whose `projection_width(layer)` is not None (Qwen):
                                              the projection GEMM's output, written by `project(...,
                                              stacked_out=stacked[kind][:Tb])`; the projection fields
                                              that are its column views (GDN mixed and z, attention v)
                                              are views of it, so the piece copies only the others
    core_out[kind] [Tmax, *core_shape]        core i writes rows [:T]; piece i+1 reads

One set of projection / core buffers per core kind (`model.core_kind`: "recurrent" for GDN or
Mamba2, "attention", "parallel" for Falcon-H1's attention + Mamba2 layers), shared by the layers
of that kind: piece i+1 reads layer i's buffers before it writes layer i+1's (its outputs are `copy_`-ed
in at its end), and stream order, captured or not, keeps that order. Because every piece copies its
outputs into static buffers, nothing allocated inside a graph outlives its capture, so all graphs
share one memory pool (captured largest bucket first; at replay they never run concurrently).

Recurrent cores (GDN or Mamba2): within one step every recurrent layer's core runs the same
metadata on the same projection / core buffers and differs only in its states and a few
parameters (GDN: the conv weight; Mamba2: conv weight and bias, A_log, D). The pool stacks the
states of all L recurrent layers (`LayerCaches.conv_stack / ssm_stack`, flattened to [L * S, ...]),
so the core of recurrent layer j is `model.recurrent_core` with static inputs,
`recurrent_row_offset` = j * S (a device scalar) and `core_params` (layer j's
`recurrent_core_params` copied in). With graphs, each step runs its first recurrent core eagerly
(Triton / fla compile and autotune, chunk indices upload, outside any capture), captures one graph
of it on the step's metadata into the shared pool, and for every later recurrent layer copies the
offset and parameters in and replays: a few small copies and a replay instead of ~20 eager
launches per phase. A parallel layer's attention half (`model.attention_core`) runs eagerly after
its Mamba2 half. The graph is dropped at the end of the step. Everything it allocates is
transient (its output goes into core_out, final states into the pool by `index_copy_`), so sharing
the pieces' memory pool is safe; a step whose capture fails runs its cores eagerly (warned once).

Padding rows (T..Tb-1) compute token-wise garbage that stays finite: the stream enters piece 0 as
zeros, cos/sin rows only ever hold cos/sin values, core rows hold an earlier step's real outputs (or
zeros); no core, pool or logits row ever reads them. Steps above the largest bucket take the
model's plain forward.

`capture=False` runs the same pieces eagerly on the same buffers, and every recurrent core through
`recurrent_core` with the static offset and parameters set per layer, as the replays do (the CPU
tests of this plumbing).
"""

from __future__ import annotations

import bisect
import logging
import time
import traceback
from collections.abc import Sequence

import torch

from forkpoint.config import ModelConfig
from forkpoint.kernels import select_variant
from forkpoint.models.interface import CausalLM
from forkpoint.step.batch import ForwardBatch
from forkpoint.step.caches import LayerCaches

logger = logging.getLogger("forkpoint")

# The default buckets stop here (the default max_num_batched_tokens). A step's GPU work grows with
# its tokens, its eager launch time does not: from ~4k tokens on (35B-A3B on an H200,
# docs/e2e_h200.md) the GPU work hides the launches and graphs gain a few percent, while the static
# buffers and the graph pool grow with the largest bucket.
MAX_DEFAULT_GRAPH_TOKENS = 8192
# core kinds whose core runs through the stacked states and the per-step core graph
RECURRENT_KINDS = ("recurrent", "parallel")


def capture_failure_cause(err: BaseException) -> str:
    """One line naming why a capture failed: the error's first line and the innermost frame of its
    traceback (the op that broke the capture, e.g. a host sync or an upload inside a kernel wrapper)."""
    message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    frames = traceback.extract_tb(err.__traceback__)
    if not frames:
        return message
    where = frames[-1]
    return f"{message} (raised in {where.name} at {where.filename}:{where.lineno})"


def _zeros_rows(probe: tuple, rows: int) -> tuple:
    """A NamedTuple like `probe` (fields: tensors, NamedTuples of tensors, or None) of zero tensors
    with `rows` rows and the probe's trailing shapes and dtypes."""
    return type(probe)(*(None if t is None else t.new_zeros(rows, *t.shape[1:]) if isinstance(t, torch.Tensor)
                         else _zeros_rows(t, rows) for t in probe))


def _first_rows(buffers: tuple, rows: int) -> tuple:
    """Views of the first `rows` rows of every tensor in `buffers` (a NamedTuple, nested allowed)."""
    return type(buffers)(*(None if t is None else t[:rows] if isinstance(t, torch.Tensor) else _first_rows(t, rows)
                           for t in buffers))


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b are the same elements (strides of size-1 dims do not matter)."""
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype
            and all(n == 1 or x == y for n, x, y in zip(a.shape, a.stride(), b.stride())))


def _copy_into(dst: tuple, src: tuple) -> None:
    """dst.copy_(src) field by field (NamedTuples of the same structure, nested allowed); a field
    that already is its destination (a view of the static stacked projection) is not copied."""
    for d, s in zip(dst, src):
        if isinstance(d, torch.Tensor):
            if not _same_view(d, s):
                d.copy_(s)
        elif d is not None:
            _copy_into(d, s)


def _static_like(probe: tuple, stacked: torch.Tensor, rows: int) -> tuple:
    """`_zeros_rows(probe, rows)`, except that the probe's fields that are views of `stacked` (the
    static stacked projection the probe wrote into) stay those views."""
    base = stacked.untyped_storage().data_ptr()

    def static(t):
        if t is None:
            return None
        if not isinstance(t, torch.Tensor):
            return _static_like(t, stacked, rows)
        return t if t.untyped_storage().data_ptr() == base else t.new_zeros(rows, *t.shape[1:])

    return type(probe)(*(static(t) for t in probe))


def _tensors(tree: tuple) -> list[torch.Tensor]:
    return [t for item in tree for t in ([item] if isinstance(item, torch.Tensor) else
                                         [] if item is None else _tensors(item))]


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

    A captured piece must not synchronise with the host. The routed experts' GPU variants
    (kernels/moe/grouped.py: SwiGLU experts, and Nemotron's ReLU^2 experts) are sync-free but take
    bfloat16 only; other dtypes fall back to the reference, which reads per-expert counts on the host.
    """
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

    def __init__(self, model: CausalLM, sizes: Sequence[int], device: torch.device, *,
                 capture: bool, capture_cores: bool = True) -> None:
        self.model = model
        self.sizes = tuple(sorted({int(size) for size in sizes}))
        if not self.sizes or self.sizes[0] < 1:
            raise ValueError(f"bucket sizes must be token counts >= 1, got {list(sizes)}")
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}: use capture=False")
        self.device = device
        self.num_layers = model.config.num_layers
        self._kinds = [model.core_kind(i) for i in range(self.num_layers)]  # buffer set of each layer
        self._core_layers = [i for i, kind in enumerate(self._kinds) if kind is not None]
        self.num_pieces = len(self._core_layers) + 1
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self._recurrent_index = {layer_id: j for j, layer_id in enumerate(model.config.recurrent_layer_ids)}
        self.capture_cores = capture_cores
        self.core_graph_steps = 0  # steps whose later recurrent cores replayed a captured core
        self.core_capture_failures = 0
        self.core_capture_failure_cause: str | None = None  # the first failure: message and where it was raised
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
                        len(self.sizes), self.sizes[0], self.sizes[-1], self.num_pieces,
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
        self.projection: dict[str, tuple] = {}
        self.stacked: dict[str, torch.Tensor] = {}
        self.core_out: dict[str, torch.Tensor] = {}
        for layer_id in self._core_layers:
            kind = self._kinds[layer_id]
            if kind in self.projection:
                continue
            width = model.projection_width(layer_id)
            if width is None:
                self.projection[kind] = _zeros_rows(model.project(layer_id, hidden, (cos, sin)), rows)
            else:  # a probe of all rows, its GEMM writing into the static stacked buffer (module docstring)
                stacked = hidden.new_zeros(rows, width)
                probe = model.project(layer_id, hidden.new_zeros(rows, *hidden.shape[1:]),
                                      (cos.new_zeros(rows, *cos.shape[1:]), sin.new_zeros(rows, *sin.shape[1:])),
                                      stacked_out=stacked)
                self.projection[kind] = _static_like(probe, stacked, rows)
                self.stacked[kind] = stacked
            self.core_out[kind] = hidden.new_zeros(rows, *model.core_shape(layer_id))
        # the static inputs that select the recurrent layer of `_recurrent_core` (module docstring)
        self.recurrent_row_offset = torch.zeros((), dtype=torch.long, device=device)
        self._recurrent_kind = next((k for k in self._kinds if k in RECURRENT_KINDS), None)
        self.core_params: tuple | None = None
        if self._recurrent_kind is not None:
            params = model.recurrent_core_params(next(iter(self._recurrent_index)))
            self.core_params = type(params)(*(None if t is None else torch.zeros_like(t) for t in params))

    def _projection_rows(self, layer_id: int, rows: int) -> tuple:
        return _first_rows(self.projection[self._kinds[layer_id]], rows)

    def _core_rows(self, layer_id: int, rows: int) -> torch.Tensor:
        return self.core_out[self._kinds[layer_id]][:rows]

    @property
    def num_bytes(self) -> int:
        """Bytes of the static buffers."""
        tensors = [self.residual, self.cos, self.sin, *self.core_out.values(), *self.stacked.values()]
        tensors += _tensors(self.core_params) if self.core_params is not None else []
        stacked = {t.untyped_storage().data_ptr() for t in self.stacked.values()}
        tensors += [t for buffers in self.projection.values() for t in _tensors(buffers)
                    if t.untyped_storage().data_ptr() not in stacked]
        return sum(t.numel() * t.element_size() for t in tensors)

    # ------------------------------------------------------------------ pieces
    def _piece(self, index: int, rows: int) -> None:
        """Piece `index` (0..C) on the first `rows` rows of the static buffers; what it records in a
        graph: the finish of core layer index-1 and of the core-less layers up to core layer `index`,
        whose projections it computes. Reads only static buffers and weights, writes only static
        buffers (copy_ at the end)."""
        model, cores = self.model, self._core_layers
        hidden = self.residual[:rows]
        start = cores[index - 1] if index > 0 else 0
        end = cores[index] if index < len(cores) else self.num_layers
        for layer_id in range(start, end):
            if self._kinds[layer_id] is None:
                hidden = model.finish(layer_id, hidden, None, None)
            else:
                hidden = model.finish(layer_id, hidden, self._projection_rows(layer_id, rows),
                                      self._core_rows(layer_id, rows))
        if index < len(cores):
            cos_sin = (self.cos[:rows], self.sin[:rows])
            stacked = self.stacked.get(self._kinds[end])
            projection = (model.project(end, hidden, cos_sin) if stacked is None
                          else model.project(end, hidden, cos_sin, stacked_out=stacked[:rows]))
            _copy_into(self._projection_rows(end, rows), projection)
        if end > start:
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

    def run_pieces(self, rows: int) -> None:
        """Every piece once, eagerly, at bucket `rows` on the static buffers (what a capture runs
        before recording: its kernels compile; runner/precompile_worker.py)."""
        with torch.inference_mode():
            for index in range(self.num_pieces):
                self._piece(index, rows)

    def _run_piece(self, index: int, rows: int) -> None:
        graphs = self.graphs.get(rows)
        if graphs is None:
            self._piece(index, rows)
        else:
            graphs[index].replay()

    # ------------------------------------------------------------------ recurrent cores
    def _stacked_states(self, caches: LayerCaches) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """(conv [L * S, conv_dim, W-1], ssm [L * S, ...], S) of the pools' stacked states, or None
        when the caches do not stack them (the recurrent cores then run per layer)."""
        conv, ssm = caches.conv_stack, caches.ssm_stack
        if conv is None or ssm is None or self._recurrent_kind is None:
            return None
        conv_row, ssm_row = conv.stride(0) * conv.element_size(), ssm.stride(0) * ssm.element_size()
        for j, (layer_conv, layer_ssm) in enumerate(zip(caches.conv, caches.ssm)):
            if (layer_conv.data_ptr() != conv.data_ptr() + j * conv_row
                    or layer_ssm.data_ptr() != ssm.data_ptr() + j * ssm_row):
                raise ValueError(f"LayerCaches.conv[{j}] / ssm[{j}] are not views of conv_stack[{j}] / "
                                 f"ssm_stack[{j}]: build the caches from one StatePool")
        return conv.flatten(0, 1), ssm.flatten(0, 1), conv.shape[1]

    def _select_recurrent_layer(self, layer_id: int, rows_per_layer: int) -> None:
        """Point the static inputs at recurrent layer `layer_id` (a few device writes, no host sync)."""
        self.recurrent_row_offset.fill_(self._recurrent_index[layer_id] * rows_per_layer)
        _copy_into(self.core_params, self.model.recurrent_core_params(layer_id))

    def _recurrent_core(self, batch: ForwardBatch, num_tokens: int, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """The recurrent core of the layer that the static inputs select, on the recurrent kind's
        buffers' first `num_tokens` rows; what the core graph records. Writes core_out and the pools'
        rows only."""
        kind = self._recurrent_kind
        self.model.recurrent_core(_first_rows(self.projection[kind], num_tokens), batch, conv, ssm, self.core_params,
                                  self.recurrent_row_offset, out=self.core_out[kind][:num_tokens])

    def _capture_recurrent_core(self, batch: ForwardBatch, num_tokens: int, conv: torch.Tensor,
                                ssm: torch.Tensor) -> torch.cuda.CUDAGraph | None:
        """One graph of `_recurrent_core` on this step's metadata, or None (warned once) if capture
        fails. Called right after the step's first, eager recurrent core, so nothing compiles,
        autotunes or uploads inside the capture. Not `torch.cuda.graph`: that synchronises and
        empties the caches."""
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(self._stream):
                # thread_local: a server's other threads may use CUDA while a step captures
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    self._recurrent_core(batch, num_tokens, conv, ssm)
                finally:
                    graph.capture_end()
        except RuntimeError as err:
            if self.core_capture_failure_cause is None:
                self.core_capture_failure_cause = capture_failure_cause(err)
                logger.warning("CUDA graph capture of the recurrent core failed: %s. Steps whose capture fails run "
                               "their recurrent cores eagerly (slower); the count is the metric "
                               "cuda_graph_core_capture_failures", self.core_capture_failure_cause)
                logger.debug("traceback of the failed recurrent core capture", exc_info=err)
            self.core_capture_failures += 1
            return None
        return graph

    @property
    def captured(self) -> bool:
        """Whether the pieces were captured as CUDA graphs (else they run eagerly)."""
        return bool(self.graphs)

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
        return self.model.compute_logits(self.forward_hidden(batch, caches), batch.logits_indices)

    @torch.inference_mode()
    def forward_hidden(self, batch: ForwardBatch, caches: LayerCaches) -> torch.Tensor:
        """The stream leaving the last layer [T, hidden], as the model's `forward_hidden`: a view of the
        static buffer, valid until the next forward (the speculative step reads it within its step).
        Raises ValueError for a batch it does not accept."""
        if not self.accepts(batch):
            raise ValueError(f"the piecewise forward takes steps of at most {self.sizes[-1]} tokens, "
                             f"got {batch.num_tokens} tokens: run the model's forward")
        num_tokens = batch.num_tokens
        rows = self.bucket(num_tokens)
        stacked = self._stacked_states(caches)
        capture_core = self.capture_cores and rows in self.graphs
        core_graph: torch.cuda.CUDAGraph | None = None
        self._embed(batch, rows)
        for index in range(self.num_pieces):
            self._run_piece(index, rows)
            if index == self.num_pieces - 1:
                break
            layer_id = self._core_layers[index]
            kind = self._kinds[layer_id]
            if stacked is None or kind not in RECURRENT_KINDS:
                self.model.core(layer_id, self._projection_rows(layer_id, num_tokens), batch, caches,
                                out=self._core_rows(layer_id, num_tokens))
                continue
            conv, ssm, rows_per_layer = stacked
            self._select_recurrent_layer(layer_id, rows_per_layer)
            if core_graph is not None:
                core_graph.replay()
            else:
                self._recurrent_core(batch, num_tokens, conv, ssm)
                if capture_core:
                    capture_core = False  # one attempt per step
                    core_graph = self._capture_recurrent_core(batch, num_tokens, conv, ssm)
                    self.core_graph_steps += core_graph is not None
            if kind == "parallel":  # its attention half, eagerly after the Mamba2 half
                self.model.attention_core(layer_id, self._projection_rows(layer_id, num_tokens), batch, caches,
                                          out=self._core_rows(layer_id, num_tokens))
        return self.residual[:num_tokens]

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
        self._stream, self._pool = stream, pool  # the per-step recurrent core graphs use them too
        stream.wait_stream(torch.cuda.current_stream(device))
        for rows in reversed(self.sizes):
            with torch.cuda.stream(stream):
                for index in range(self.num_pieces):
                    self._piece(index, rows)
            stream.synchronize()
            graphs = []
            for index in range(self.num_pieces):
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
