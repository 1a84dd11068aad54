"""Which part of every weight a tensor-parallel rank holds, and the rank's local `ModelConfig`.

Megatron-style sharding of the Qwen3.5 / Qwen3.5-MoE / Qwen3-Next model over N ranks (rank r holds
the r-th contiguous share of every split dimension)::

    embed_tokens, lm_head        rows (vocab)           vocab-parallel: masked lookup + all-reduce;
                                                         logits all-gathered
    GDN in_proj_qkv, conv1d      rows: q | k | v heads   column-parallel (key heads and their value heads)
    GDN in_proj_z/b/a, A_log, dt_bias  value-head rows
    GDN out_proj                 columns                 row-parallel: partial sums, all-reduced once
    attention q_proj (q | gate per head)  head rows      column-parallel
    attention k_proj, v_proj     KV-head rows; when N > HKV, each rank holds the one KV head its query
                                 heads read (replicated N / HKV times)
    attention o_proj             columns                 row-parallel (its bias on rank 0 only)
    MLP / shared expert          gate, up rows; down columns
    routed experts               every expert on every rank, split inside (gate_up rows, down columns)
    router, shared_expert_gate, norms    replicated

Experts are split inside each expert, not across ranks: every rank then runs the same routing and
the same `fused_moe` on a narrower intermediate size, and the routed and shared experts' partial
sums share the MLP block's single all-reduce. Expert parallelism would need a token exchange (or a
masked sum over all experts) per MoE layer; on CPU and for correctness the inside split is the
simpler exact one (whether expert parallelism measures faster on GPUs is for the multi-GPU issue).
The Mamba2 hybrids (`config.mamba2` set) have their own layout: distributed/mamba2_sharding.py.

Block-wise FP8 weights (`config.quantization`) split with their scales: a scale tensor
`<weight>_scale_inv` holds the weight's ranges divided by the block (rows by bn, columns by bk), so every
split of an FP8 weight must fall on a block boundary (`check_shardable` checks the usual splits up
front; any other one is refused at load time, naming the tensor).

Because GDN value head j reads key head j // (HV / H) and attention query head i reads KV head
i // (HQ / HKV), contiguous shares keep each rank's heads self-contained: the local model is the
unchanged model class built with `local_config` (fewer heads, narrower MLPs, a vocab share).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from forkpoint.config import ModelConfig
from forkpoint.distributed.mamba2_sharding import check_mamba2_shardable, mamba2_local_config, mamba2_pieces
from forkpoint.distributed.shares import Pieces, kv_rows, share
from forkpoint.models.fp8_modules import SCALE_SUFFIX


def check_shardable(config: ModelConfig, world: int) -> None:
    """ValueError naming the first size that `world` ranks cannot split, and the fix."""
    if world < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world}")
    if world == 1:
        return
    if config.mamba2 is not None:
        check_mamba2_shardable(config, world)
        return
    sizes = {"vocab_size": config.vocab_size, "num_attention_heads": config.num_attention_heads,
             "linear_num_key_heads": config.linear_num_key_heads, "intermediate_size": config.intermediate_size,
             "moe_intermediate_size": config.moe_intermediate_size,
             "shared_expert_intermediate_size": config.shared_expert_intermediate_size}
    for name, size in sizes.items():
        if size % world:
            raise ValueError(f"tensor_parallel_size {world} does not divide the model's {name} ({size}): "
                             "choose a tensor_parallel_size that divides it")
    kv = config.num_key_value_heads
    if kv % world and world % kv:
        raise ValueError(f"tensor_parallel_size {world} and the model's {kv} KV heads: one must divide the other "
                         "(KV heads are split, or replicated when fewer than the ranks)")
    if config.quantization is not None:
        _check_fp8_shardable(config, world)


def _check_fp8_shardable(config: ModelConfig, world: int) -> None:
    """Every rank's share of the usually-FP8 projections must be whole FP8 blocks (rows of bn for a
    column-parallel split, columns of bk for a row-parallel one)."""
    bn, bk = config.quantization.block
    c = config
    kv_share = c.num_key_value_heads * c.head_dim // world if c.num_key_value_heads >= world else c.head_dim
    rows = {"GDN key heads (in_proj_qkv)": c.linear_num_key_heads * c.linear_key_head_dim // world,
            "GDN value heads (in_proj_qkv, in_proj_z)": c.linear_num_value_heads * c.linear_value_head_dim // world,
            "attention q_proj": 2 * c.num_attention_heads * c.head_dim // world, "attention k_proj / v_proj": kv_share,
            "intermediate_size": c.intermediate_size // world,
            "moe_intermediate_size": c.moe_intermediate_size // world,
            "shared_expert_intermediate_size": c.shared_expert_intermediate_size // world}
    cols = {"GDN out_proj": c.linear_num_value_heads * c.linear_value_head_dim // world,
            "attention o_proj": c.num_attention_heads * c.head_dim // world,
            "intermediate_size (down_proj)": c.intermediate_size // world,
            "moe_intermediate_size (down_proj)": c.moe_intermediate_size // world,
            "shared_expert_intermediate_size (down_proj)": c.shared_expert_intermediate_size // world}
    for sizes, unit, what in ((rows, bn, "rows"), (cols, bk, "columns")):
        for name, size in sizes.items():
            if size % unit:
                raise ValueError(f"tensor_parallel_size {world} gives each rank {size} {what} of the {name}, not a "
                                 f"multiple of the FP8 block's {unit}: choose a tensor_parallel_size whose shares "
                                 "fill whole blocks")


@dataclass(frozen=True)
class ShardLayout:
    """Rank `rank` of `world` holding its share of the model `config` (the full model's config)."""

    config: ModelConfig
    rank: int
    world: int

    def __post_init__(self) -> None:
        check_shardable(self.config, self.world)
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} outside 0 .. {self.world - 1}")

    def local_config(self) -> ModelConfig:
        """The config of this rank's model: its heads, intermediate sizes and vocab share."""
        c, n = self.config, self.world
        if c.mamba2 is not None:
            return mamba2_local_config(c, n)
        return dataclasses.replace(
            c, vocab_size=c.vocab_size // n, num_attention_heads=c.num_attention_heads // n,
            num_key_value_heads=max(1, c.num_key_value_heads // n), linear_num_key_heads=c.linear_num_key_heads // n,
            linear_num_value_heads=c.linear_num_value_heads // n, intermediate_size=c.intermediate_size // n,
            moe_intermediate_size=c.moe_intermediate_size // n,
            shared_expert_intermediate_size=c.shared_expert_intermediate_size // n)

    @property
    def vocab_start(self) -> int:
        """First vocabulary id of this rank's embedding and lm_head rows."""
        return self.rank * (self.config.vocab_size // self.world)

    def _part(self, total: int, offset: int = 0) -> tuple[int, int]:
        return share(total, self.rank, self.world, offset)

    def pieces(self, name: str, shape: tuple[int, ...]) -> Pieces | None:
        """This rank's part of tensor `name` (the model's parameter name, or a checkpoint's per-expert /
        grouped name under `model.`) of full shape `shape`; None when it is replicated."""
        c = self.config
        if name.startswith(("visual.", "model.visual.")):
            return None  # the vision tower is whole (on rank 0)
        if name.endswith(SCALE_SUFFIX) and c.quantization is not None:
            return self._scale_pieces(name, shape)
        if c.mamba2 is not None:
            return mamba2_pieces(c, self.rank, self.world, name, shape)
        leaf, kind = name.split(".")[-2], name.split(".")[-1]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return Pieces(0, (self._part(c.vocab_size),))
        if ".linear_attn." in name:
            key_dim = c.linear_num_key_heads * c.linear_key_head_dim
            value_dim = c.linear_num_value_heads * c.linear_value_head_dim
            if leaf in ("in_proj_qkv", "conv1d"):
                return Pieces(0, (self._part(key_dim), self._part(key_dim, key_dim),
                                  self._part(value_dim, 2 * key_dim)))
            if leaf == "in_proj_z":
                return Pieces(0, (self._part(value_dim),))
            if leaf in ("in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba") or kind in ("A_log", "dt_bias"):
                return Pieces(0, (self._part(shape[0]),))  # grouped qkvz / ba rows are per key head
            if leaf == "out_proj":
                return Pieces(1, (self._part(value_dim),))
            return None
        if ".self_attn." in name:
            if leaf == "q_proj":
                return Pieces(0, (self._part(shape[0]),))
            if leaf in ("k_proj", "v_proj"):
                return Pieces(0, (kv_rows(c, self.rank, self.world),))
            if leaf == "o_proj":
                return Pieces(first_rank_only=True) if kind == "bias" else Pieces(1, (self._part(shape[1]),))
            return None
        if ".mlp." in name:
            if leaf == "experts" and kind == "gate_up_proj":  # fused [E, 2I, H]: gate rows, then up rows
                inter = shape[1] // 2
                return Pieces(1, (self._part(inter), self._part(inter, inter)))
            if leaf == "experts" and kind == "down_proj":  # fused [E, H, I]
                return Pieces(2, (self._part(shape[2]),))
            if leaf in ("gate_proj", "up_proj"):
                return Pieces(0, (self._part(shape[0]),))
            if leaf == "down_proj":
                return Pieces(1, (self._part(shape[1]),))
        return None

    def _scale_pieces(self, name: str, shape: tuple[int, ...]) -> Pieces | None:
        """The pieces of an FP8 weight's block scales [..., rows, cols]: its weight's pieces (that weight
        taken as [..., rows * bn, cols * bk]: exact where it is split, `check_shardable` having made the
        splits whole blocks) divided by the block; ValueError when a piece would cut a block."""
        block = self.config.quantization.block
        weight_shape = (*shape[:-2], shape[-2] * block[0], shape[-1] * block[1])
        pieces = self.pieces(name[: -len(SCALE_SUFFIX)], weight_shape)
        if pieces is None:
            return None
        unit = block[0] if pieces.dim == len(shape) - 2 else block[1]
        if any(start % unit or stop % unit for start, stop in pieces.ranges):
            raise ValueError(f"tensor_parallel_size {self.world} splits {name[: -len(SCALE_SUFFIX)]} at "
                             f"{[list(r) for r in pieces.ranges]}, inside its FP8 blocks of {unit}: choose a "
                             "tensor_parallel_size whose shares fill whole blocks")
        return Pieces(pieces.dim, tuple((start // unit, stop // unit) for start, stop in pieces.ranges))

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full tensor `full` (a view when contiguous ranges allow)."""
        pieces = self.pieces(name, tuple(full.shape))
        if pieces is None:
            return full
        if pieces.first_rank_only:
            return full if self.rank == 0 else torch.zeros_like(full)
        parts = [full.narrow(pieces.dim, start, stop - start) for start, stop in pieces.ranges]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=pieces.dim)

    def read(self, name: str, lazy) -> torch.Tensor:
        """`forkpoint.models.loader.TensorReader` of this rank: reads only its ranges of a safetensors slice."""
        pieces = self.pieces(name, tuple(lazy.get_shape()))
        if pieces is None:
            return lazy[:]
        if pieces.first_rank_only:
            whole = lazy[:]
            return whole if self.rank == 0 else torch.zeros_like(whole)
        lead = (slice(None),) * pieces.dim
        parts = [lazy[lead + (slice(start, stop),)] for start, stop in pieces.ranges]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=pieces.dim)
