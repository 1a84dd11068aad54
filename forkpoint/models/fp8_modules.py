"""Which modules of a Qwen-family model hold block-wise FP8 weights, and making them FP8 before loading.

A checkpoint decides by itself: a module is FP8 when the checkpoint stores a `*_scale_inv` tensor for
it (Qwen's FP8 releases keep some modules in bf16 and say so in `modules_to_not_convert`; the scales
are the ground truth). Checkpoint names map onto the model's modules as the loader maps weights:

    <prefix>X.weight_scale_inv                      -> model.X                (prefix: model. or model.language_model.)
    ...mlp.experts.{e}.{gate,up,down}_proj.weight_scale_inv   -> ...mlp.experts (every expert FP8, or none)
    ...mlp.experts.{gate_up,down}_proj_scale_inv    -> ...mlp.experts         (the fused layout)
    ...linear_attn.in_proj_qkvz.weight_scale_inv    -> in_proj_qkv and in_proj_z   (Qwen3-Next's grouped rows)
    ...linear_attn.in_proj_ba.weight_scale_inv      -> in_proj_b and in_proj_a

Dummy weights (`load_format="dummy"`) are FP8 where Qwen's releases are: every projection of the
decoder layers and the routed experts, except the router (`mlp.gate`), the shared expert's gate and
the GDN's `in_proj_b` / `in_proj_a` (and anything `modules_to_not_convert` names); embeddings, norms,
the lm_head and the vision tower stay in the model dtype.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable

from torch import nn

from forkpoint.config import Fp8BlockQuantization, ModelConfig
from forkpoint.models.layers import Experts, Fp8Linear, make_fp8

SCALE_SUFFIX = "_scale_inv"
# leaves Qwen's FP8 releases keep unquantised (small, or deciding the routing); dummy FP8 weights do too
UNQUANTISED_LEAVES = ("gate", "shared_expert_gate", "in_proj_a", "in_proj_b")
_PER_EXPERT_MODULE = re.compile(r"^(.+\.experts)\.\d+\.(gate_proj|up_proj|down_proj)$")
_FUSED_EXPERT_SCALE = re.compile(r"^(.+\.experts)\.(gate_up_proj|down_proj)_scale_inv$")
_GROUPED = {"in_proj_qkvz": ("in_proj_qkv", "in_proj_z"), "in_proj_ba": ("in_proj_b", "in_proj_a")}
_SKIPPED_PREFIXES = ("mtp.",)
_VISION_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.")


def checkpoint_fp8_modules(names: Iterable[str], config: ModelConfig) -> set[str]:
    """The model's module names whose weights the checkpoint (tensor `names`, as stored) keeps in FP8.
    Scales of tensors the loader skips (the MTP head) are ignored; ValueError for an FP8 vision tower."""
    modules: set[str] = set()
    for raw in names:
        if not raw.endswith(SCALE_SUFFIX) or raw.startswith(_SKIPPED_PREFIXES):
            continue
        if raw.startswith(_VISION_PREFIXES):
            raise ValueError(f"checkpoint tensor {raw}: FP8 weights of the vision tower are not supported (only the "
                             "language model's); use a checkpoint whose vision tower is unquantised")
        if raw.startswith(config.weight_prefix):
            name = "model." + raw[len(config.weight_prefix):]
        else:
            name = raw  # lm_head; anything else is reported by the loader as unknown
        fused = _FUSED_EXPERT_SCALE.match(name)
        if fused:
            modules.add(fused.group(1))
            continue
        if not name.endswith(".weight" + SCALE_SUFFIX):
            continue  # not a weight's scale: the loader reports it as unknown
        module = name[: -len(".weight" + SCALE_SUFFIX)]
        per_expert = _PER_EXPERT_MODULE.match(module)
        parent, _, leaf = module.rpartition(".")
        if per_expert:
            modules.add(per_expert.group(1))
        elif leaf in _GROUPED and ".linear_attn" in parent:
            modules.update(f"{parent}.{part}" for part in _GROUPED[leaf])
        else:
            modules.add(module)
    return modules


def _not_converted(name: str, config: ModelConfig, patterns: tuple[str, ...]) -> bool:
    """Whether `modules_to_not_convert` names module `name` (the model's name, or the checkpoint's with
    its weight prefix): an entry matches whole dotted components (`mlp.gate` is not `mlp.gate_proj`),
    or as a glob when it has a `*`."""
    stored = config.weight_prefix + name[len("model."):] if name.startswith("model.") else name
    for pattern in patterns:
        for candidate in (name, stored):
            if ("*" in pattern and fnmatch.fnmatchcase(candidate, pattern)) or f".{pattern}." in f".{candidate}.":
                return True
    return False


def dummy_fp8_modules(model: nn.Module, config: ModelConfig, quantization: Fp8BlockQuantization) -> set[str]:
    """The modules that dummy FP8 weights quantise (module docstring)."""
    modules = set()
    for name, module in model.named_modules():
        if not name.startswith("model.layers.") or _not_converted(name, config, quantization.modules_to_not_convert):
            continue
        if isinstance(module, Experts) or (isinstance(module, nn.Linear)
                                           and name.rpartition(".")[2] not in UNQUANTISED_LEAVES):
            modules.add(name)
    return modules


def convert_to_fp8(model: nn.Module, names: set[str], block: tuple[int, int]) -> None:
    """Make the modules `names` of `model` (built on the meta device, already in the model dtype) hold
    block-wise FP8 weights with `block`: linears become `Fp8Linear`, the routed experts and other
    modules with a 2-D `weight` (the router) are converted in place. ValueError for a name the model
    does not have or cannot hold in FP8."""
    modules = dict(model.named_modules())
    tied = getattr(model.config, "tie_word_embeddings", False)
    for name in sorted(names):
        module = modules.get(name)
        if module is None:
            raise ValueError(f"checkpoint has FP8 scales for {name}, which the model does not have "
                             "(does config.json match the weights?)")
        if isinstance(module, Experts):
            module.make_fp8(block)
        elif isinstance(module, nn.Linear):
            if name == "lm_head" and tied:
                raise ValueError("checkpoint has an FP8 lm_head but ties it to the embedding "
                                 "(tie_word_embeddings): an FP8 embedding is not supported")
            parent, _, leaf = name.rpartition(".")
            setattr(modules[parent] if parent else model, leaf, Fp8Linear.from_linear(module, block))
        elif isinstance(getattr(module, "weight", None), nn.Parameter) and module.weight.dim() == 2:
            make_fp8(module, block)
        else:
            raise ValueError(f"checkpoint has FP8 scales for {name} ({type(module).__name__}), which forkpoint "
                             "keeps in the model dtype: only projections and experts can be FP8")
