"""Compute kernels, one package per op.

    forkpoint/kernels/<op>/reference.py   plain PyTorch: the spec and the CPU path
    forkpoint/kernels/<op>/<variant>.py   fast GPU variant with the same signatures (optional)
    forkpoint/kernels/<op>/__init__.py    the public names; each call picks a variant

Ops: ``gated_delta`` (Gated DeltaNet), ``ssd`` (Mamba2's SSD scan), ``conv1d`` (short causal conv),
``attention`` (paged KV), ``moe`` (routed experts), and the fused elementwise glue: ``norms``
(RMSNorm, optional residual add; gated RMSNorm), ``activation`` (SwiGLU, the attention's sigmoid
gate), ``rotary`` (rotary embedding; Qwen3.5's q/k norm + rotary), ``gating`` (GDN decay and beta); ``dense``
(decode-sized projections, F.linear); ``fp8`` (projections and experts with block-wise FP8 weights). Contracts:
``docs/INTERFACES.md``, "Kernels".
"""

import functools
import importlib
import logging
from collections.abc import Sequence
from types import ModuleType

logger = logging.getLogger("forkpoint.kernels")

# (op, GPU variant) pairs that the ops' dispatch functions select between, for `kernel_variants`
GPU_VARIANTS = (
    ("gated_delta", "fla"), ("gated_delta", "triton"), ("conv1d", "triton"), ("attention", "triton"),
    ("moe", "grouped"), ("moe", "router"), ("norms", "triton"), ("activation", "triton"), ("gating", "triton"),
    ("rotary", "triton"), ("ssd", "fla"), ("ssd", "triton"), ("dense", "triton"), ("fp8", "triton"),
)


@functools.cache
def select_variant(op: str, gpu_variant: str, on_cuda: bool) -> ModuleType:
    """The module implementing ``op`` for tensors on CUDA (``on_cuda``) or elsewhere.

    On CUDA this is ``forkpoint.kernels.<op>.<gpu_variant>`` when it and its dependencies
    (triton, fla) import; otherwise, and always off CUDA, ``forkpoint.kernels.<op>.reference``.
    Cached, so the import is attempted (and the choice logged) once per process: on CUDA at INFO,
    with a WARNING when a reference op stands in for a GPU variant that could not be imported.
    """
    if on_cuda:
        try:
            module = importlib.import_module(f"forkpoint.kernels.{op}.{gpu_variant}")
        except ModuleNotFoundError as err:
            logger.warning("kernel %s: CUDA runs the PyTorch reference instead of %s, because %r is not installed "
                           "(GPU variants need `pip install forkpoint[gpu]`): expect a much slower forward",
                           op, gpu_variant, err.name)
        else:
            logger.info("kernel %s: %s (CUDA)", op, gpu_variant)
            return module
    else:
        logger.debug("kernel %s: reference (not CUDA)", op)
    return importlib.import_module(f"forkpoint.kernels.{op}.reference")


def kernel_variants(on_cuda: bool) -> dict[str, str]:
    """{"op" or "op/variant": the variant that runs} for every op and GPU variant, e.g.
    ``{"gated_delta/fla": "fla", "gated_delta/triton": "reference", ...}`` (for start-up logs)."""
    chosen = {}
    for op, variant in GPU_VARIANTS:
        name = op if sum(o == op for o, _ in GPU_VARIANTS) == 1 else f"{op}/{variant}"
        chosen[name] = select_variant(op, variant, on_cuda).__name__.rsplit(".", 1)[-1]
    return chosen


def check_cu_seqlens(cu_seqlens_host: Sequence[int], num_tokens: int, name: str = "cu_seqlens_host") -> int:
    """Validate host offsets of a packed batch and return the number of segments N.

    ``cu_seqlens_host`` must be ``[0, ..., num_tokens]``, non-decreasing, with N + 1 entries.
    """
    if len(cu_seqlens_host) < 1 or cu_seqlens_host[0] != 0 or cu_seqlens_host[-1] != num_tokens:
        raise ValueError(
            f"{name} must run from 0 to the number of packed tokens ({num_tokens}), "
            f"got {list(cu_seqlens_host)[:8]}{'...' if len(cu_seqlens_host) > 8 else ''}"
        )
    if any(b < a for a, b in zip(cu_seqlens_host, cu_seqlens_host[1:])):
        raise ValueError(f"{name} must be non-decreasing (segment lengths >= 0), got {list(cu_seqlens_host)}")
    return len(cu_seqlens_host) - 1
