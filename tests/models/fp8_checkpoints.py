"""Tiny FP8 checkpoints in the layout of Qwen's FP8 releases, written with the test's own quantiser.

`quantize_checkpoint` copies a tiny model directory (tests/tiny_models.py) and stores every 2-D weight
of the decoder layers' projections and experts as float8_e4m3fn with a float32 `<name>_scale_inv` per
bn x bk block (`scale_inv = amax / 448`, `q = round(W / scale_inv)`), the fused experts' 3-D tensors
likewise, and writes `quantization_config` into config.json (at the top level, as the releases do, also
for the multimodal models). Left in float32, as the releases leave them: embeddings, norms, the lm_head,
the router (`mlp.gate`), the shared expert's gate, the GDN's b / a projections (and Qwen3-Next's
grouped `in_proj_ba`), the convolution, the vision tower and the MTP head.

`dequantized_copy` writes the same weights dequantised to float32 (no scales, no quantization_config):
the model that the FP8 checkpoint's CPU path must reproduce.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

KEPT_LEAVES = ("mlp.gate.weight", "shared_expert_gate.weight", "in_proj_a.weight", "in_proj_b.weight",
               "in_proj_ba.weight")
FP8_MAX = 448.0


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The test's own block quantiser (independent of forkpoint's): W [..., N, K] -> (e4m3, scale_inv
    [..., ceil(N / bn), ceil(K / bk)] fp32), block by block."""
    *lead, n, k = weight.shape
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    flat = weight.float().reshape(-1, n, k)
    q = torch.empty(flat.shape, dtype=torch.float8_e4m3fn)
    scale = torch.empty(flat.shape[0], rows, cols)
    for e in range(flat.shape[0]):
        for i in range(rows):
            for j in range(cols):
                tile = flat[e, i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
                s = tile.abs().max() / FP8_MAX
                s = s if s > 0 else torch.tensor(1.0)
                scale[e, i, j] = s
                q[e, i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (tile / s).clamp(-FP8_MAX, FP8_MAX).to(q.dtype)
    return q.reshape(*lead, n, k), scale.reshape(*lead, rows, cols)


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    n, k = q.shape[-2:]
    expanded = scale.repeat_interleave(block[0], -2)[..., :n, :].repeat_interleave(block[1], -1)[..., :k]
    return q.float() * expanded


def _quantized(name: str, tensor: torch.Tensor, kept: tuple[str, ...]) -> bool:
    if ".layers." not in name or name.startswith(("mtp.", "model.visual.")) or name.endswith(kept):
        return False
    if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
        return True
    return name.endswith(".weight") and tensor.dim() == 2


def _copy_dir(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.suffix != ".safetensors":
            shutil.copy(item, dst / item.name)


def quantize_checkpoint(src: Path, dst: Path, block: tuple[int, int],
                        kept: tuple[str, ...] = KEPT_LEAVES) -> dict[str, torch.Tensor]:
    """Write the FP8 copy of tiny model `src` into `dst` (the 2-D weights ending in one of `kept` stay
    float32); returns the stored tensors."""
    _copy_dir(src, dst)
    out = {}
    for name, tensor in load_file(str(src / "model.safetensors")).items():
        if _quantized(name, tensor, kept):
            out[name], out[name + "_scale_inv"] = quantize(tensor, block)
        else:
            out[name] = tensor
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block),
                                     "modules_to_not_convert": ["lm_head", "embed_tokens", "mlp.gate",
                                                                "shared_expert_gate", "in_proj_a", "in_proj_b",
                                                                "in_proj_ba", "visual"]}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return out


def dequantized_copy(src: Path, dst: Path) -> None:
    """Write FP8 checkpoint `src` dequantised to float32 into `dst` (a plain checkpoint)."""
    _copy_dir(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    block = tuple(json.loads((src / "config.json").read_text())["quantization_config"]["weight_block_size"])
    out = {}
    for name, tensor in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        scale = tensors.get(name + "_scale_inv")
        out[name] = tensor if scale is None else dequantize(tensor, scale, block)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config, indent=2))
