"""Model shapes of `e2e_gpu.py` besides its default (Qwen3.5-35B-A3B, defined there): configs as
the published config.json files give them, a tiny config of the same family for the smoke test,
and the parameter count a prompt token passes through (for MFU).

nemotron3-nano: NVIDIA-Nemotron-3-Nano-30B-A3B (`nemotron_h`, 52 blocks: 23 Mamba2, 23 MoE of 128
ReLU^2 experts (top 6) + one shared expert, 6 attention). The values are those of the model's
published config.json (nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 on the Hugging Face Hub,
"transformers_version": "4.55.4"), read from a verbatim copy in a public repository's test
(nemotron3_jax's model test, NEMOTRON3_30B_JSON) and cross-checked against two other public copies
(same pattern, widths, expert counts); fields that only training reads are left out.

qwen3-next-80b-a3b: Qwen3-Next-80B-A3B (`qwen3_next`, 48 layers: 36 Gated DeltaNet, every 4th full
attention, each followed by a MoE of 512 experts (top 10) + one shared expert). Every architecture
number is a default of transformers' `Qwen3NextConfig` (transformers 5.24.0,
models/qwen3_next/configuration_qwen3_next.py, whose docstring names those defaults "the
Qwen3-Next-80B-A3B style configuration", checkpoint Qwen/Qwen3-Next-80B-A3B-Instruct): vocab 151936,
hidden 2048, 48 layers, full_attention_interval 4, 16 query / 2 KV heads of 256, partial rotary 0.25,
GDN 16 key / 32 value heads of 128, conv kernel 4, 512 experts, top 10, moe_intermediate_size 512,
shared_expert_intermediate_size 512, norm_topk_prob, rms_norm_eps 1e-6, untied embeddings,
decoder_sparse_step 1, no mlp_only_layers; the same numbers as the model card (48 layers, hidden 2048,
16 Q / 2 KV heads of 256, 32 V / 16 QK linear heads of 128, 512 experts with 10 routed + 1 shared).
Three fields differ from those defaults, taken from the published config.json as two public
repositories' tests transcribe it (a C++ loader's Qwen3-Next config test, "The release's config.json,
transcribed", and a Rust config-deserialisation test; both give the architecture numbers above too):
max_position_embeddings 262144 (also the model card's native context; transformers' default is 32768),
rope_theta 5000000 (transformers' default 10000; it changes no kernel, shape or cost) and
intermediate_size 5120 (5632; unused: the dense MLP of mlp_only_layers, and every layer is MoE). The
tokenizer is a word-level one of the vocabulary's size, as for Nemotron (the Qwen3.5 tokenizer the
default shape copies has 248k tokens, more than 151936).

FP8 shapes (`with_fp8`): the same config.json plus the `quantization_config` of Qwen's block-wise FP8
releases (Qwen3.5-35B-A3B-FP8, Qwen3-Next-80B-A3B-Instruct-FP8): quant_method fp8, fmt e4m3,
activation_scheme dynamic, weight_block_size [128, 128], and `modules_to_not_convert` naming the
modules the releases keep in bf16 (the router `mlp.gate`, the shared expert's gate, the GDN's
in_proj_b / in_proj_a, Qwen3-Next's fused in_proj_ba, embeddings and lm_head; norms and the GDN's
conv / A_log / dt_bias are not projections, never FP8). `modules_to_not_convert` matches whole dotted
components, so these leaf names select those modules in every layer, as per-layer full names would.
`load_format="dummy"` then builds FP8 weights for every other projection and the routed experts
(forkpoint/models/fp8_modules.py).
"""

from __future__ import annotations

import copy

NEMOTRON3_NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"


def nemotron3_nano_config() -> dict:
    """NVIDIA-Nemotron-3-Nano-30B-A3B (see the module docstring for the source)."""
    return {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "vocab_size": 131072,
        "hidden_size": 2688,
        "num_hidden_layers": 52,
        "hybrid_override_pattern": NEMOTRON3_NANO_PATTERN,
        "num_attention_heads": 32,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "attention_bias": False,
        "mamba_num_heads": 64,
        "mamba_head_dim": 64,
        "n_groups": 8,
        "ssm_state_size": 128,
        "conv_kernel": 4,
        "expand": 2,
        "chunk_size": 128,
        "use_conv_bias": True,
        "use_bias": False,
        "mamba_proj_bias": False,
        "mamba_hidden_act": "silu",
        "mamba_ssm_cache_dtype": "float32",
        "time_step_min": 0.001,
        "time_step_max": 0.1,
        "time_step_floor": 0.0001,
        "n_routed_experts": 128,
        "n_shared_experts": 1,
        "num_experts_per_tok": 6,
        "moe_intermediate_size": 1856,
        "moe_shared_expert_intermediate_size": 3712,
        "intermediate_size": 1856,
        "mlp_hidden_act": "relu2",
        "mlp_bias": False,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "layer_norm_epsilon": 1e-05,
        "norm_eps": 1e-05,
        "residual_in_fp32": False,
        "rescale_prenorm_residual": True,
        "partial_rotary_factor": 1.0,
        "rope_theta": 10000,
        "max_position_embeddings": 262144,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
    }


def nemotron3_nano_tiny_config() -> dict:
    """The same family and vocabulary at tiny sizes (every block kind; smoke test and CPU dry run)."""
    cfg = nemotron3_nano_config()
    cfg.update(hidden_size=128, num_hidden_layers=7, hybrid_override_pattern="MEMEM*E", num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, mamba_num_heads=4, mamba_head_dim=64, n_groups=2,
               ssm_state_size=64, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
               moe_shared_expert_intermediate_size=64, intermediate_size=64, max_position_embeddings=32768)
    return cfg


def nemotron_param_counts(cfg: dict) -> dict:
    """Parameters from the config. per_token: the matmul weights one prompt token passes through
    (Mamba2 in/out projections, attention, router, top-k routed experts, shared expert), without
    embedding and lm_head."""
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    inner = cfg["mamba_num_heads"] * cfg["mamba_head_dim"]
    bc = 2 * cfg["n_groups"] * cfg["ssm_state_size"]
    mamba = hidden * (2 * inner + bc + cfg["mamba_num_heads"]) + inner * hidden
    heads, kv_heads, head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    attn = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    experts, top_k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    expert = 2 * hidden * cfg["moe_intermediate_size"]  # up, down (no gate)
    shared = 2 * hidden * cfg["moe_shared_expert_intermediate_size"]
    mlp = 2 * hidden * cfg["intermediate_size"]
    pattern = cfg["hybrid_override_pattern"]
    active = {"M": mamba, "*": attn, "E": hidden * experts + top_k * expert + shared, "-": mlp}
    total = {**active, "E": hidden * experts + experts * expert + shared}
    return {
        "per_token": sum(active[c] for c in pattern),
        "lm_head": hidden * vocab,
        "embedding": hidden * vocab,
        "total_matmul": sum(total[c] for c in pattern) + 2 * hidden * vocab,
        "blocks": {c: pattern.count(c) for c in sorted(set(pattern))},
    }


def save_word_tokenizer(directory, vocab_size: int) -> None:
    """A word-level tokenizer of vocab_size - 1 tokens ("<pad>", "<s>", "</s>", then t3, t4, ...),
    so every id a random-weight model can sample decodes and the checkpoint marker, registered on
    load, takes the last id. The benchmark's prompts are token ids: only the size matters (the
    Qwen3.5 tokenizer the default shape copies has 248k tokens, more than Nemotron's 131072)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials + [f"t{i}" for i in range(len(specials), vocab_size - 1)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(directory)


# ---------------------------------------------------------------- Qwen3-Next-80B-A3B and FP8

QWEN_FP8_NOT_CONVERTED = ("lm_head", "embed_tokens", "mlp.gate", "shared_expert_gate", "in_proj_a", "in_proj_b",
                          "in_proj_ba")


def qwen3_next_80b_config() -> dict:
    """Qwen3-Next-80B-A3B (see the module docstring for the source of each number)."""
    layers = 48
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "num_hidden_layers": layers,
        "full_attention_interval": 4,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.25},
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "intermediate_size": 5120,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "max_position_embeddings": 262144,
    }


def qwen_tiny_sizes() -> dict:
    """The tiny sizes of a Qwen3.5-MoE / Qwen3-Next config (both layer kinds; smoke tests and CPU dry runs)."""
    return dict(
        hidden_size=128, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=64, linear_value_head_dim=64, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=64, shared_expert_intermediate_size=64, max_position_embeddings=32768)


def qwen3_next_tiny_config() -> dict:
    """The same family and vocabulary at tiny sizes (both layer kinds; smoke test and CPU dry run)."""
    return {**qwen3_next_80b_config(), **qwen_tiny_sizes(), "intermediate_size": 128}


def fp8_quantization_config(block: tuple[int, int] = (128, 128)) -> dict:
    """The `quantization_config` of Qwen's block-wise FP8 releases (module docstring), with `block`."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block),
            "modules_to_not_convert": list(QWEN_FP8_NOT_CONVERTED)}


def with_fp8(cfg: dict, block: tuple[int, int] = (128, 128)) -> dict:
    """A copy of config.json `cfg` with the FP8 releases' `quantization_config` (weights of `block`).
    The tiny configs take 64 x 64 blocks, so that each of their widths (64, 128, 256) is whole blocks."""
    out = copy.deepcopy(cfg)
    out["quantization_config"] = fp8_quantization_config(block)
    return out
