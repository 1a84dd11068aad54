"""Fixtures for tests/inputs: the default model is built once per session."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel

from forkpoint.inputs import LoadedTokenizer, ensure_default_model, load_tokenizer
from forkpoint.inputs.default_model import CACHE_ENV

MARKER = "<|mamba_checkpoint|>"


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model directory: the shared cache when $FORKPOINT_CACHE is set, else a fresh
    build in a session temp dir."""
    if os.environ.get(CACHE_ENV):
        return ensure_default_model()
    return ensure_default_model(tmp_path_factory.mktemp("forkpoint-cache"))


@pytest.fixture(scope="session")
def qwen(default_model_dir: Path) -> LoadedTokenizer:
    """The default model's Qwen3.5 tokenizer with the marker registered. Shared: do not mutate."""
    return load_tokenizer(default_model_dir, checkpoint_token=MARKER)


@pytest.fixture
def tiny_tokenizer_dir(tmp_path: Path) -> Path:
    """A word-level tokenizer directory with five words and no chat template (fast to load)."""
    words = ["[UNK]", "hello", "world", "foo", "bar"]
    tokenizer = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path
