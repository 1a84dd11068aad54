"""Frozen configuration objects, built once and passed down.

`ModelConfig` is the model architecture read from a Hugging Face `config.json`; `EngineConfig` holds
the engine's knobs (the keyword arguments of `LLM`). Neither changes after construction. The value
objects they are made of live in sibling modules: `vision_config.py` (the vision tower),
`quantization_config.py` (block-wise FP8 weights), `mamba2_config.py` (the Mamba2 hybrids' mixers),
`speculative_config.py` and `structured_outputs_config.py` (two engine knobs given as dicts, as in vLLM).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from forkpoint.mamba2_config import (
    MAMBA2_MODEL_TYPES,
    Mamba2HybridConfig,
    mamba2_hybrid_fields,
)
from forkpoint.quantization_config import Fp8BlockQuantization
from forkpoint.speculative_config import SpeculativeConfig
from forkpoint.structured_outputs_config import StructuredOutputsConfig
from forkpoint.vision_config import VISION_ACTIVATIONS, VisionConfig

# importable from here: the two configurations and the value objects they are made of (each in its
# sibling module; VISION_ACTIVATIONS goes with VisionConfig)
__all__ = ["SCAN_CHUNK_TOKENS", "SUPPORTED_MODEL_TYPES", "VISION_ACTIVATIONS", "EngineConfig", "Fp8BlockQuantization",
           "ModelConfig", "SpeculativeConfig", "StructuredOutputsConfig", "VisionConfig"]

# Hugging Face model types that forkpoint runs, mapped to the text-config key holding their
# text model (None: the config is the text config itself).
SUPPORTED_MODEL_TYPES: dict[str, str | None] = {
    "qwen3_5_text": None,
    "qwen3_5_moe_text": None,
    "qwen3_next": None,
    "qwen3_5": "text_config",
    "qwen3_5_moe": "text_config",
    **{model_type: None for model_type in MAMBA2_MODEL_TYPES},
}


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a hybrid recurrent / attention model.

    Invariants: `len(layer_types) == num_layers`; Qwen families: each entry is "linear_attention"
    (GDN) or "full_attention", `linear_num_value_heads % linear_num_key_heads == 0`; Mamba2 hybrids
    (`mamba2` set; the GDN fields are 0): entries "mamba2", "full_attention", "mlp", "moe" or
    "parallel" (see forkpoint/mamba2_config.py); `num_attention_heads % num_key_value_heads == 0`.
    `rotary_dim == 0`: attention without rotary embeddings (Nemotron-H).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float
    # full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    attention_bias: bool
    # gated delta net
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # feed-forward: dense (intermediate_size) or MoE (num_experts > 0) per `moe_layers`
    intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    moe_layers: tuple[bool, ...]
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...] = ()
    # weights of a multimodal checkpoint live under this prefix ("" for text-only checkpoints)
    weight_prefix: str = "model."
    grouped_gdn_projections: bool = False  # Qwen3-Next's in_proj_qkvz / in_proj_ba layout
    # multi-axis rotary (temporal, height, width): frequency i of the rotary half belongs to axis
    # H when i % 3 == 1 and i < 3 * mrope_section[1], W when i % 3 == 2 and i < 3 * mrope_section[2],
    # else T (transformers' interleaved layout); only image tokens have distinct axes
    mrope_section: tuple[int, int, int] = (11, 11, 10)
    vision: VisionConfig | None = None  # None: a text-only checkpoint
    mamba2: Mamba2HybridConfig | None = None  # the Mamba2 hybrids' mixer and multipliers; None for Qwen
    architectures: tuple[str, ...] = ()  # config.json's `architectures`
    # block-wise FP8 weights (config.json's quantization_config); None: weights in the model dtype
    quantization: Fp8BlockQuantization | None = None

    @property
    def gdn_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        """Layers with attention KV (full attention, and Falcon-H1's parallel layers)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t in ("full_attention", "parallel"))

    @property
    def recurrent_layer_ids(self) -> tuple[int, ...]:
        """Layers with a recurrent state row per sequence (GDN, Mamba2, parallel)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t in ("linear_attention", "mamba2", "parallel"))

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN causal convolution: q, k and v concatenated."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + (
            self.linear_num_value_heads * self.linear_value_head_dim
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` (and `generation_config.json` if present) from a model directory."""
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ValueError(f"no config.json in model directory {path}: is this a Hugging Face model dir?")
        try:
            raw = json.loads(config_file.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"cannot read {config_file}: {err}") from err
        generation = {}
        generation_file = path / "generation_config.json"
        if generation_file.is_file():
            try:
                generation = json.loads(generation_file.read_text())
            except (OSError, json.JSONDecodeError) as err:
                raise ValueError(f"cannot read {generation_file}: {err}") from err
        return cls.from_dict(raw, generation)

    @classmethod
    def from_dict(cls, raw: dict, generation: dict | None = None) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}: forkpoint runs {sorted(SUPPORTED_MODEL_TYPES)}"
            )
        eos = (generation or {}).get("eos_token_id", raw.get("eos_token_id"))
        architectures = tuple(raw.get("architectures") or ())
        text_key = SUPPORTED_MODEL_TYPES[model_type]
        quant_raw = raw.get("quantization_config") or (raw.get(text_key) or {}).get("quantization_config")
        quantization = Fp8BlockQuantization.from_dict(quant_raw) if quant_raw else None
        if model_type in MAMBA2_MODEL_TYPES:
            if quantization is not None:
                raise ValueError(f"quantization_config: FP8 checkpoints of {model_type} are not supported (block-wise "
                                 "FP8 is supported for the Qwen3.5 and Qwen3-Next families); use the bf16 release")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            prefix = "backbone." if model_type == "nemotron_h" else "model."
            config = cls(**mamba2_hybrid_fields(raw), eos_token_ids=eos_ids, weight_prefix=prefix,
                         architectures=architectures)
            config.validate()
            return config
        weight_prefix = "model."
        text = raw
        if text_key is not None:
            text = dict(raw.get(text_key) or {})
            weight_prefix = "model.language_model."
            text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
        num_layers = int(text["num_hidden_layers"])
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = int(text.get("full_attention_interval", 4))
            layer_types = [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)
            ]
        layer_types = tuple(layer_types[:num_layers])
        unknown = set(layer_types) - {"linear_attention", "full_attention"}
        if unknown:
            raise ValueError(f"unsupported layer types {sorted(unknown)} in config")

        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        rope_theta = float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
        partial = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
        mrope_section = tuple(int(x) for x in rope.get("mrope_section", (11, 11, 10)))
        if len(mrope_section) != 3:
            raise ValueError(f"rope mrope_section must have three entries (T, H, W), got {list(mrope_section)}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"unsupported rope_type {rope_type!r}: only 'default' rotary embeddings are implemented")
        num_heads = int(text["num_attention_heads"])
        hidden = int(text["hidden_size"])
        head_dim = int(text.get("head_dim") or hidden // num_heads)
        rotary_dim = int(head_dim * partial)

        num_experts = int(text.get("num_experts", 0) or 0)
        is_moe_type = model_type in ("qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next")
        if is_moe_type and num_experts > 0:
            step = int(text.get("decoder_sparse_step", 1) or 1)
            mlp_only = set(text.get("mlp_only_layers") or [])
            moe_layers = tuple((i not in mlp_only) and (i + 1) % step == 0 for i in range(num_layers))
        else:
            num_experts = 0
            moe_layers = (False,) * num_layers

        eos = (generation or {}).get("eos_token_id", text.get("eos_token_id", raw.get("eos_token_id")))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())

        config = cls(
            model_type=model_type,
            vocab_size=int(text["vocab_size"]),
            hidden_size=hidden,
            num_layers=num_layers,
            layer_types=layer_types,
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            num_attention_heads=num_heads,
            num_key_value_heads=int(text.get("num_key_value_heads", num_heads)),
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            rope_theta=rope_theta,
            attention_bias=bool(text.get("attention_bias", False)),
            linear_num_key_heads=int(text["linear_num_key_heads"]),
            linear_num_value_heads=int(text["linear_num_value_heads"]),
            linear_key_head_dim=int(text["linear_key_head_dim"]),
            linear_value_head_dim=int(text["linear_value_head_dim"]),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            intermediate_size=int(text.get("intermediate_size", 0) or 0),
            num_experts=num_experts,
            num_experts_per_tok=int(text.get("num_experts_per_tok", 0) or 0),
            moe_intermediate_size=int(text.get("moe_intermediate_size", 0) or 0),
            shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size", 0) or 0),
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            moe_layers=moe_layers,
            tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            eos_token_ids=eos_ids,
            weight_prefix=weight_prefix,
            grouped_gdn_projections=model_type == "qwen3_next",
            mrope_section=mrope_section,
            vision=VisionConfig.from_dict(raw["vision_config"], raw) if text_key and raw.get("vision_config") else None,
            architectures=architectures,
            quantization=quantization,
        )
        config.validate()
        return config

    def with_quantization(self, requested: str | None, load_format: str) -> ModelConfig:
        """The config under `LLM(quantization=requested)`: None keeps what the checkpoint says; "fp8" keeps a
        checkpoint's block-wise FP8, or, with `load_format="dummy"` and an unquantised config, makes the
        dummy weights FP8 with 128 x 128 blocks. ValueError for anything else."""
        if requested is None or (requested == "fp8" and self.quantization is not None):
            return self
        if requested != "fp8":
            raise ValueError(f"quantization {requested!r} is not supported: pass None (read from the checkpoint's "
                             "quantization_config) or 'fp8'")
        if self.mamba2 is not None:
            raise ValueError(f"quantization='fp8' is not supported for {self.model_type} (block-wise FP8 is "
                             "supported for the Qwen3.5 and Qwen3-Next families)")
        if load_format != "dummy":
            raise ValueError("quantization='fp8' needs an FP8 checkpoint (config.json with a quantization_config): "
                             "this one has none, and quantising bf16 weights at load time is not supported; pass "
                             "quantization=None, an FP8 checkpoint, or load_format='dummy' for random FP8 weights")
        return dataclasses.replace(self, quantization=Fp8BlockQuantization())

    def validate(self) -> None:
        if len(self.layer_types) != self.num_layers or len(self.moe_layers) != self.num_layers:
            raise ValueError(f"config has {self.num_layers} layers but {len(self.layer_types)} layer types")
        if self.mamba2 is not None:
            self.mamba2.mamba.validate()
        elif self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        dense = self.mamba2 is None or "mlp" in self.layer_types or self.mamba2.family != "nemotron_h"
        if dense and not any(self.moe_layers) and self.intermediate_size <= 0:
            raise ValueError("config has neither experts nor a dense intermediate_size")
        if self.vision is not None and self.vision.out_hidden_size != self.hidden_size:
            raise ValueError(f"vision_config out_hidden_size {self.vision.out_hidden_size} differs from the text "
                             f"hidden_size {self.hidden_size}: the checkpoint's config is inconsistent")


# Tokens per chunk of every chunked recurrent scan (fla-core's chunk kernels and the references): a
# scan's floating-point result depends on where its chunks start, so exact checkpoints align to it.
SCAN_CHUNK_TOKENS = 64

# `EngineConfig.max_prefill_tokens_with_decodes` (`forkpoint serve --max-prefill-tokens-with-decodes`)
# on the CPU, measured with bench/mixed_step_cost.py (embedded model, 2 cores, 8 decoding streams whose
# own step takes 36-38 ms; a 16,384-token prompt beside them, median step time over its decoding step
# time by the chunk's position in the prompt; bench/results/mixed_step_cost_cpu.json, at 58be129):
#
#   chunk   0-4k    4-8k    8-12k   12-16k
#      64   1.25x   1.61x   1.69x   1.79x
#     128   1.40x   1.62x   2.39x   2.54x
#     256   1.19x   1.36x   2.08x   2.56x
#     512   2.91x   7.28x  10.50x  10.25x
#
# Past a few thousand tokens of context the CPU attention reference dominates a chunk's cost (it grows
# with the chunk's position), so only 64 tokens keep a mixed step under 2x of a decode step through a
# 16k prompt: `forkpoint serve`'s default on the CPU (server/engine_args.py). The cap counts long
# prefills only (engine/prefill_budget.py: SHORT_PREFILL_BUDGETS), so chat turns run whole; counting every
# prefill, it had doubled a chat server's time to first token (docs/server.md, "Long prompts and
# bystanders"). The offline `LLM` and CUDA (not measured there) keep no cap.
CPU_SERVE_PREFILL_TOKENS_WITH_DECODES = 64

# `EngineConfig.max_decode_share` (`forkpoint serve --max-decode-share`) on the CPU, where a decode step's
# time grows with its rows (embedded model, 2 cores, median step by decode rows, engine/decode_share.py):
#
#   rows    8      16     24     32     64     136
#   step    0.066  0.088  0.096  0.119  0.180  0.351 s
#
# 16 beside a client's 8 streams makes 24-row steps (1.45x theirs) where one request's n=128 made
# 136-row steps (5.3x); a larger client still decodes 16 sequences a step while others have work, and
# all of them once alone. The offline `LLM` and CUDA (not measured there) keep no cap.
CPU_SERVE_DECODE_SHARE = 16


@dataclass(frozen=True)
class EngineConfig:
    """Engine knobs: the keyword arguments of `LLM`, validated.

    `kv_cache_bytes` / `state_cache_bytes` bound the KV block pool and the recurrent state pools on
    CPU (on CUDA, `gpu_memory_utilization` of the free memory is split between them).
    """

    # a local directory or a Hugging Face Hub name (`LLM` resolves names with inputs/hub.py): `revision`
    # and `tokenizer_revision` pick a branch, tag or commit, `download_dir` the Hub cache to use
    model: str | None = None
    tokenizer: str | None = None
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    enable_checkpoints: bool = True
    checkpoint_token: str = "<|mamba_checkpoint|>"
    max_checkpoints_per_request: int = 4
    load_format: str = "auto"
    # checkpoint state rows on the device (None: a share of the memory budget, cache/sizing.py)
    checkpoint_pool_size: int | None = None
    checkpoint_wait_s: float = 30.0
    # automatic checkpoints (engine/auto_checkpoints.py): exact positions the engine picks itself where
    # reuse is certain or likely (shared prefixes, junctions, prompt ends, turn ends); never shorter
    # than auto_checkpoint_min_tokens tokens
    auto_checkpoints: bool = True
    auto_checkpoint_min_tokens: int = 32
    # bytes of host memory that checkpoints evicted from the device pool spill to (0: no host tier;
    # None: sized from the machine, cache/sizing.py default_host_tier_bytes: a quarter of the memory,
    # at most 64 GiB, none on the CPU)
    checkpoint_host_bytes: int | None = None
    # the disk tier (cache/disk_tier.py): READY checkpoints written through to files under this
    # directory, keyed by prefix, model, dtype, layout and tokenizer, read back after a restart (None:
    # no disk tier); bounded by checkpoint_dir_bytes (None: a quarter of the file system's free space
    # plus the directory's files at start-up, cache/sizing.py), least recently used files leave first
    checkpoint_dir: str | None = None
    checkpoint_dir_bytes: int | None = None
    # take a hit in the host or disk tier only when moving it back is measured to cost no more than twice
    # computing the tokens it saves (cache/reuse_rule.py); False: take every hit (measured all the same)
    checkpoint_restore_rule: bool = True
    # keep every checkpoint's state at a multiple of SCAN_CHUNK_TOKENS at or before its position, and
    # end prefill chunks there, so the chunked recurrent scans of a consumer run over the same chunks
    # as without checkpoints (bf16 results bit-identical; each consumer recomputes < 64 tokens)
    checkpoint_exact: bool = False
    # cap on one request's prefill tokens per step (vLLM's name), so long prompts share steps
    long_prefill_token_threshold: int | None = None
    # most prefill tokens (all requests together) in a step that also decodes, so a long prompt's
    # chunks keep the decoding streams' token gaps near their own step time (Sarathi-Serve's token
    # budget; engine/prefill_budget.py). A step with no decode takes max_num_batched_tokens. None: no
    # cap (vLLM's mixed steps), the default; `forkpoint serve` on the CPU: CPU_SERVE_PREFILL_TOKENS_WITH_DECODES
    max_prefill_tokens_with_decodes: int | None = None
    # C, the context length at which a prefill token's attention costs what its matrix products do: in a
    # step that decodes, a long prefill's chunk at context position c takes at most that budget / (1 + c / C)
    # tokens (engine/prefill_budget.py). None: counted from the model's shape (engine/attention_parity.py)
    attention_parity_tokens: int | None = None
    # while other clients (engine/fair_order.py's client_of: the `user`, else the prompt) have work, one
    # client decodes at most max(max_decode_share, the largest other client's running sequences)
    # sequences a step; its others skip the step in turn, keeping their state, and it admits no more into a
    # step once it has that many there (engine/decode_share.py).
    # None: no cap (vLLM), the default; `forkpoint serve` on the CPU: CPU_SERVE_DECODE_SHARE
    max_decode_share: int | None = None
    # bytes of float32 prompt-logit rows ([rows, vocab]) one step computes for prompt logprobs: a scored
    # prompt runs in chunks of that many rows (`prompt_score_rows`), so its memory is O(chunk x vocab)
    # per step plus O(prompt x k) of kept scores, not O(prompt x vocab). None: 64 MiB on the CPU (64
    # rows of a 248k vocabulary: small steps next to other streams), 1 GiB on CUDA (1,024 rows)
    prompt_score_bytes: int | None = None
    num_kv_blocks: int | None = None
    num_state_slots: int | None = None
    kv_cache_bytes: int = 2 << 30
    state_cache_bytes: int = 2 << 30
    gpu_memory_utilization: float = 0.85
    # images (multimodal checkpoints only): at most this many per prompt; 0 uses the model text-only
    # (the vision tower is not loaded); pixel limits override preprocessor_config.json's
    max_images_per_prompt: int = 16
    image_min_pixels: int | None = None
    image_max_pixels: int | None = None
    image_embedding_cache_bytes: int = 256 << 20  # LRU of vision-tower outputs, keyed by image content
    # CUDA graphs (CUDA only): the token-wise parts of the forward are replayed as graphs per padded
    # token count (runner/piecewise.py). True runs every step eagerly (vLLM's name). The bucket sizes
    # default to runner.piecewise.default_cuda_graph_sizes(max_num_batched_tokens); larger steps run
    # eagerly.
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] | None = None
    # a cold start's kernel compiles, spread over this many worker processes before the graphs and the
    # warm-up (runner/precompile.py; CUDA graphs only); None: as many as the CPUs and the free GPU
    # memory allow (at most 8; `forkpoint serve`'s default); 0: none, the engine compiles alone
    startup_compile_workers: int | None = 0
    # ranks the model is split over (forkpoint/distributed/): one process per rank, rank r on cuda:r
    # (NCCL) or all on the CPU (gloo); every family; images encoded on rank 0 (the vision tower is not
    # split); with checkpoint_host_bytes each rank keeps a host tier of that size for its shards
    tensor_parallel_size: int = 1
    # vLLM's --async-scheduling: in steady decoding the host schedules and enqueues step t+1 while the
    # device runs step t, and does step t's output work while step t+1 runs (engine/engine.py)
    async_scheduling: bool = False
    # vLLM's speculative_config ({"method": "mtp", "num_speculative_tokens": k}; SpeculativeConfig): the
    # model's MTP head drafts k tokens a step, one forward verifies them (greedy: exact; sampling:
    # rejection sampling keeps the target distribution); None: off
    speculative_config: SpeculativeConfig | None = None
    # vLLM's names: None reads the weights' quantisation from the checkpoint's quantization_config
    # (block-wise FP8); "fp8" asks for it (with load_format="dummy", FP8 dummy weights from a bf16 config)
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # the KV cache in the model dtype; FP8 KV caches are not implemented
    # JSON schemas' reading (StructuredOutputsConfig; a dict of its keys is accepted, as in vLLM)
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "structured_outputs_config",
                           StructuredOutputsConfig.from_value(self.structured_outputs_config))
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be None (read from the checkpoint's quantization_config) or 'fp8', "
                             f"got {self.quantization!r}")
        if self.kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported: FP8 KV caches are not "
                             "implemented; use 'auto' (the KV cache in the model dtype)")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format must be auto, safetensors or dummy, got {self.load_format!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_checkpoints_per_request < 0:
            raise ValueError("max_checkpoints_per_request must be >= 0")
        if self.checkpoint_wait_s <= 0:
            raise ValueError("checkpoint_wait_s must be positive")
        if self.auto_checkpoint_min_tokens < 1:
            raise ValueError(f"auto_checkpoint_min_tokens must be >= 1, got {self.auto_checkpoint_min_tokens}")
        if self.checkpoint_exact and self.max_num_batched_tokens < SCAN_CHUNK_TOKENS:
            raise ValueError(f"checkpoint_exact needs max_num_batched_tokens >= {SCAN_CHUNK_TOKENS} (one scan chunk)")
        if (self.checkpoint_exact and self.max_prefill_tokens_with_decodes is not None
                and self.max_prefill_tokens_with_decodes < SCAN_CHUNK_TOKENS):
            raise ValueError(f"checkpoint_exact needs max_prefill_tokens_with_decodes >= {SCAN_CHUNK_TOKENS} (one scan "
                             f"chunk), got {self.max_prefill_tokens_with_decodes}: a mixed step's prefill chunk ends "
                             "at a scan-chunk boundary")
        if self.prompt_score_bytes is not None and self.prompt_score_bytes < 1:
            raise ValueError(f"prompt_score_bytes must be >= 1, got {self.prompt_score_bytes}")
        if self.checkpoint_host_bytes is not None and self.checkpoint_host_bytes < 0:
            raise ValueError(f"checkpoint_host_bytes must be >= 0, got {self.checkpoint_host_bytes}")
        if self.startup_compile_workers is not None and self.startup_compile_workers < 0:
            raise ValueError(f"startup_compile_workers must be >= 0 (0: none), got {self.startup_compile_workers}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.checkpoint_dir_bytes is not None and self.checkpoint_dir_bytes < 1:
            raise ValueError(f"checkpoint_dir_bytes must be >= 1, got {self.checkpoint_dir_bytes}")
        if self.checkpoint_dir is not None and self.tensor_parallel_size > 1:
            raise ValueError("checkpoint_dir needs tensor_parallel_size=1: the disk tier does not write the "
                             "ranks' shards yet; drop --checkpoint-dir or run one rank")
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError("async_scheduling needs tensor_parallel_size=1: the tensor-parallel ranks run "
                             "every step in lockstep; drop one of the two")
        object.__setattr__(self, "speculative_config", SpeculativeConfig.from_value(self.speculative_config))
        if self.speculative_config is not None and self.async_scheduling:
            raise ValueError("speculative_config does not run with async_scheduling yet (a verify step reads its "
                             "drafts on the host before the next step is planned): drop one of the two")
        if self.speculative_config is not None and self.tensor_parallel_size > 1:
            raise ValueError(f"speculative_config does not run with tensor_parallel_size {self.tensor_parallel_size} "
                             "yet (the MTP head is not split over ranks): use tensor_parallel_size 1 or drop "
                             "speculative_config")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError("max_model_len must be positive")
        if self.max_images_per_prompt < 0 or self.image_embedding_cache_bytes < 0:
            raise ValueError("max_images_per_prompt and image_embedding_cache_bytes must be >= 0")
        if (self.image_min_pixels is not None and self.image_max_pixels is not None
                and self.image_min_pixels > self.image_max_pixels):
            raise ValueError(f"image_min_pixels {self.image_min_pixels} exceeds image_max_pixels "
                             f"{self.image_max_pixels}")
        for name in ("checkpoint_pool_size", "num_kv_blocks", "num_state_slots", "long_prefill_token_threshold",
                     "max_prefill_tokens_with_decodes", "attention_parity_tokens", "max_decode_share",
                     "image_min_pixels", "image_max_pixels"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.cuda_graph_sizes is not None:
            sizes = tuple(sorted({int(size) for size in self.cuda_graph_sizes}))
            if not sizes or sizes[0] < 1:
                raise ValueError(f"cuda_graph_sizes must be a non-empty list of token counts >= 1, "
                                 f"got {list(self.cuda_graph_sizes)}")
            if sizes[-1] > self.max_num_batched_tokens:
                raise ValueError(f"cuda_graph_sizes entry {sizes[-1]} exceeds max_num_batched_tokens "
                                 f"{self.max_num_batched_tokens}: no step has that many tokens")
            object.__setattr__(self, "cuda_graph_sizes", sizes)

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]

    def prefill_tokens_with_decodes(self) -> int | None:
        """Prefill tokens a step that also decodes may take: `max_prefill_tokens_with_decodes`, never
        more than max_num_batched_tokens; None: no cap (steps planned as without the budget)."""
        value = self.max_prefill_tokens_with_decodes
        return None if value is None else min(value, self.max_num_batched_tokens)

    def prompt_score_rows(self, vocab_size: int) -> int:
        """Prompt-logit rows one step computes: `prompt_score_bytes` (or the device's default) of
        float32 [rows, vocab_size], rounded down to a multiple of SCAN_CHUNK_TOKENS (so checkpoint_exact
        chunks stay aligned), at least one scan chunk."""
        budget = self.prompt_score_bytes
        if budget is None:
            budget = 1 << 30 if self.torch_device().type == "cuda" else 64 << 20
        rows = budget // (4 * vocab_size)
        return max(SCAN_CHUNK_TOKENS, rows - rows % SCAN_CHUNK_TOKENS)
