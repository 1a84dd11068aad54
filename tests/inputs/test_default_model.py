"""The embedded default model: layout, tensor names, a non-degenerate forward, cache behaviour."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import Qwen3_5MoeForCausalLM

from forkpoint.inputs import DEFAULT_MODEL_NOTICE, LoadedTokenizer, default_model, ensure_default_model
from forkpoint.inputs.default_model import COMPLETE_MARKER, DEFAULT_MODEL_NAME, default_cache_root


@pytest.fixture(scope="module")
def model(default_model_dir: Path) -> Qwen3_5MoeForCausalLM:
    loaded, info = Qwen3_5MoeForCausalLM.from_pretrained(
        str(default_model_dir), dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    return loaded.eval()


def test_directory_layout(default_model_dir: Path):
    assert default_model_dir.name == DEFAULT_MODEL_NAME
    names = {p.name for p in default_model_dir.iterdir()}
    assert names == {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                     "tokenizer_config.json", "README.md", COMPLETE_MARKER}
    marker = json.loads((default_model_dir / COMPLETE_MARKER).read_text())
    assert marker["random_weights"] is True
    assert "RANDOM weights" in (default_model_dir / "README.md").read_text()
    generation = json.loads((default_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [248046, 248044]
    assert generation["max_new_tokens"] == default_model.MAX_NEW_TOKENS  # requests without max_tokens stop there
    config = json.loads((default_model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_moe_text"
    assert config["architectures"] == ["Qwen3_5MoeForCausalLM"]
    assert (config["vocab_size"], config["hidden_size"], config["num_experts"]) == (248320, 256, 8)
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert config["tie_word_embeddings"] is True
    assert config["eos_token_id"] == 248046


def test_tensor_names_and_dtype(default_model_dir: Path):
    with safe_open(str(default_model_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert {f.get_slice(n).get_dtype() for n in names} == {"BF16"}
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [248320, 256]
    assert "lm_head.weight" not in names  # tied
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in names  # stored per expert
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in names
    assert "model.layers.3.self_attn.q_norm.weight" in names
    assert not any(n.startswith("model.layers.3.linear_attn") for n in names)


def test_forward_is_not_degenerate(model: Qwen3_5MoeForCausalLM, qwen: LoadedTokenizer):
    ids = torch.tensor([qwen.tokenizer.encode("The quick brown fox jumps over the lazy dog, and then")])
    with torch.no_grad():
        logits = model(ids).logits[0]
        changed = ids.clone()
        changed[0, 0] = 1234
        changed_logits = model(changed).logits[0]
    assert 1.0 < logits.std(dim=-1).mean().item() < 5.0
    assert len(set(logits.argmax(-1).tolist())) > len(ids[0]) // 2
    # The first token still moves the last logits through the recurrent state and attention.
    assert (changed_logits[-1] - logits[-1]).std().item() > 0.5


def test_greedy_generation_varies(model: Qwen3_5MoeForCausalLM, qwen: LoadedTokenizer):
    ids = torch.tensor([qwen.tokenizer.encode("Once upon a time")])
    out = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist()
    assert len(out) == 8 and len(set(out)) > 2


def test_second_call_reuses_the_build(default_model_dir: Path):
    stamp = (default_model_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model(default_model_dir.parent) == default_model_dir
    assert (default_model_dir / "model.safetensors").stat().st_mtime_ns == stamp


def test_incomplete_directory_is_an_error(tmp_path: Path):
    (tmp_path / DEFAULT_MODEL_NAME).mkdir()
    with pytest.raises(ValueError, match="is not a complete forkpoint default model .* delete it"):
        ensure_default_model(tmp_path)


def test_concurrent_build_finishing_first_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def racing_build(directory: Path) -> None:
        (directory / COMPLETE_MARKER).write_text("{}")
        other = tmp_path / DEFAULT_MODEL_NAME  # another process renames its build in first
        other.mkdir()
        (other / COMPLETE_MARKER).write_text('{"winner": true}')

    monkeypatch.setattr(default_model, "build_default_model", racing_build)
    target = ensure_default_model(tmp_path)
    assert json.loads((target / COMPLETE_MARKER).read_text()) == {"winner": True}
    assert [p.name for p in tmp_path.iterdir()] == [DEFAULT_MODEL_NAME]  # no staging left


def test_failed_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def failing_build(directory: Path) -> None:
        (directory / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(default_model, "build_default_model", failing_build)
    with pytest.raises(RuntimeError, match="disk full"):
        ensure_default_model(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_cache_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("FORKPOINT_CACHE", str(tmp_path))
    assert default_cache_root() == tmp_path
    monkeypatch.delenv("FORKPOINT_CACHE")
    assert default_cache_root() == Path.home() / ".cache" / "forkpoint"


def test_notice_says_random_and_how_to_load_a_real_model():
    assert "RANDOM weights" in DEFAULT_MODEL_NOTICE
    assert 'LLM(model="path/to/model")' in DEFAULT_MODEL_NOTICE
    assert "forkpoint generate --model" in DEFAULT_MODEL_NOTICE
