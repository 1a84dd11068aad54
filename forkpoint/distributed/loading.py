"""Build one rank's model shard: its slices of the safetensors tensors, or its share of the dummy weights.

Checkpoints: the loader's usual name mapping runs with a reader that indexes each safetensors slice
with the rank's ranges (`ShardLayout.read`), so a rank reads only its part of every split tensor (and
the replicated ones whole). Dummy weights: every rank draws each full tensor from the one seeded
generator in the single-process order (`forkpoint.models.loader.fill_dummy`) and keeps its part, so
TP=N holds exactly TP=1's weights; at most one full tensor exists beside the shard at a time.
"""

from __future__ import annotations

from pathlib import Path

import torch

from forkpoint.config import ModelConfig
from forkpoint.distributed.collectives import TensorParallelGroup
from forkpoint.distributed.parallel_model import ParallelHybridForCausalLM
from forkpoint.distributed.sharding import ShardLayout
from forkpoint.models.layers import stack_all_projections
from forkpoint.models.loader import fill_dummy, load_safetensors
from forkpoint.models.qwen3_5 import HybridForCausalLM


def build_shard(layout: ShardLayout, group: TensorParallelGroup, path: Path | None, load_format: str,
                dtype: torch.dtype, seed: int) -> ParallelHybridForCausalLM:
    """The rank's model in eval mode on `group.device`, every parameter loaded (or dummy-initialised)."""
    local = layout.local_config()
    with torch.device("meta"):
        model = ParallelHybridForCausalLM(local, group, layout.vocab_start)
    model = model.to(dtype=dtype)
    model.to_empty(device=group.device)
    model.init_buffers(group.device)
    if load_format == "dummy":
        _init_dummy_shard(model, layout, dtype, seed)
    else:
        if path is None:
            raise ValueError("a model path is needed unless load_format='dummy'")
        load_safetensors(model, local, path, read=layout.read)
    if local.tie_word_embeddings:
        model.lm_head.weight = model.input_embeddings().weight
    stack_all_projections(model)
    return model.eval()


def _init_dummy_shard(model: ParallelHybridForCausalLM, layout: ShardLayout, dtype: torch.dtype, seed: int) -> None:
    config: ModelConfig = layout.config
    with torch.device("meta"):
        full = HybridForCausalLM(config)  # shapes only: the same parameters in the same order
    full_shapes = {name: tuple(p.shape) for name, p in full.named_parameters(remove_duplicate=False)}
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            tensor = torch.empty(full_shapes[name], dtype=dtype, device=device)
            fill_dummy(name, tensor, generator, centred_norms=True)
            param.copy_(layout.shard(name, tensor))
