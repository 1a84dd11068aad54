"""The model interface: every method the runner, the piecewise CUDA-graph forward
(runner/piecewise.py), the whole-step decode graphs (runner/decode_graphs.py), warm-up and tensor
parallelism (distributed/) call on a model.

Every family's class (models/registry.py) is a `torch.nn.Module` that satisfies `CausalLM`:
`HybridForCausalLM` (models/qwen3_5.py) and `Mamba2HybridLM` (models/mamba2_lm.py) with its
families. tests/models/test_interface.py checks each registered class against it.

A decoder layer runs in three parts (so that everything token-wise replays as CUDA graphs and only
the varlen part runs eagerly)::

    project   token-wise: input norm, the mixer's projections        -> a NamedTuple of [T, ...] tensors
    core      varlen: reads the ForwardBatch and the pools' rows      -> [T, *core_shape(layer)]
              (recurrent: the two-phase driver of models/recurrent.py; attention: KV write,
              copy-on-write, paged attention, models/attention_core.py)
    finish    token-wise: mixer output, residual, MLP / MoE           -> [T, hidden]

`forward(batch, caches)` is exactly `embed`, then project / core / finish per layer (layers whose
`core_kind` is None: finish only), then `compute_logits`. T is the step's token count; hidden,
cos and sin are in the model dtype.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, Protocol, runtime_checkable

import torch
from torch import nn

from forkpoint.cache.sizing import PoolShapes
from forkpoint.config import ModelConfig
from forkpoint.step.batch import ForwardBatch
from forkpoint.step.caches import LayerCaches

# "recurrent": a GDN or Mamba2 core; "attention": an attention core; "parallel": Falcon-H1's
# attention and Mamba2 side by side on one input; None: a token-wise-only layer (no project / core)
CoreKind = Literal["recurrent", "attention", "parallel"] | None


@runtime_checkable
class CausalLM(Protocol):
    """A hybrid causal LM as the runner drives it. Attributes: `config` (the full model's, or a
    tensor-parallel rank's local one), `visual` (the vision tower, or None), `lm_head`, `mtp` (the
    multi-token-prediction head of speculative decoding, models/mtp.py, or None; its KV is the last
    attention layer of `pool_shapes`)."""

    config: ModelConfig
    visual: nn.Module | None
    lm_head: nn.Module
    mtp: nn.Module | None

    # ------------------------------------------------------------------ set-up
    def pool_shapes(self, dtype: torch.dtype) -> PoolShapes:
        """What the pools hold per sequence (cache/sizing.py): the attention layers' KV heads and
        head size, and the recurrent layers' state spec from their mixer's `state_spec`, in `dtype`."""
        ...

    def input_embeddings(self) -> nn.Embedding:
        """The token embedding (the loaders tie lm_head to it when the config says so)."""
        ...

    def init_buffers(self, device: torch.device) -> None:
        """Recompute the non-persistent buffers (rotary tables) on `device` after `to_empty`."""
        ...

    # ------------------------------------------------------------------ the whole forward
    def forward(self, batch: ForwardBatch, caches: LayerCaches) -> torch.Tensor:
        """Logits [R, vocab] float32 of the rows `batch.logits_indices` [R]; reads and writes the
        pools' rows in `caches` (recurrent states of the step's slots, KV of its blocks)."""
        ...

    def forward_hidden(self, batch: ForwardBatch, caches: LayerCaches) -> torch.Tensor:
        """The stream leaving the last layer [T, hidden] (`forward` is `compute_logits` of it); the
        speculative path reads every row of it (runner/speculative.py)."""
        ...

    def norm_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [T, hidden] leaving the last layer -> its final norm [T, hidden] (lm_head's input)."""
        ...

    # ------------------------------------------------------------------ parts (runner/piecewise.py)
    def core_kind(self, layer_id: int) -> CoreKind:
        """Which core layer `layer_id` has (`CoreKind`); None: token-wise only."""
        ...

    def core_shape(self, layer_id: int) -> tuple[int, ...]:
        """Trailing shape of layer `layer_id`'s core output: (HV, V) for GDN, (H, P) for Mamba2,
        (HQ, Dh) for attention, (H * P + HQ * Dh,) for a parallel layer."""
        ...

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor,
              embedding_overrides: tuple[torch.Tensor, torch.Tensor] | None = None,
              ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """input_ids: [T] long; positions: [T] long, or [3, T] (multi-axis rotary of image steps)
        -> hidden [T, hidden] and the rotary tables (cos, sin) [T, rotary_dim] ([T, 0] without
        rotary). `embedding_overrides` (index [M] long, embeds [M, hidden]) replace rows with the
        vision tower's outputs (text-only models raise ValueError). Token-wise without overrides."""
        ...

    def projection_width(self, layer_id: int) -> int | None:
        """Columns of layer `layer_id`'s stacked projection GEMM (the `stacked_out` of `project`),
        or None when its `project` takes no `stacked_out`."""
        ...

    def project(self, layer_id: int, hidden: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                stacked_out: torch.Tensor | None = None) -> NamedTuple:
        """hidden: [T, hidden], the stream entering the layer -> its mixer projections, a NamedTuple
        of [T, ...] tensors (nested NamedTuples allowed, e.g. a parallel layer's). Token-wise. With
        `stacked_out` [T, projection_width(layer_id)] the GEMM writes there and the fields that
        are its column views are views of it (the piecewise forward's static buffer)."""
        ...

    def core(self, layer_id: int, p: NamedTuple, batch: ForwardBatch, caches: LayerCaches,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's varlen part on the step's T tokens (p: its `project` output, T rows exactly):
        reads `batch`, reads and writes the layer's pool rows -> [T, *core_shape(layer_id)], written
        into `out` when given (every row)."""
        ...

    def attention_core(self, layer_id: int, p: NamedTuple, batch: ForwardBatch, caches: LayerCaches,
                       out: torch.Tensor) -> None:
        """The attention part of layer `layer_id`'s core into its columns of `out` [T, *core_shape]:
        the whole core of an "attention" layer, the attention half of a "parallel" one (whose Mamba2
        half ran through `recurrent_core`). ValueError for a layer without attention."""
        ...

    def recurrent_core_params(self, layer_id: int) -> NamedTuple:
        """The per-layer parameters recurrent layer `layer_id`'s core reads (views of the
        parameters, a NamedTuple of tensors or None; GDN: the conv weight; Mamba2: conv weight and
        bias, A_log, D). All recurrent layers' tuples have the same structure and shapes."""
        ...

    def recurrent_core(self, p: NamedTuple, batch: ForwardBatch, conv_states: torch.Tensor, ssm_states: torch.Tensor,
                       params: NamedTuple, row_offset: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The recurrent core of the layer that device data selects: conv_states [L * S, conv_dim,
        W-1] and ssm_states [L * S, ...] fp32 are `caches.conv_stack / ssm_stack` flattened,
        row_offset (0-dim long) = j * S and params = `recurrent_core_params` of the j-th recurrent
        layer. Equal to that layer's (recurrent part of its) core; writes its rows of `out`
        [T, *core_shape] and returns the recurrent part. One CUDA graph of it serves every layer."""
        ...

    def finish(self, layer_id: int, residual: torch.Tensor, p: NamedTuple | None,
               core: torch.Tensor | None) -> torch.Tensor:
        """residual: [T, hidden], the stream entering the layer; p, core: its projection and core
        output (None for a token-wise-only layer) -> the stream leaving the layer [T, hidden].
        Token-wise."""
        ...

    def compute_logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """hidden: [T, hidden], the stream leaving the last layer; logits_indices: [R] long ->
        [R, vocab] float32 (final norm and lm_head on those rows only)."""
        ...
