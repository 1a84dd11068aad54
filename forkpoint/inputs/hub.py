"""Model names to local directories: a local directory as it is, a Hugging Face Hub name (`org/name`)
through `huggingface_hub`'s cache, as vLLM resolves them.

    resolve_model_dir("Qwen/Qwen3.5-35B-A3B")           # downloads once, then ~/.cache/huggingface/hub/...
    resolve_model_dir("org/name", revision="v1.0")      # a branch, tag or commit
    HF_HUB_OFFLINE=1 ...                                # the cache only, never the network

The environment is read at call time (not when `huggingface_hub` was imported), so `HF_HUB_OFFLINE`
and `HF_HUB_CACHE` set after start-up count.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import validate_repo_id

from forkpoint.config import EngineConfig

# what a model directory needs: config, generation defaults, tokenizer and template files, image
# preprocessing; weights are added unless only the config is read (load_format="dummy")
CONFIG_PATTERNS = ("*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken")
WEIGHT_PATTERNS = ("*.safetensors",)
_TRUE = {"1", "on", "yes", "true"}


def hub_offline() -> bool:
    """Whether `HF_HUB_OFFLINE` (or the older `TRANSFORMERS_OFFLINE`) asks for the cache only."""
    return any(os.environ.get(name, "").strip().lower() in _TRUE for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def resolve_model_dir(model: str, *, revision: str | None = None, download_dir: str | None = None,
                      weights: bool = True, what: str = "model") -> Path:
    """The local directory holding `model`.

    model: an existing local directory (returned as it is; `revision` does not apply), or a Hub
        repository id `org/name` (or `name`), looked up in `download_dir` (default: `HF_HUB_CACHE`, else
        huggingface_hub's default cache) and downloaded there when missing, unless offline.
    revision: branch, tag or commit of a Hub repository (default: main).
    weights: also fetch `*.safetensors` (False for `load_format="dummy"` and tokenizers).
    what: "model" or "tokenizer", for the messages.

    Raises ValueError naming `model` and the fix when it is a file, neither a directory nor a valid
    repository id, not in the cache while offline, or not on the Hub (or gated, or no such revision).
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"{what} path {model!r} is a file, not a directory: pass a Hugging Face model directory "
                         "(config.json, weights, tokenizer files) or a Hub name such as 'Qwen/Qwen3.5-35B-A3B'")
    if path.is_absolute() or model.startswith((".", "~")) or model.count("/") > 1:
        raise ValueError(f"{what} path {model!r} does not exist (no config.json there), so it is neither a local "
                         "directory nor a Hugging Face Hub name ('org/name'): pass an existing model directory, or a "
                         "Hub name such as 'Qwen/Qwen3.5-35B-A3B'")
    try:
        validate_repo_id(model)
    except HFValidationError as err:
        raise ValueError(f"{what} {model!r} is neither a local directory nor a Hugging Face Hub name ('org/name'): "
                         f"{err}") from err
    offline = hub_offline()
    cache_dir = download_dir or os.environ.get("HF_HUB_CACHE") or None
    patterns = list(CONFIG_PATTERNS + (WEIGHT_PATTERNS if weights else ()))
    where = f"in the Hub cache {cache_dir}" if cache_dir else "in the Hub cache"
    try:
        local = snapshot_download(model, revision=revision, cache_dir=cache_dir, local_files_only=offline,
                                  allow_patterns=patterns)
    except LocalEntryNotFoundError as err:
        fix = ("HF_HUB_OFFLINE is set: download it once online (or unset HF_HUB_OFFLINE), or pass a local directory"
               if offline else "the Hub could not be reached: check the network, or pass a local directory")
        raise ValueError(f"{what} {model!r} (revision {revision or 'main'}) is not a local directory and not "
                         f"{where}; {fix} ({err})") from err
    except RevisionNotFoundError as err:
        raise ValueError(f"{what} {model!r} has no revision {revision!r} on the Hub: pass an existing branch, tag "
                         "or commit") from err
    except GatedRepoError as err:
        raise ValueError(f"{what} {model!r} is gated on the Hub: accept its terms on huggingface.co and log in "
                         "(`hf auth login` or HF_TOKEN)") from err
    except RepositoryNotFoundError as err:
        raise ValueError(f"{what} {model!r} is not a local directory and no such Hub repository exists (or it is "
                         "private: log in with `hf auth login` or HF_TOKEN)") from err
    return Path(local)


def resolve_engine_paths(config: EngineConfig) -> EngineConfig:
    """`config` with `model` and `tokenizer` as local directories (`resolve_model_dir`): the model with
    `revision` (weights unless `load_format="dummy"`), a separate tokenizer with `tokenizer_revision`,
    both under `download_dir`. `model=None` (the embedded default) stays None. Idempotent."""
    model, tokenizer = config.model, config.tokenizer
    if model is not None:
        model = str(resolve_model_dir(model, revision=config.revision, download_dir=config.download_dir,
                                      weights=config.load_format != "dummy"))
    if tokenizer is not None:
        tokenizer = str(resolve_model_dir(tokenizer, revision=config.tokenizer_revision,
                                          download_dir=config.download_dir, weights=False, what="tokenizer"))
    if (model, tokenizer) == (config.model, config.tokenizer):
        return config
    return dataclasses.replace(config, model=model, tokenizer=tokenizer)
