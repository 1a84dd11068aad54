"""Configuration of the Mamba2 hybrids (Nemotron-H, Granite-4.0-H, Falcon-H1), read from the HF
`config.json` of each family into `ModelConfig` fields plus one `Mamba2HybridConfig`.

Layer kinds (`ModelConfig.layer_types`): "mamba2" (a Mamba2 mixer), "full_attention", "mlp", "moe"
(Nemotron-H blocks hold one of these four), and "parallel" (Falcon-H1: attention and Mamba2 side
by side on the same input). Granite-4.0-H layers are "mamba2" or "full_attention", each followed
by its MoE + shared MLP (or the shared MLP alone).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAMBA2_MODEL_TYPES = ("nemotron_h", "granitemoehybrid", "falcon_h1")
_NEMOTRON_PATTERN = {"M": "mamba2", "*": "full_attention", "-": "mlp", "E": "moe"}
_LAYER_NAMES = {"linear_attention": "mamba2", "mamba": "mamba2", "attention": "full_attention",
                "full_attention": "full_attention", "mlp": "mlp", "moe": "moe"}


@dataclass(frozen=True)
class Mamba2Config:
    """One Mamba2 mixer: in_proj -> (z [I], xBC [I + 2 G N], dt [H]); causal conv over xBC; SSD
    with H heads of P channels, G groups of B/C with state size N; gated RMSNorm; out_proj.

    dt = clamp(softplus(dt + dt_bias), dt_min, dt_max). The gated norm normalises `norm_groups`
    groups of I / norm_groups channels; `norm_before_gate`: w * norm(y) * silu(z), else
    w * norm(y * silu(z)); without `gated_norm` the output is y * silu(z) (Falcon-H1's option).
    `in_multiplier` scales the mixer input and `proj_multipliers` the five in_proj outputs
    (z, x, B, C, dt) (Falcon-H1's muP; 1.0 elsewhere).
    """

    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    conv_bias: bool
    in_proj_bias: bool
    out_proj_bias: bool
    chunk_size: int
    dt_min: float
    dt_max: float
    norm_eps: float
    gated_norm: bool = True
    norm_before_gate: bool = False
    norm_groups: int = 1
    in_multiplier: float = 1.0
    proj_multipliers: tuple[float, float, float, float, float] = (1.0, 1.0, 1.0, 1.0, 1.0)

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    def validate(self) -> None:
        if self.num_heads % self.n_groups:
            raise ValueError(f"mamba heads {self.num_heads} must be a multiple of the B/C groups {self.n_groups}")
        if self.intermediate_size % self.norm_groups:
            raise ValueError(f"mamba intermediate size {self.intermediate_size} must be a multiple of the norm groups "
                             f"{self.norm_groups}")
        if not 0.0 <= self.dt_min <= self.dt_max:
            raise ValueError(f"time_step_limit ({self.dt_min}, {self.dt_max}) must satisfy 0 <= min <= max")


@dataclass(frozen=True)
class Mamba2HybridConfig:
    """Everything a Mamba2 hybrid needs beyond the shared `ModelConfig` fields.

    family: the HF model_type. mlp_act: "silu" (gated SwiGLU MLPs) or "relu2" (Nemotron-H's
    non-gated up/down MLPs and experts). Router (MoE layers): "softmax_topk" (Granite: softmax
    of the top-k logits) or "sigmoid_grouped" (Nemotron-3: sigmoid scores plus the correction
    bias pick n_group groups -> topk_group -> top-k experts, weights from the raw scores,
    renormalised when norm_topk_prob, times routed_scaling_factor). Multipliers are 1.0 unless the
    family's config sets them (Granite: embedding / residual / attention / logits_scaling;
    Falcon-H1: embedding, lm_head, key, attention in/out, ssm out, mlp gate/down).
    """

    family: str
    mamba: Mamba2Config
    mlp_act: str = "silu"
    mlp_bias: bool = False
    router: str = "softmax_topk"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    moe_latent_size: int | None = None  # Nemotron-3 LatentMoE: experts run in this width (None: hidden)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_scale: float | None = None  # None: head_dim ** -0.5
    logits_scaling: float = 1.0  # logits are divided by it (Granite)
    lm_head_multiplier: float = 1.0  # logits are multiplied by it (Falcon-H1)
    key_multiplier: float = 1.0
    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0
    mlp_multipliers: tuple[float, float] = (1.0, 1.0)  # (gate, down)


def _limit(raw: dict, default_min: float = 0.0) -> tuple[float, float]:
    limit = raw.get("time_step_limit") or (default_min, math.inf)
    low, high = (float(v["__float__"]) if isinstance(v, dict) else float(v) for v in limit)
    return low, high


def _layer_types(raw: dict, model_type: str) -> tuple[str, ...]:
    if model_type == "falcon_h1":
        return ("parallel",) * int(raw["num_hidden_layers"])
    if model_type == "nemotron_h":
        names = raw.get("layers_block_type")
        if names is None:
            pattern = raw.get("hybrid_override_pattern")
            if not pattern:
                raise ValueError("nemotron_h config has neither layers_block_type nor hybrid_override_pattern")
            unknown = sorted(set(pattern) - set(_NEMOTRON_PATTERN))
            if unknown:
                raise ValueError(f"hybrid_override_pattern has unknown layer codes {unknown}: forkpoint knows "
                                 f"{sorted(_NEMOTRON_PATTERN)}")
            return tuple(_NEMOTRON_PATTERN[c] for c in pattern)
    else:
        names = raw.get("layer_types") or raw.get("layers_block_type") or ["mamba"] * int(raw["num_hidden_layers"])
    unknown = sorted(set(names) - set(_LAYER_NAMES))
    if unknown:
        raise ValueError(f"unsupported layer types {unknown} in {model_type} config: forkpoint knows "
                         f"{sorted(_LAYER_NAMES)}")
    kinds = tuple(_LAYER_NAMES[n] for n in names)
    if model_type == "granitemoehybrid" and set(kinds) - {"mamba2", "full_attention"}:
        raise ValueError("granitemoehybrid layer_types must be mamba or attention layers")
    return kinds


def _head_dim(raw: dict, key: str, intermediate: int, heads: int) -> int:
    value = raw.get(key, "auto")
    return intermediate // heads if value in (None, "auto") else int(value)


def mamba2_hybrid_fields(raw: dict) -> dict:
    """`ModelConfig` keyword arguments (all but eos ids, weight prefix and vision) for a Mamba2
    hybrid's raw config.json. Raises ValueError for settings forkpoint does not implement."""
    model_type = raw["model_type"]
    layer_types = _layer_types(raw, model_type)
    hidden = int(raw["hidden_size"])
    num_heads = int(raw["num_attention_heads"])
    head_dim = int(raw.get("head_dim") or hidden // num_heads)
    rope = dict(raw.get("rope_parameters") or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"unsupported rope_type {rope_type!r}: only 'default' rotary embeddings are implemented")
    common = {"model_type": model_type, "vocab_size": int(raw["vocab_size"]), "hidden_size": hidden,
              "num_layers": len(layer_types), "layer_types": layer_types, "num_attention_heads": num_heads,
              "num_key_value_heads": int(raw.get("num_key_value_heads") or num_heads), "head_dim": head_dim,
              "rope_theta": float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
              "attention_bias": bool(raw.get("attention_bias", False)),
              "linear_num_key_heads": 0, "linear_num_value_heads": 0, "linear_key_head_dim": 0,
              "linear_value_head_dim": 0,
              "linear_conv_kernel_dim": 0, "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
              "max_position_embeddings": int(raw.get("max_position_embeddings", 4096))}
    if model_type == "nemotron_h":
        return {**common, **_nemotron(raw, layer_types)}
    if model_type == "granitemoehybrid":
        return {**common, **_granite(raw, layer_types, hidden, head_dim)}
    return {**common, **_falcon(raw, layer_types, hidden, head_dim)}


def _nemotron(raw: dict, layer_types: tuple[str, ...]) -> dict:
    if raw.get("mlp_hidden_act", "relu2") != "relu2" or raw.get("mamba_hidden_act", "silu") != "silu":
        raise ValueError("nemotron_h: only mlp_hidden_act 'relu2' and mamba_hidden_act 'silu' are implemented")
    heads, head_dim = int(raw.get("mamba_num_heads", 128)), int(raw.get("mamba_head_dim", 64))
    groups = int(raw.get("n_groups", raw.get("mamba_n_groups", 8)))
    # transformers' Nemotron-H mixer clamps dt below at time_step_min (not time_step_limit[0])
    mamba = Mamba2Config(num_heads=heads, head_dim=head_dim, n_groups=groups,
                         state_size=int(raw.get("ssm_state_size", 128)), conv_kernel=int(raw.get("conv_kernel", 4)),
                         conv_bias=bool(raw.get("use_conv_bias", True)), in_proj_bias=bool(raw.get("use_bias", False)),
                         out_proj_bias=bool(raw.get("use_bias", False)), chunk_size=int(raw.get("chunk_size", 128)),
                         dt_min=float(raw.get("time_step_min", 0.001)), dt_max=math.inf,
                         norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)), norm_groups=groups)
    num_experts = int(raw.get("n_routed_experts", 0) or 0) if "moe" in layer_types else 0
    hybrid = Mamba2HybridConfig(family="nemotron_h", mamba=mamba, mlp_act="relu2", mlp_bias=bool(raw.get("mlp_bias")),
                                router="sigmoid_grouped", n_group=int(raw.get("n_group", 1)),
                                topk_group=int(raw.get("topk_group", 1)),
                                routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
                                moe_latent_size=int(raw["moe_latent_size"]) if raw.get("moe_latent_size") else None)
    # transformers' NemotronHForCausalLM ties nothing (`_tied_weights_keys = {}`): lm_head is its own tensor
    # whatever tie_word_embeddings says
    return {"rms_norm_eps": float(raw.get("layer_norm_epsilon", 1e-5)), "rotary_dim": 0, "attention_bias": False,
            "tie_word_embeddings": False,
            "intermediate_size": int(raw.get("intermediate_size", 0) or 0), "num_experts": num_experts,
            "num_experts_per_tok": int(raw.get("num_experts_per_tok", 0) or 0),
            "moe_intermediate_size": int(raw.get("moe_intermediate_size", 0) or 0),
            "shared_expert_intermediate_size": int(raw.get("moe_shared_expert_intermediate_size", 0) or 0),
            "norm_topk_prob": bool(raw.get("norm_topk_prob", True)),
            "moe_layers": tuple(kind == "moe" for kind in layer_types), "mamba2": hybrid}


def _granite(raw: dict, layer_types: tuple[str, ...], hidden: int, head_dim: int) -> dict:
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError("granitemoehybrid: only hidden_act 'silu' is implemented")
    heads = int(raw.get("mamba_n_heads", 128))
    intermediate = int(raw.get("mamba_expand", 2) * hidden)
    groups = int(raw.get("mamba_n_groups", 1))
    dt_min, dt_max = _limit(raw)
    mamba = Mamba2Config(num_heads=heads, head_dim=_head_dim(raw, "mamba_d_head", intermediate, heads),
                         n_groups=groups, state_size=int(raw.get("mamba_d_state", 256)),
                         conv_kernel=int(raw.get("mamba_d_conv", 4)), conv_bias=bool(raw.get("mamba_conv_bias", True)),
                         in_proj_bias=bool(raw.get("mamba_proj_bias", False)),
                         out_proj_bias=bool(raw.get("mamba_proj_bias", False)),
                         chunk_size=int(raw.get("mamba_chunk_size", 256)), dt_min=dt_min, dt_max=dt_max,
                         norm_eps=float(raw.get("rms_norm_eps", 1e-6)), norm_groups=groups)
    if mamba.intermediate_size != intermediate:
        raise ValueError(f"granitemoehybrid mamba_n_heads * mamba_d_head = {mamba.intermediate_size} differs from "
                         f"mamba_expand * hidden_size = {intermediate}")
    num_experts = int(raw.get("num_local_experts", 0) or 0)
    hybrid = Mamba2HybridConfig(family="granitemoehybrid", mamba=mamba,
                                embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
                                residual_multiplier=float(raw.get("residual_multiplier", 1.0)),
                                attention_scale=float(raw.get("attention_multiplier", 1.0)),
                                logits_scaling=float(raw.get("logits_scaling", 1.0)))
    rope = raw.get("position_embedding_type") == "rope"
    return {"rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)), "rotary_dim": head_dim if rope else 0,
            "intermediate_size": int(raw.get("shared_intermediate_size", 0) or 0), "num_experts": num_experts,
            "num_experts_per_tok": int(raw.get("num_experts_per_tok", 0) or 0),
            "moe_intermediate_size": int(raw.get("intermediate_size", 0) or 0),
            "shared_expert_intermediate_size": int(raw.get("shared_intermediate_size", 0) or 0),
            "norm_topk_prob": True, "moe_layers": (num_experts > 0,) * len(layer_types), "mamba2": hybrid}


def _falcon(raw: dict, layer_types: tuple[str, ...], hidden: int, head_dim: int) -> dict:
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError("falcon_h1: only hidden_act 'silu' is implemented")
    heads = int(raw.get("mamba_n_heads", 128))
    intermediate = int(raw.get("mamba_d_ssm") or raw.get("mamba_expand", 2) * hidden)
    dt_min, dt_max = _limit(raw)
    mamba = Mamba2Config(num_heads=heads, head_dim=_head_dim(raw, "mamba_d_head", intermediate, heads),
                         n_groups=int(raw.get("mamba_n_groups", 1)), state_size=int(raw.get("mamba_d_state", 256)),
                         conv_kernel=int(raw.get("mamba_d_conv", 4)), conv_bias=bool(raw.get("mamba_conv_bias", True)),
                         in_proj_bias=bool(raw.get("mamba_proj_bias", False)),
                         out_proj_bias=bool(raw.get("projectors_bias", False)),
                         chunk_size=int(raw.get("mamba_chunk_size", 256)), dt_min=dt_min, dt_max=dt_max,
                         norm_eps=float(raw.get("rms_norm_eps", 1e-5)), gated_norm=bool(raw.get("mamba_rms_norm")),
                         norm_before_gate=bool(raw.get("mamba_norm_before_gate", True)),
                         norm_groups=int(raw.get("mamba_n_groups", 1)),
                         in_multiplier=float(raw.get("ssm_in_multiplier", 1.0)),
                         proj_multipliers=tuple(float(m) for m in raw.get("ssm_multipliers") or (1.0,) * 5))
    if mamba.intermediate_size != intermediate:
        raise ValueError(f"falcon_h1 mamba_n_heads * mamba_d_head = {mamba.intermediate_size} differs from the "
                         f"mamba intermediate size {intermediate} (mamba_d_ssm)")
    if len(mamba.proj_multipliers) != 5:
        raise ValueError("falcon_h1 ssm_multipliers must have five entries (z, x, B, C, dt)")
    gate, down = (float(m) for m in raw.get("mlp_multipliers") or (1.0, 1.0))
    hybrid = Mamba2HybridConfig(family="falcon_h1", mamba=mamba, mlp_bias=bool(raw.get("mlp_bias", False)),
                                embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
                                lm_head_multiplier=float(raw.get("lm_head_multiplier", 1.0)),
                                key_multiplier=float(raw.get("key_multiplier", 1.0)),
                                attention_in_multiplier=float(raw.get("attention_in_multiplier", 1.0)),
                                attention_out_multiplier=float(raw.get("attention_out_multiplier", 1.0)),
                                ssm_out_multiplier=float(raw.get("ssm_out_multiplier", 1.0)),
                                mlp_multipliers=(gate, down))
    return {"rms_norm_eps": float(raw.get("rms_norm_eps", 1e-5)), "rotary_dim": head_dim,
            "intermediate_size": int(raw.get("intermediate_size", 0) or 0), "num_experts": 0, "num_experts_per_tok": 0,
            "moe_intermediate_size": 0, "shared_expert_intermediate_size": 0, "norm_topk_prob": True,
            "moe_layers": (False,) * len(layer_types), "mamba2": hybrid}
