"""Build one rank's model shard: its slices of the safetensors tensors, or its share of the dummy weights.

Checkpoints: the loader's usual name mapping runs with a reader that indexes each safetensors slice
with the rank's ranges (`ShardLayout.read`), so a rank reads only its part of every split tensor (and
the replicated ones whole). Dummy weights: every rank draws each full tensor from the one seeded
generator in the single-process order (`forkpoint.models.loader.fill_dummy`) and keeps its part, so
TP=N holds exactly TP=1's weights; at most one full tensor exists beside the shard at a time.
The rank's model is `ParallelHybridForCausalLM` for the Qwen families and the family's own class with
swapped-in parallel modules for the Mamba2 hybrids (distributed/parallel_mamba2.py); both keep the
single-process parameter names and order.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from forkpoint.config import ModelConfig
from forkpoint.distributed.collectives import TensorParallelGroup
from forkpoint.distributed.parallel_mamba2 import parallel_mamba2_model
from forkpoint.distributed.parallel_model import ParallelHybridForCausalLM
from forkpoint.distributed.sharding import ShardLayout
from forkpoint.kernels.fp8.reference import FP8_DTYPE, quantize_blocks
from forkpoint.models.fp8_modules import SCALE_SUFFIX
from forkpoint.models.layers import stack_all_projections
from forkpoint.models.loader import fill_dummy, load_safetensors, prepare_fp8, to_model_dtype
from forkpoint.models.registry import model_class


def build_shard(layout: ShardLayout, group: TensorParallelGroup, path: Path | None, load_format: str,
                dtype: torch.dtype, seed: int, *, with_vision: bool = False) -> nn.Module:
    """The rank's model in eval mode on `group.device`, every parameter loaded (or dummy-initialised).
    `with_vision` (a Qwen multimodal checkpoint, rank 0 only): the whole vision tower too."""
    local = layout.local_config()
    with torch.device("meta"):
        model = (parallel_mamba2_model(layout, group) if local.mamba2 is not None
                 else ParallelHybridForCausalLM(local, group, layout.vocab_start, with_vision=with_vision))
    model = to_model_dtype(model, dtype)
    prepare_fp8(model, local, path, load_format)
    model.to_empty(device=group.device)
    model.init_buffers(group.device)
    if load_format == "dummy":
        _init_dummy_shard(model, layout, seed)
    else:
        if path is None:
            raise ValueError("a model path is needed unless load_format='dummy'")
        load_safetensors(model, local, path, read=layout.read)
    if local.tie_word_embeddings:
        model.lm_head.weight = model.input_embeddings().weight
    stack_all_projections(model)
    return model.eval()


def _init_dummy_shard(model: nn.Module, layout: ShardLayout, seed: int) -> None:
    config: ModelConfig = layout.config
    with torch.device("meta"):
        # shapes only: the same parameters in the same order (the vision tower's last, and only on rank 0)
        full = model_class(config)(config, with_vision=model.visual is not None)
    prepare_fp8(full, config, None, "dummy")
    full_shapes = {name: tuple(p.shape) for name, p in full.named_parameters(remove_duplicate=False)}
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in params.items():
            if name.endswith(SCALE_SUFFIX):
                continue  # filled with its weight
            if param.dtype == FP8_DTYPE:  # as loader.fill_dummy_fp8 draws it, then this rank's blocks
                values = torch.empty(full_shapes[name], dtype=torch.float32, device=device)
                q, scale = quantize_blocks(values.normal_(0.0, 0.02, generator=generator), config.quantization.block)
                param.copy_(layout.shard(name, q))
                params[name + SCALE_SUFFIX].copy_(layout.shard(name + SCALE_SUFFIX, scale))
                continue
            tensor = torch.empty(full_shapes[name], dtype=param.dtype, device=device)
            fill_dummy(name, tensor, generator, centred_norms=config.mamba2 is None)
            param.copy_(layout.shard(name, tensor))
