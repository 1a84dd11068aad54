"""Which part of every weight of a Mamba2 hybrid (Nemotron-H, Granite-4.0-H, Falcon-H1) a rank holds.

The Mamba2 mixer is split by heads, as vLLM does. Its in_proj rows are five parts, each split on its
own; the conv1d channels follow x | B | C::

    in_proj rows   [ z (I) | x (I) | B (G*N) | C (G*N) | dt (H) ]    z, x, dt: the rank's heads;
    conv1d rows            [ x (I) | B (G*N) | C (G*N) ]             B, C: the rank's groups
    A_log, D, dt_bias, norm.weight   the rank's heads (channels)
    out_proj                         columns: row-parallel, partial sums all-reduced once per block

Groups (B and C): head h reads group h // (H / G). When N divides G each rank holds G / N whole
groups; when G divides N the rank's heads all read one group, which it holds whole (replicated N / G
times); otherwise contiguous head shares would straddle groups unevenly and the model is refused.
The gated RMSNorm normalises `norm_groups` groups of the I channels: local when each rank holds
whole norm groups, else the rank holds a fraction of one and the sum of squares is all-reduced
(distributed/parallel_mamba2.py), so TP=N normalises what TP=1 does.

Falcon-H1's muP multipliers scale the five in_proj parts (one scalar each, as transformers'
`mup_vector` does), so the rank's model applies them to its slices of the same parts. Attention
(q/k/v by heads, KV heads replicated when fewer than ranks, o_proj row-parallel), the MLPs (gate,
up rows; down columns) and the MoE experts (split inside each expert, as for Qwen: up / fused
gate|up rows, down columns; the router replicated) follow distributed/sharding.py. Nemotron-3's
LatentMoE projections are replicated: fc2_latent_proj maps the experts' partial sums linearly, so
its bias is added on rank 0 only. Row-parallel biases live on rank 0 (zero elsewhere).
"""

from __future__ import annotations

import dataclasses

from forkpoint.config import ModelConfig
from forkpoint.distributed.shares import Pieces, kv_rows, share

_EMBEDDINGS = ("model.embeddings.weight", "model.embed_tokens.weight", "lm_head.weight")
_COLUMN = ("q_proj", "up_proj", "gate_proj")  # output rows split (stacked experts: dim 1)
_ROW = ("o_proj", "down_proj", "out_proj", "output_linear")  # input columns split (last dim)
_MAMBA_HEADS = ("A_log", "D", "dt_bias", "norm")


def _check_groups(name: str, groups: int, world: int) -> None:
    if groups % world and world % groups:
        raise ValueError(f"tensor_parallel_size {world} and the Mamba2 mixer's {groups} {name}: one must divide "
                         "the other (whole groups per rank, or one group shared by several ranks)")


def check_mamba2_shardable(config: ModelConfig, world: int) -> None:
    """ValueError naming the first size of the Mamba2 hybrid `config` that `world` ranks cannot split."""
    m = config.mamba2.mamba
    sizes = {"vocab_size": config.vocab_size, "mamba num_heads": m.num_heads,
             "intermediate_size": config.intermediate_size, "moe_intermediate_size": config.moe_intermediate_size,
             "shared_expert_intermediate_size": config.shared_expert_intermediate_size}
    if config.attention_layer_ids:
        sizes["num_attention_heads"] = config.num_attention_heads
    for name, size in sizes.items():
        if size % world:
            raise ValueError(f"tensor_parallel_size {world} does not divide the model's {name} ({size}): "
                             "choose a tensor_parallel_size that divides it")
    kv = config.num_key_value_heads
    if config.attention_layer_ids and kv % world and world % kv:
        raise ValueError(f"tensor_parallel_size {world} and the model's {kv} KV heads: one must divide the other "
                         "(KV heads are split, or replicated when fewer than the ranks)")
    _check_groups("B/C groups (n_groups)", m.n_groups, world)
    _check_groups("norm groups", m.norm_groups, world)


def _local_groups(groups: int, world: int) -> int:
    return groups // world if groups % world == 0 else 1


def mamba2_local_config(config: ModelConfig, world: int) -> ModelConfig:
    """The config of one rank's model: its mamba heads, groups and norm groups, attention heads,
    intermediate sizes and vocab share."""
    c, n, m = config, world, config.mamba2.mamba
    mamba = dataclasses.replace(m, num_heads=m.num_heads // n, n_groups=_local_groups(m.n_groups, n),
                                norm_groups=_local_groups(m.norm_groups, n))
    heads = c.num_attention_heads // n if c.attention_layer_ids else c.num_attention_heads
    return dataclasses.replace(
        c, vocab_size=c.vocab_size // n, num_attention_heads=heads,
        num_key_value_heads=max(1, c.num_key_value_heads // n),
        intermediate_size=c.intermediate_size // n, moe_intermediate_size=c.moe_intermediate_size // n,
        shared_expert_intermediate_size=c.shared_expert_intermediate_size // n,
        mamba2=dataclasses.replace(c.mamba2, mamba=mamba))


def group_rows(config: ModelConfig, rank: int, world: int, offset: int) -> tuple[int, int]:
    """Rows [start, stop) of the B (or C) part, starting at `offset`, that rank `rank` holds."""
    m = config.mamba2.mamba
    if m.n_groups % world == 0:
        return share(m.n_groups * m.state_size, rank, world, offset)
    group = rank // (world // m.n_groups)
    return offset + group * m.state_size, offset + (group + 1) * m.state_size


def _mamba_pieces(config: ModelConfig, rank: int, world: int, leaf: str, kind: str) -> Pieces | None:
    m = config.mamba2.mamba
    inter, gn = m.intermediate_size, m.n_groups * m.state_size
    if leaf == "in_proj":  # [z | x | B | C | dt]
        return Pieces(0, (share(inter, rank, world), share(inter, rank, world, inter),
                          group_rows(config, rank, world, 2 * inter), group_rows(config, rank, world, 2 * inter + gn),
                          share(m.num_heads, rank, world, 2 * inter + 2 * gn)))
    if leaf == "conv1d":  # [x | B | C]
        return Pieces(0, (share(inter, rank, world), group_rows(config, rank, world, inter),
                          group_rows(config, rank, world, inter + gn)))
    if leaf in _MAMBA_HEADS:
        return Pieces(0, (share(m.num_heads if leaf != "norm" else inter, rank, world),))
    if leaf == "out_proj":
        return Pieces(first_rank_only=True) if kind == "bias" else Pieces(1, (share(inter, rank, world),))
    return None


def mamba2_pieces(config: ModelConfig, rank: int, world: int, name: str, shape: tuple[int, ...]) -> Pieces | None:
    """Rank `rank`'s part of tensor `name` (a parameter name, or a checkpoint's per-expert name, under
    `model.`) of full shape `shape`; None when it is replicated."""
    if name in _EMBEDDINGS:
        return Pieces(0, (share(config.vocab_size, rank, world),))
    parts = name.split(".")
    if parts[:2] != ["model", "layers"] or len(parts) < 5:
        return None  # the final norm
    module, kind = parts[3], parts[-1]
    leaf = parts[-2] if kind in ("weight", "bias") else kind
    if module == "mamba" or (module == "mixer" and config.layer_types[int(parts[2])] == "mamba2"):
        return _mamba_pieces(config, rank, world, leaf, kind)
    if leaf in ("k_proj", "v_proj"):
        return Pieces(0, (kv_rows(config, rank, world),))
    dim = 1 if len(shape) == 3 else 0  # stacked experts [E, out, in], else [out, in] or a bias [out]
    if leaf in _COLUMN:
        return Pieces(dim, (share(shape[dim], rank, world),))
    if leaf == "input_linear":  # Granite's fused [gate; up] rows
        half = shape[dim] // 2
        return Pieces(dim, (share(half, rank, world), share(half, rank, world, half)))
    if leaf == "fc2_latent_proj":  # maps the experts' partial sums: the weight replicated, the bias on rank 0
        return Pieces(first_rank_only=True) if kind == "bias" else None
    if leaf in _ROW:
        if kind == "bias":
            return Pieces(first_rank_only=True)
        return Pieces(len(shape) - 1, (share(shape[-1], rank, world),))
    return None
