"""Hub names resolve through huggingface_hub's cache: a model and its tokenizer load by `org/name` from
a cache directory in the Hub's layout with the network off."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest

from forkpoint import LLM, SamplingParams
from forkpoint.config import EngineConfig
from forkpoint.inputs.hub import resolve_engine_paths, resolve_model_dir

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


def hub_cache(root: Path, model_dir: Path, repo_id: str, commits: dict[str, str]) -> Path:
    """A Hub cache holding `model_dir`'s files as `repo_id` at each commit, with refs (name -> commit):
    root/models--org--name/{refs/<name>, snapshots/<commit>/...}."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    for name, commit in commits.items():
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / name).write_text(commit)
        snapshot = repo / "snapshots" / commit
        if not snapshot.exists():
            shutil.copytree(model_dir, snapshot)
    return root


@pytest.fixture
def offline(monkeypatch, tmp_path, moe_model):
    """HF_HUB_OFFLINE=1, HF_HUB_CACHE at a Hub-layout cache holding the tiny model as org/tiny (main) and
    org/tiny at revision v2, and every socket connection refused."""
    model_dir, _ = moe_model
    cache = hub_cache(tmp_path / "hub", model_dir, "org/tiny", {"main": COMMIT, "v2": OTHER})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))

    def refuse(*args, **kwargs):
        raise OSError("network access in an offline test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    return cache


def test_model_and_tokenizer_load_by_hub_name_offline(offline, moe_model):
    model_dir, _ = moe_model
    params = SamplingParams(temperature=0.0, max_tokens=4)
    by_name = LLM("org/tiny", max_model_len=256, max_num_seqs=4)
    assert by_name.engine.model_path == offline / "models--org--tiny" / "snapshots" / COMMIT
    by_dir = LLM(str(model_dir), tokenizer="org/tiny", max_model_len=256, max_num_seqs=4)
    prompt = "w1 w2 w3 w4 w5"
    assert by_name.get_tokenizer().encode(prompt) == by_dir.get_tokenizer().encode(prompt)
    assert by_name.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == \
        by_dir.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


def test_revision_and_download_dir(offline, tmp_path):
    config = resolve_engine_paths(EngineConfig(model="org/tiny", revision="v2", tokenizer="org/tiny",
                                               tokenizer_revision=COMMIT))
    assert Path(config.model).name == OTHER and Path(config.tokenizer).name == COMMIT
    assert resolve_engine_paths(config) == config  # local directories stay as they are
    with pytest.raises(ValueError, match="not a local directory and not in the Hub cache"):
        resolve_model_dir("org/tiny", download_dir=str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="revision v3"):
        resolve_model_dir("org/tiny", revision="v3")


def test_unknown_names_are_clear_errors(offline, tmp_path):
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE is set"):
        LLM("org/missing")
    with pytest.raises(ValueError, match="neither a local directory nor a Hugging Face Hub name"):
        resolve_model_dir(str(tmp_path / "no" / "such" / "dir"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        resolve_model_dir(str(tmp_path / "file"))


def test_without_a_network_a_cached_name_still_loads_and_a_missing_one_says_why(offline, monkeypatch):
    """HF_HUB_OFFLINE unset and no network (a node without internet access): a name in the cache
    resolves from it, one that is not fails naming the cache and the network."""
    monkeypatch.delenv("HF_HUB_OFFLINE")

    def no_dns(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "name resolution in an offline test")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    assert resolve_model_dir("org/tiny") == offline / "models--org--tiny" / "snapshots" / COMMIT
    with pytest.raises(ValueError, match="not in the Hub cache .*the Hub could not be reached: check the network"):
        resolve_model_dir("org/missing")
