"""Which model class runs which Hugging Face checkpoint.

`model_class(config)` maps the config's `model_type` (and checks its `architectures`) to the class
that implements it. Every class takes `(config, *, with_vision=False)` and implements the model
interface `CausalLM` (models/interface.py: `forward(batch, caches) -> logits`, `pool_shapes(dtype)`,
the parts the piecewise forward composes, `visual`, ...).
"""

from __future__ import annotations

from torch import nn

from forkpoint.config import ModelConfig
from forkpoint.models.falcon_h1 import FalconH1ForCausalLM
from forkpoint.models.granite_hybrid import GraniteMoeHybridForCausalLM
from forkpoint.models.nemotron_h import NemotronHForCausalLM
from forkpoint.models.qwen3_5 import HybridForCausalLM

# model_type -> (class, the HF architecture names saved for it)
_FAMILIES: dict[str, tuple[type[nn.Module], tuple[str, ...]]] = {
    "qwen3_5_text": (HybridForCausalLM, ("Qwen3_5ForCausalLM",)),
    "qwen3_5_moe_text": (HybridForCausalLM, ("Qwen3_5MoeForCausalLM",)),
    "qwen3_next": (HybridForCausalLM, ("Qwen3NextForCausalLM",)),
    "qwen3_5": (HybridForCausalLM, ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM")),
    "qwen3_5_moe": (HybridForCausalLM, ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM")),
    "nemotron_h": (NemotronHForCausalLM, ("NemotronHForCausalLM",)),
    "granitemoehybrid": (GraniteMoeHybridForCausalLM, ("GraniteMoeHybridForCausalLM",)),
    "falcon_h1": (FalconH1ForCausalLM, ("FalconH1ForCausalLM",)),
}


def supported_model_types() -> list[str]:
    return sorted(_FAMILIES)


def model_class(config: ModelConfig) -> type[nn.Module]:
    """The class implementing `config`; ValueError naming the supported types otherwise, or when
    config.json's `architectures` names a class of another family."""
    family = _FAMILIES.get(config.model_type)
    if family is None:
        raise ValueError(f"unsupported model_type {config.model_type!r}: forkpoint runs {supported_model_types()}")
    cls, architectures = family
    for name in config.architectures:
        owner = next((t for t, (_, names) in _FAMILIES.items() if name in names), None)
        if owner is not None and name not in architectures:
            raise ValueError(f"config.json names architecture {name!r} (model_type {owner!r}) but model_type "
                             f"{config.model_type!r}: the config is inconsistent")
    return cls
