"""Tiny random Hugging Face checkpoints for tests, built with transformers (the oracle) and saved
with `save_pretrained`, plus a small word-level tokenizer, so that forkpoint's real loading code runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

VOCAB = 160
WORDS = [f"w{i}" for i in range(VOCAB - 8)]
EOS = "<|im_end|>"
# multimodal models' tokenizers: words w0..w149 (ids 5..154), then the image tokens (special, as in the
# real vocabulary); the checkpoint marker is registered after them, at VOCAB - 1
VISION_TOKENS = {"<|vision_end|>": VOCAB - 5, "<|vision_start|>": VOCAB - 4, "<|video_pad|>": VOCAB - 3,
                 "<|image_pad|>": VOCAB - 2}
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
               spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
# multimodal text models rotate 8 dims (4 frequencies: T, H, W, T) so every mrope axis is exercised
_MROPE = dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                   mrope_section=[2, 1, 1]))
_VISION_IDS = dict(vision_end_token_id=VOCAB - 5, vision_start_token_id=VOCAB - 4, video_token_id=VOCAB - 3,
                   image_token_id=VOCAB - 2)
# preprocessing of the tiny multimodal models: 8x8-pixel tokens, at most 16 tokens per image
PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 4, "merge_size": 2,
                "temporal_patch_size": 2, "size": {"shortest_edge": 64, "longest_edge": 1024},
                "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)

_GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
            linear_conv_kernel_dim=4)
_ATTN = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, rms_norm_eps=1e-6,
               max_position_embeddings=4096, eos_token_id=1, tie_word_embeddings=False,
               layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"])
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)


# Mamba2 hybrids: groups < heads, d_state 16, chunk sizes below the test prompts' lengths
_NEMOTRON = dict(vocab_size=VOCAB, hidden_size=64, max_position_embeddings=4096, eos_token_id=1, pad_token_id=0,
                 tie_word_embeddings=False, layers_block_type=["mamba", "moe", "attention", "mlp", "mamba", "moe"],
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, mamba_num_heads=8,
                 mamba_head_dim=8, ssm_state_size=16, n_groups=2, conv_kernel=4, n_routed_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, n_group=2,
                 topk_group=1, routed_scaling_factor=1.5, chunk_size=16)
_GRANITE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, max_position_embeddings=4096, eos_token_id=1,
                pad_token_id=0, tie_word_embeddings=False, layer_types=["mamba", "mamba", "attention", "mamba"],
                num_attention_heads=4, num_key_value_heads=2, intermediate_size=32, shared_intermediate_size=48,
                num_local_experts=4, num_experts_per_tok=2, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2,
                mamba_d_state=16, mamba_chunk_size=16, position_embedding_type="rope", embedding_multiplier=2.0,
                logits_scaling=3.0, residual_multiplier=0.5, attention_multiplier=0.2)
_FALCON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, max_position_embeddings=4096, eos_token_id=1,
               pad_token_id=0, tie_word_embeddings=False, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               intermediate_size=96, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2,
               mamba_d_state=16, mamba_chunk_size=16, mamba_rms_norm=True, mamba_norm_before_gate=False,
               embedding_multiplier=1.5, lm_head_multiplier=0.8, key_multiplier=0.9, attention_in_multiplier=1.1,
               attention_out_multiplier=0.7, ssm_in_multiplier=1.2, ssm_out_multiplier=0.6,
               ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.3], mlp_multipliers=[1.2, 0.7])
MAMBA2_MODEL_TYPES = ("nemotron_h", "granitemoehybrid", "falcon_h1")


def _randomize_mamba2(model: torch.nn.Module, seed: int) -> None:
    """Random A_log, D, dt_bias, correction biases and norms (transformers' init makes them
    constant), so the oracle test sees every parameter."""
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.rand(param.shape, generator=generator) * 2.0 - 1.0)
            elif name.endswith((".D", "dt_bias")):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
            elif "norm" in name:
                param.copy_(1.0 + torch.randn(param.shape, generator=generator) * 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.1)


def save_tokenizer(directory: Path, *, vision: bool = False) -> None:
    """Word-level tokenizer: ids 0..4 special, then w0, w1, ... (space separated); with `vision`, the
    words stop at w149 and the image tokens of `VISION_TOKENS` follow (special: no spaces needed)."""
    specials = ["<|endoftext|>", EOS, "<|im_start|>", "user", "assistant"]
    vocab = {tok: i for i, tok in enumerate(specials + (WORDS[: VOCAB - 10] if vision else WORDS))}
    if vision:
        vocab.update(VISION_TOKENS)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>", *(VISION_TOKENS if vision else ())])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """transformers initialises norms to identity; randomise them so the oracle test sees them."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
            elif name.endswith("gate.weight"):
                param.normal_(0.0, 0.3, generator=generator)
            elif "embed" in name or "lm_head" in name:
                param.normal_(0.0, 0.5, generator=generator)


def build_tiny_model(directory: Path, model_type: str, *, fused_experts: bool = False, seed: int = 0,
                     **overrides):
    """Save a tiny random model of `model_type` into `directory`; return the transformers model (float32, eval).

    `overrides` replace config entries of the text model (only for "qwen3_5_moe_text", "qwen3_5_moe"
    and the Mamba2 hybrids; the vision tower's output width follows `hidden_size`), e.g. head sizes
    of 64 for the GPU kernels."""
    import transformers as tf

    torch.manual_seed(seed)
    if overrides and model_type not in ("qwen3_5_moe_text", "qwen3_5_text", "qwen3_next", "qwen3_5_moe",
                                        *MAMBA2_MODEL_TYPES):
        raise ValueError("config overrides are supported for the Qwen text families, qwen3_5_moe and the Mamba2 "
                         "hybrids")
    if model_type == "qwen3_5_moe_text":
        model = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**{**_COMMON, **_GDN, **_ATTN, **_MOE, **overrides}))
    elif model_type == "qwen3_5_text":
        model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**{**_COMMON, **_GDN, **_ATTN, "intermediate_size": 96,
                                                              **overrides}))
    elif model_type == "qwen3_next":
        config = {**_COMMON, **_GDN, **_ATTN, **_MOE, "intermediate_size": 96, "decoder_sparse_step": 1,
                  "mlp_only_layers": [1], "norm_topk_prob": True, **overrides}
        model = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**config))
    elif model_type == "qwen3_5_moe":
        text = {**_COMMON, **_GDN, **_ATTN, **_MOE, **_MROPE, **overrides}
        vision = {**_VISION, "out_hidden_size": text["hidden_size"]}
        config = tf.Qwen3_5MoeConfig(text_config=text, vision_config=vision, **_VISION_IDS)
        model = tf.Qwen3_5MoeForConditionalGeneration(config)
    elif model_type == "nemotron_h":
        model = tf.NemotronHForCausalLM(tf.NemotronHConfig(**{**_NEMOTRON, **overrides}))
    elif model_type == "granitemoehybrid":
        model = tf.GraniteMoeHybridForCausalLM(tf.GraniteMoeHybridConfig(**{**_GRANITE, **overrides}))
    elif model_type == "falcon_h1":
        model = tf.FalconH1ForCausalLM(tf.FalconH1Config(**{**_FALCON, **overrides}))
    elif model_type == "qwen3_5":
        config = tf.Qwen3_5Config(text_config=dict(**_COMMON, **_GDN, **_ATTN, **_MROPE, intermediate_size=96),
                                  vision_config=_VISION, **_VISION_IDS)
        model = tf.Qwen3_5ForConditionalGeneration(config)
    else:
        raise ValueError(model_type)
    _randomize(model, seed)
    if model_type in MAMBA2_MODEL_TYPES:
        _randomize_mamba2(model, seed)
    model = model.float().eval()
    model.save_pretrained(directory, safe_serialization=True)
    multimodal = model_type in ("qwen3_5_moe", "qwen3_5")
    save_tokenizer(directory, vision=multimodal)
    if multimodal:
        (directory / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))
    if fused_experts:
        fuse_expert_tensors(directory)
    return model


def fuse_expert_tensors(directory: Path) -> None:
    """Rewrite per-expert tensors into the released checkpoints' fused layout
    (`mlp.experts.gate_up_proj [E, 2I, H]`, `mlp.experts.down_proj [E, H, I]`)."""
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    grouped: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for name, tensor in tensors.items():
        if ".mlp.experts." in name and name.split(".mlp.experts.")[1].split(".")[0].isdigit():
            base, rest = name.split(".mlp.experts.")
            index, kind = rest.split(".")[0], rest.split(".")[1]
            grouped.setdefault(base, {}).setdefault(int(index), {})[kind] = tensor
        else:
            out[name] = tensor
    for base, experts in grouped.items():
        order = sorted(experts)
        out[f"{base}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]]) for e in order])
        out[f"{base}.mlp.experts.down_proj"] = torch.stack([experts[e]["down_proj"] for e in order])
    save_file(out, str(path), metadata={"format": "pt"})


def words(*indices: int) -> str:
    return " ".join(WORDS[i] for i in indices)


def token_words(seed: int, n: int) -> str:
    """n seeded random words of the tiny vocabulary (indices below 150)."""
    return words(*torch.randint(0, 150, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


def image_processor_oracle(directory: Path):
    """transformers' Qwen3-VL processor (PIL image backend, no video processor) for a tiny
    multimodal model directory: the oracle for input ids, pixel values and grids."""
    import transformers as tf
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    class ImageOnlyProcessor(tf.Qwen3VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                             chat_template=chat_template)

    settings = {k: v for k, v in PREPROCESSOR.items() if k != "image_processor_type"}
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(directory))
    return ImageOnlyProcessor(image_processor=Qwen2VLImageProcessorPil(**settings), tokenizer=tokenizer)


def random_image(seed: int, width: int, height: int, mode: str = "RGB"):
    """A seeded noise image (PIL) of the given size and mode."""
    import numpy as np
    from PIL import Image

    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode=mode)


def add_mtp_weights(source: Path, directory: Path, seed: int = 0) -> None:
    """Copy the tiny checkpoint in `source` into `directory` with a random MTP head added, as the
    Qwen3.5 / Qwen3-Next releases store it (transformers implements no MTP head): `mtp.fc` [H, 2H],
    `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.norm` and one decoder layer
    `mtp.layers.0.*` named and shaped like the checkpoint's own full-attention layer (its attention
    and norms) and MoE layer (its feed-forward, per-expert or fused as stored; a dense one when the
    model has no experts); config.json declares it (`mtp_num_hidden_layers`, in `text_config` for
    the multimodal ones, or Qwen3-Next's `num_nextn_predict_layers`)."""
    import shutil

    shutil.copytree(source, directory, dirs_exist_ok=True)
    config = json.loads((directory / "config.json").read_text())
    text = config.get("text_config", config)
    if config["model_type"] == "qwen3_next":
        config["num_nextn_predict_layers"] = 1
    else:
        text["mtp_num_hidden_layers"] = 1
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    layer_types = text["layer_types"]
    attention = layer_types.index("full_attention")
    has_experts = any(".mlp.experts." in name for name in tensors)
    generator = torch.Generator().manual_seed(seed)
    head: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if ".layers." not in name:
            continue
        prefix, rest = name.split(".layers.", 1)
        layer, field = rest.split(".", 1)
        if not prefix.endswith("model") and not prefix.endswith("language_model"):
            continue
        wanted = (int(layer) == attention and (field.startswith(("self_attn.", "input_layernorm.",
                                                                 "post_attention_layernorm."))))
        if field.startswith("mlp.") and (".experts." in name or "shared_expert" in name or field == "mlp.gate.weight"
                                         if has_experts else int(layer) == attention):
            wanted = True
        if wanted:
            head[f"mtp.layers.0.{field}"] = torch.randn(tensor.shape, generator=generator) * tensor.float().std()
    hidden = text["hidden_size"]
    head["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=generator) * 0.1
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        head[f"mtp.{norm}.weight"] = torch.randn(hidden, generator=generator) * 0.1
    save_file({**tensors, **head}, str(path), metadata={"format": "pt"})
