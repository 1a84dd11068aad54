"""Every registered family's model class implements the model interface (models/interface.py):
each method of `CausalLM` with the same parameters, `isinstance` on built models, and the one
method a family could leave out unnoticed (`attention_core`: only Falcon-H1 reaches it in the
piecewise forward) agrees with `core` on attention layers."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from forkpoint import LLM, SamplingParams
from forkpoint.config import ModelConfig
from forkpoint.distributed.parallel_model import ParallelHybridForCausalLM
from forkpoint.models.interface import CausalLM
from forkpoint.models.registry import model_class, supported_model_types
from tests.tiny_models import MAMBA2_MODEL_TYPES

METHODS = [name for name, member in vars(CausalLM).items() if inspect.isfunction(member) and not name.startswith("_")]
ATTRIBUTES = ("config", "visual", "lm_head", "mtp")
CLASSES = sorted({model_class(SimpleNamespace(model_type=t, architectures=())) for t in supported_model_types()},
                 key=lambda cls: cls.__name__) + [ParallelHybridForCausalLM]


def parameters(function) -> list[tuple[str, object, bool]]:
    """(name, kind, has a default) of each parameter: what a caller relies on, annotations aside."""
    return [(p.name, p.kind, p.default is not inspect.Parameter.empty)
            for p in inspect.signature(function).parameters.values()]


def test_the_interface_names_what_the_runner_calls():
    assert {"embed", "project", "core", "finish", "compute_logits", "core_kind", "core_shape", "projection_width",
            "recurrent_core", "recurrent_core_params", "attention_core", "forward", "pool_shapes",
            "input_embeddings", "init_buffers"} <= set(METHODS)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: cls.__name__)
def test_each_family_class_implements_every_method_with_its_parameters(cls):
    for name in METHODS:
        implementation = getattr(cls, name, None)
        assert callable(implementation), f"{cls.__name__} lacks {name}"
        assert parameters(implementation) == parameters(getattr(CausalLM, name)), f"{cls.__name__}.{name}"


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_5_moe", *MAMBA2_MODEL_TYPES])
def test_built_models_are_instances_and_refuse_attention_cores_of_other_layers(tiny_model_factory, model_type):
    directory, _ = tiny_model_factory(model_type)
    config = ModelConfig.from_hf_dir(directory)
    with torch.device("meta"):
        model = model_class(config)(config, with_vision=True)
    assert isinstance(model, CausalLM)
    for name in ATTRIBUTES:
        assert hasattr(model, name), name
    without = [i for i in range(config.num_layers) if model.core_kind(i) not in ("attention", "parallel")]
    for layer_id in without:
        with pytest.raises(ValueError, match=f"layer {layer_id} .*no attention core"):
            model.attention_core(layer_id, None, None, None, None)
    assert without or model_type == "falcon_h1"  # Falcon-H1: every layer is parallel


class AttentionCores:
    """Stands in for `ModelRunner.forward`: per step, runs every attention layer's `core` and its
    `attention_core` on the same projection and pools, and checks they write the same bytes."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.compared = 0

    def __call__(self, batch):
        model, caches = self.runner.model, self.runner.caches
        with torch.inference_mode():
            positions = batch.positions if batch.mrope_positions is None else batch.mrope_positions
            hidden, cos_sin = model.embed(batch.input_ids, positions, batch.embedding_overrides)
            for layer_id in range(model.config.num_layers):
                if model.core_kind(layer_id) != "attention":
                    continue
                p = model.project(layer_id, hidden, cos_sin)
                saved = [t.clone() for t in (*caches.k, *caches.v)]
                expected = model.core(layer_id, p, batch, caches)
                for tensor, before in zip((*caches.k, *caches.v), saved):
                    tensor.copy_(before)
                out = torch.full_like(expected, float("nan"))
                model.attention_core(layer_id, p, batch, caches, out)
                assert torch.equal(out, expected)
                self.compared += 1
        return model(batch, caches)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "nemotron_h"])
def test_attention_core_equals_core_on_attention_layers(tiny_model_factory, model_type):
    directory, _ = tiny_model_factory(model_type)
    llm = LLM(str(directory), num_kv_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    runner = llm.engine.runner
    cores = AttentionCores(runner)
    runner.forward = cores
    anchor = " ".join(f"w{i}" for i in range(9))  # 9 tokens: the shared last block is partial (copy-on-write)
    llm.generate([f"{anchor} <|mamba_checkpoint|> w30", f"{anchor} w31 w32"],
                 SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert cores.compared >= 3  # prefill and decode steps
