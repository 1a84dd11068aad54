"""Loader errors name the problem; dummy weights need no files."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from forkpoint import LLM, SamplingParams
from forkpoint.config import ModelConfig


@pytest.fixture()
def model_copy(moe_model, tmp_path):
    directory = tmp_path / "model"
    shutil.copytree(moe_model[0], directory)
    return directory


def edit_config(directory, **changes):
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


def test_unknown_model_type(model_copy):
    edit_config(model_copy, model_type="llama")
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        LLM(str(model_copy))


def test_missing_tensors_are_listed(model_copy):
    tensors = load_file(str(model_copy / "model.safetensors"))
    del tensors["model.layers.0.linear_attn.A_log"]
    save_file(tensors, str(model_copy / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing 1 tensors, e.g. \['model.layers.0.linear_attn.A_log'\]"):
        LLM(str(model_copy))


def test_unexpected_and_mismatched_tensors(model_copy):
    tensors = load_file(str(model_copy / "model.safetensors"))
    tensors["model.layers.0.bogus.weight"] = torch.zeros(2)
    save_file(tensors, str(model_copy / "model.safetensors"))
    with pytest.raises(ValueError, match="does not know, e.g.*bogus"):
        LLM(str(model_copy))
    del tensors["model.layers.0.bogus.weight"]
    tensors["model.norm.weight"] = torch.zeros(3)
    save_file(tensors, str(model_copy / "model.safetensors"))
    with pytest.raises(ValueError, match="shape mismatch for model.norm.weight"):
        LLM(str(model_copy))


def test_tokenizer_larger_than_embedding(model_copy):
    edit_config(model_copy, vocab_size=100)
    with pytest.raises(ValueError, match="tokenizer has 157 tokens but the model's embedding only 100"):
        LLM(str(model_copy), load_format="dummy")


def test_unreadable_files(model_copy, tmp_path):
    (model_copy / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="cannot read weights file"):
        LLM(str(model_copy))
    (model_copy / "config.json").write_text("{broken")
    with pytest.raises(ValueError, match="cannot read .*config.json"):
        LLM(str(model_copy))
    with pytest.raises(ValueError, match="no config.json"):
        LLM(str(tmp_path / "nowhere"))


def test_sharded_checkpoint_with_index(model_copy):
    tensors = load_file(str(model_copy / "model.safetensors"))
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, str(model_copy / file))
        weight_map.update({n: file for n in part})
    (model_copy / "model.safetensors").unlink()
    (model_copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    llm = LLM(str(model_copy), num_kv_blocks=32)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_dummy_weights_are_seeded_and_need_no_files(moe_model):
    config = ModelConfig.from_hf_dir(moe_model[0])
    from forkpoint.models.loader import build_model
    a = build_model(config, None, "dummy", torch.device("cpu"), torch.float32, seed=3)
    b = build_model(config, None, "dummy", torch.device("cpu"), torch.float32, seed=3)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
        assert torch.isfinite(pa).all(), name
