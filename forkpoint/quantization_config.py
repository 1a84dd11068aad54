"""The quantisation of a checkpoint's weights (`Fp8BlockQuantization`, read from config.json's
`quantization_config`), part of `ModelConfig` (config.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fp8BlockQuantization:
    """Block-wise FP8 weights as Qwen's FP8 releases store them (config.json `quantization_config`:
    `quant_method: "fp8"`, `fmt: "e4m3"`, `activation_scheme: "dynamic"`, `weight_block_size: [bn, bk]`).

    Each quantised weight W [N, K] is stored as `float8_e4m3fn` with a float32 `<name>_scale_inv`
    [ceil(N / bn), ceil(K / bk)] (one scale per bn x bk block; kernels/fp8/reference.py). Which modules
    are quantised is read from the checkpoint (the tensors that have a scale); `modules_to_not_convert`
    (or vLLM's `ignored_layers`) only steers dummy weights (models/fp8_modules.py)."""

    block: tuple[int, int] = (128, 128)
    modules_to_not_convert: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, raw: dict) -> Fp8BlockQuantization:
        """Validate a checkpoint's `quantization_config`; ValueError naming the field that forkpoint does
        not support, and what it does support."""
        method = raw.get("quant_method")
        if method != "fp8":
            raise ValueError(f"quantization_config.quant_method {method!r} is not supported: forkpoint loads "
                             "block-wise FP8 checkpoints (quant_method 'fp8', as Qwen's FP8 releases) and unquantised "
                             "ones; use the bf16 release of this model")
        fmt = raw.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"quantization_config.fmt {fmt!r} is not supported: only 'e4m3' (float8_e4m3fn) weights")
        scheme = raw.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ValueError(f"quantization_config.activation_scheme {scheme!r} is not supported: only 'dynamic' "
                             "(activations quantised per token group at run time, no stored input scales)")
        block = raw.get("weight_block_size")
        if block is None:
            raise ValueError("quantization_config.weight_block_size is missing: per-tensor FP8 scales are not "
                             "supported, only block-wise FP8 (weight_block_size [bn, bk], e.g. [128, 128])")
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ValueError(f"quantization_config.weight_block_size must be two positive integers [bn, bk], "
                             f"got {block!r}")
        if raw.get("kv_cache_scheme"):
            raise ValueError("quantization_config.kv_cache_scheme is not supported: forkpoint keeps the KV cache in "
                             "the model dtype (kv_cache_dtype='auto')")
        skipped = list(raw.get("modules_to_not_convert") or []) + list(raw.get("ignored_layers") or [])
        if not all(isinstance(name, str) for name in skipped):
            raise ValueError(f"quantization_config.modules_to_not_convert must list module names, got {skipped!r}")
        return cls(block=(int(block[0]), int(block[1])), modules_to_not_convert=tuple(skipped))

    def to_dict(self) -> dict:
        """The `quantization_config` entry of config.json that `from_dict` reads back to this value."""
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(self.block), "modules_to_not_convert": list(self.modules_to_not_convert)}
