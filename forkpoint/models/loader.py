"""Load Hugging Face checkpoints (or seeded dummy weights) straight into the target dtype and device.

The model is built on the meta device and materialised once; each checkpoint tensor is read,
converted and copied into its parameter, so at most one checkpoint tensor exists beside the model.

Layout conversions handled here:
- weights of multimodal checkpoints under `model.language_model.`; the vision tower's `model.visual.*`
  become `visual.*` when the model is built `with_vision` (else they are skipped);
- experts stored per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`) or fused
  (`mlp.experts.gate_up_proj [E, 2I, H]`, `mlp.experts.down_proj [E, H, I]`);
- Qwen3-Next's grouped `in_proj_qkvz` / `in_proj_ba` into Qwen3.5's flat q|k|v, z, b, a;
- any other per-expert tensor `<base>.experts.{e}.<proj>.weight` into row e of the model's stacked
  `<base>.experts.<proj>` [E, ...] (Nemotron-H's `up_proj` / `down_proj`);
- the MTP head's `mtp.*` (models/mtp.py), loaded as stored when the model is built with one (speculative
  decoding), else skipped;
- Nemotron-H's `backbone.` prefix (`ModelConfig.weight_prefix`) into `model.`;
- block-wise FP8 checkpoints (`ModelConfig.quantization`): the modules with `*_scale_inv` tensors are
  made FP8 before loading (models/fp8_modules.py) and their e4m3 weights and float32 scales are
  copied as stored; per-expert and grouped scales follow their weights' rows in block units.

The model class comes from `forkpoint.models.registry` (HF `model_type` / `architectures`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from forkpoint.config import ModelConfig
from forkpoint.kernels.fp8.reference import FP8_DTYPE, quantize_blocks
from forkpoint.models.fp8_modules import SCALE_SUFFIX, checkpoint_fp8_modules, convert_to_fp8, dummy_fp8_modules
from forkpoint.models.layers import stack_all_projections
from forkpoint.models.registry import model_class

_SKIPPED_PREFIXES = ("mtp.", "model.visual.", "visual.", "model.vision_tower.")
_VISION_PREFIX = "model.visual."
_MTP_PREFIX = "mtp."
_PER_EXPERT = re.compile(
    r"^((?:model|mtp)\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight(_scale_inv)?$")
_STACKED_EXPERT = re.compile(r"^(.+\.experts)\.(\d+)\.(\w+)\.weight$")
_GROUPED_QKVZ = re.compile(r"^(model\.layers\.\d+\.linear_attn)\.in_proj_(qkvz|ba)\.weight(_scale_inv)?$")

# read(name, lazy) -> tensor: `lazy` is a safetensors slice (`get_shape()`, indexing reads only the
# indexed part), `name` the checkpoint tensor's name with the weight prefix already mapped to `model.`
# (per-expert and grouped names as stored); the default reads the whole tensor. A tensor-parallel
# rank passes one that reads its shard (forkpoint/distributed/loading.py).
TensorReader = Callable[[str, object], torch.Tensor]


def read_whole(name: str, lazy) -> torch.Tensor:
    """The `TensorReader` of a single process: the whole tensor."""
    return lazy[:]


def build_model(config: ModelConfig, path: Path | None, load_format: str, device: torch.device,
                dtype: torch.dtype, seed: int, *, with_vision: bool = False, mtp_layers: int = 0) -> nn.Module:
    """Return the model in eval mode with every parameter loaded (or dummy-initialised).
    `with_vision` also builds and loads the vision tower (when the config has one); `mtp_layers` > 0
    the MTP head (`mtp.*`, models/mtp.py; Qwen families only)."""
    extra = {"mtp_layers": mtp_layers} if mtp_layers else {}
    with torch.device("meta"):
        model = model_class(config)(config, with_vision=with_vision, **extra)
    model = to_model_dtype(model, dtype)
    prepare_fp8(model, config, path, load_format)
    model.to_empty(device=device)
    model.init_buffers(device)
    if load_format == "dummy":
        _init_dummy(model, seed)
    else:
        if path is None:
            raise ValueError("a model path is needed unless load_format='dummy'")
        load_safetensors(model, config, path)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.input_embeddings().weight
    stack_all_projections(model)
    return model.eval()


def to_model_dtype(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model.to(dtype)`, except the parameters a module names in its `float32_parameters` (a tuple of
    attribute names), which stay float32 (transformers' `_keep_in_fp32_modules_strict`: e.g.
    Nemotron-H's router weight and score-correction bias, which decide the expert routing)."""
    model = model.to(dtype=dtype)
    for module in model.modules():
        for name in getattr(module, "float32_parameters", ()):
            param = getattr(module, name)
            param.data = param.data.float()
    return model


def prepare_fp8(model: nn.Module, config: ModelConfig, path: Path | None, load_format: str) -> None:
    """Make the modules FP8 that the checkpoint at `path` stores in FP8 (or, for dummy weights, those of
    `fp8_modules.dummy_fp8_modules`), on the meta-device model in its dtype. ValueError when the
    checkpoint's scales and config.json's quantization_config disagree."""
    quantization = config.quantization
    if load_format == "dummy" or path is None:
        if quantization is not None:
            convert_to_fp8(model, dummy_fp8_modules(model, config, quantization), quantization.block)
        return
    names = [name for file in _checkpoint_files(path) for name in _tensor_names(file)]
    modules = checkpoint_fp8_modules(names, config)
    if quantization is None:
        if modules:
            raise ValueError(f"checkpoint {path} has FP8 scales (e.g. for {sorted(modules)[0]}) but config.json has "
                             "no quantization_config: add the quantization_config the weights were saved with")
        return
    if not modules:
        raise ValueError(f"config.json of {path} declares FP8 weights (quantization_config) but the checkpoint has "
                         f"no *{SCALE_SUFFIX} tensors: the weights and the config do not belong together")
    convert_to_fp8(model, modules, quantization.block)


def _tensor_names(file: Path) -> list[str]:
    try:
        with safe_open(str(file), framework="pt") as handle:
            return list(handle.keys())
    except (OSError, SafetensorError) as err:
        raise ValueError(f"cannot read weights file {file}: {err}") from err


def _init_dummy(model: nn.Module, seed: int) -> None:
    """Seeded random weights on the target device, with realistic scales (as vLLM's dummy format)."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    params = dict(model.named_parameters())
    for name, param in params.items():
        if name.endswith(SCALE_SUFFIX):
            continue  # filled with its weight
        if param.dtype == FP8_DTYPE:
            scale = params[name + SCALE_SUFFIX]
            fill_dummy_fp8(param.data, scale.data, model.config.quantization.block, generator)
        else:
            fill_dummy(name, param.data, generator, centred_norms=model.config.mamba2 is None)


def fill_dummy_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                   generator: torch.Generator) -> None:
    """An FP8 weight's dummy values: normal(0, 0.02) drawn in fp32 from `generator` (as a plain weight's),
    quantised in blocks (`kernels.fp8.reference.quantize_blocks`) into weight (e4m3) and scale_inv."""
    values = torch.empty(weight.shape, dtype=torch.float32, device=weight.device).normal_(0.0, 0.02,
                                                                                          generator=generator)
    q, scale = quantize_blocks(values, block)
    weight.copy_(q)
    scale_inv.copy_(scale)


def fill_dummy(name: str, tensor: torch.Tensor, generator: torch.Generator, *, centred_norms: bool) -> None:
    """Fill parameter `name`'s tensor in place with its dummy values, drawing from `generator` (parameters
    are filled in `named_parameters` order; a tensor-parallel rank fills the full tensor, then keeps its
    shard, so every rank draws the same sequence as one process). `centred_norms`: Qwen's `x * (1 + w)`
    norms (near 0), else plain `x * w` norms (near 1)."""
    if name.endswith("A_log"):
        tensor.uniform_(0.0, 2.7, generator=generator)
    elif name.endswith("dt_bias"):
        tensor.fill_(1.0)
    elif name.endswith("norm.weight") and "linear_attn" in name:
        tensor.fill_(1.0)
    elif name.startswith("visual.") and ".norm" in name:  # LayerNorms: identity
        tensor.fill_(1.0 if name.endswith("weight") else 0.0)
    elif name.endswith(("norm.weight", "layernorm.weight", "norm_f.weight")):
        tensor.normal_(0.0 if centred_norms else 1.0, 0.05, generator=generator)
    elif name.endswith("e_score_correction_bias"):
        tensor.zero_()
    else:
        tensor.normal_(0.0, 0.02, generator=generator)


def _checkpoint_files(path: Path) -> list[Path]:
    if not path.is_dir():
        raise ValueError(f"model path {path} is not a directory")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as err:
            raise ValueError(f"cannot read {index}: {err}") from err
        files = sorted({path / name for name in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"checkpoint index names missing files: {missing[:3]}")
    return files


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, object, Path]]:
    """(name, lazy slice, file) of every stored tensor; nothing is read until the slice is indexed."""
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                names = list(handle.keys())
                for name in names:
                    yield name, handle.get_slice(name), file
        except (OSError, SafetensorError) as err:
            raise ValueError(f"cannot read weights file {file}: {err}") from err


def _split_grouped(config: ModelConfig, kind: str, weight: torch.Tensor, unit: int = 1) -> dict[str, torch.Tensor]:
    """Qwen3-Next grouped rows -> flat Qwen3.5 rows.

    in_proj_qkvz rows: per key head g: [q_g (K), k_g (K), v_g (r*V), z_g (r*V)] with r = HV/H;
    flat layout: [q_0..q_{H-1}, k_0.., v_0..] and z separately. in_proj_ba rows: per key head
    [b (r), a (r)]. `unit` rows of the stored tensor stand for one block of `unit` weight rows (an FP8
    weight's scales: unit = the block's rows), so every part must fill whole blocks.
    """
    heads, dk, dv = config.linear_num_key_heads, config.linear_key_head_dim, config.linear_value_head_dim
    ratio = config.linear_num_value_heads // heads
    parts = [dk, dk, ratio * dv, ratio * dv] if kind == "qkvz" else [ratio, ratio]
    if any(part % unit for part in parts):
        raise ValueError(f"in_proj_{kind} of this Qwen3-Next checkpoint is FP8 with {unit}-row blocks, which do not "
                         f"align with its per-head parts of {parts} rows: forkpoint cannot regroup those blocks")
    parts = [part // unit for part in parts]
    cols = weight.shape[-1]
    grouped = weight.reshape(heads, sum(parts), cols)
    if kind == "qkvz":
        q, k, v, z = torch.split(grouped, parts, dim=1)
        qkv = torch.cat([q.reshape(-1, cols), k.reshape(-1, cols), v.reshape(-1, cols)], dim=0)
        return {"in_proj_qkv": qkv, "in_proj_z": z.reshape(-1, cols)}
    b, a = torch.split(grouped, parts, dim=1)
    return {"in_proj_b": b.reshape(-1, cols), "in_proj_a": a.reshape(-1, cols)}


def _block_rows(config: ModelConfig, name: str) -> int:
    """Rows of one FP8 block (the scale tensor `name` needs a quantization_config)."""
    if config.quantization is None:
        raise ValueError(f"checkpoint tensor {name} is an FP8 scale but config.json has no quantization_config")
    return config.quantization.block[0]


def load_safetensors(model: nn.Module, config: ModelConfig, path: Path, read: TensorReader = read_whole) -> None:
    """Copy the checkpoint's tensors (as `read` returns them) into the model's parameters; ValueError
    naming the tensors when some are missing, unknown or of the wrong shape."""
    params = dict(model.named_parameters(remove_duplicate=False))
    if config.tie_word_embeddings:
        params.pop("lm_head.weight", None)
    for param in params.values():  # poison: anything left unloaded fails the completeness check too
        param.data.fill_(float("nan"))
    loaded: set[str] = set()
    unexpected: list[str] = []
    expert_parts: dict[str, int] = {}
    expert_needed: dict[str, int] = {}
    prefix = config.weight_prefix

    def assign(name: str, tensor: torch.Tensor, index: tuple = ()) -> None:
        param = params.get(name)
        if param is None:
            unexpected.append(name)
            return
        target = param.data[index] if index else param.data
        if (tensor.dtype == FP8_DTYPE) != (target.dtype == FP8_DTYPE):
            raise ValueError(f"{name} is {tensor.dtype} in the checkpoint but the model holds it as {target.dtype}: "
                             f"an FP8 weight needs its *{SCALE_SUFFIX} tensor, and only FP8 weights have one")
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"shape mismatch for {name}{list(index) if index else ''}: checkpoint {tuple(tensor.shape)}, "
                f"model {tuple(target.shape)} (does config.json match the weights?)"
            )
        target.copy_(tensor)
        if not index:
            loaded.add(name)

    def fetch(name: str, lazy, file: Path) -> torch.Tensor:
        try:
            return read(name, lazy)
        except (OSError, SafetensorError) as err:
            raise ValueError(f"cannot read tensor {name} of weights file {file}: {err}") from err

    for raw_name, lazy, file in _iter_tensors(_checkpoint_files(path)):
        if model.visual is not None and raw_name.startswith(_VISION_PREFIX):
            assign("visual." + raw_name[len(_VISION_PREFIX):], fetch(raw_name, lazy, file))
            continue
        mtp = raw_name.startswith(_MTP_PREFIX) and getattr(model, "mtp", None) is not None
        if raw_name.startswith(_SKIPPED_PREFIXES) and not mtp:
            continue
        if raw_name == "lm_head.weight":
            if not config.tie_word_embeddings:
                assign("lm_head.weight", fetch(raw_name, lazy, file))
            continue
        if not raw_name.startswith(prefix) and not mtp:
            unexpected.append(raw_name)
            continue
        name = raw_name if mtp else "model." + raw_name[len(prefix):]
        tensor = fetch(name, lazy, file)
        expert = _PER_EXPERT.match(name)
        grouped = _GROUPED_QKVZ.match(name)
        stacked = _STACKED_EXPERT.match(name)
        if stacked and f"{stacked.group(1)}.{stacked.group(3)}" in params:
            key = f"{stacked.group(1)}.{stacked.group(3)}"
            assign(key, tensor, (int(stacked.group(2)),))
            expert_parts[key] = expert_parts.get(key, 0) + 1
            expert_needed[key] = params[key].shape[0]
        elif expert:
            base, index, kind = expert.group(1), int(expert.group(2)), expert.group(3)
            suffix, unit = (SCALE_SUFFIX, _block_rows(config, name)) if expert.group(4) else ("", 1)
            if kind == "down_proj":
                key = f"{base}.down_proj{suffix}"
                assign(key, tensor, (index,))
            else:
                if config.moe_intermediate_size % unit:
                    raise ValueError(f"{raw_name}: the experts' {config.moe_intermediate_size} rows do not fill the "
                                     f"FP8 blocks of {unit} rows, so gate and up cannot share one scale grid")
                inter = config.moe_intermediate_size // unit
                rows = slice(0, inter) if kind == "gate_proj" else slice(inter, 2 * inter)
                key = f"{base}.gate_up_proj{suffix}"
                assign(key, tensor, (index, rows))
            expert_parts[key] = expert_parts.get(key, 0) + 1
            expert_needed[key] = config.num_experts * (1 if kind == "down_proj" else 2)
        elif grouped:
            suffix, unit = (SCALE_SUFFIX, _block_rows(config, name)) if grouped.group(3) else ("", 1)
            for part, value in _split_grouped(config, grouped.group(2), tensor, unit).items():
                assign(f"{grouped.group(1)}.{part}.weight{suffix}", value)
        else:
            assign(name, tensor)

    for key, count in expert_parts.items():
        if count == expert_needed[key]:
            loaded.add(key)
    if unexpected:
        raise ValueError(f"checkpoint has {len(unexpected)} tensors the model does not know, e.g. {unexpected[:4]}")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:4]}")
