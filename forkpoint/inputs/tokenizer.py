"""Loading a Hugging Face tokenizer from a local directory and registering the checkpoint marker.

The marker (``checkpoint_token``, by default ``<|mamba_checkpoint|>``) must encode to exactly one
id wherever it appears in a prompt, so it is registered as a special token: special tokens are
split out of the text before normalisation and BPE, and they are dropped when decoding with
``skip_special_tokens=True``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class LoadedTokenizer:
    """A tokenizer ready for the engine.

    tokenizer: the transformers tokenizer, with the marker registered when one was asked for.
    checkpoint_token_id: the marker's id, or None when checkpoints are disabled.
    base_vocab_size: ``len(tokenizer)`` before the marker was registered; the marker's id is
        ``base_vocab_size`` when it was new, or an existing id below it when the vocabulary
        already had the token. The model loader compares both with the embedding size.
    """

    tokenizer: PreTrainedTokenizerBase
    checkpoint_token_id: int | None
    base_vocab_size: int


def load_tokenizer(path: str | os.PathLike[str], *, checkpoint_token: str | None) -> LoadedTokenizer:
    """Load the tokenizer in the directory ``path`` (``tokenizer.json``, ``tokenizer_config.json``
    and its chat template) from local files only, never the network: `tokenizer.json` through
    ``PreTrainedTokenizerFast`` exactly as written, else ``AutoTokenizer``.

    When ``checkpoint_token`` is a string, it is registered as a special token if the tokenizer
    does not already have it as an added token, and it must then encode to exactly one id.
    ``checkpoint_token=None`` disables checkpoints: nothing is registered.

    Raises ValueError naming the path when the directory or its tokenizer files are missing or
    unreadable, and naming the token when it is empty or does not encode to one id.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(
            f"tokenizer path {str(directory)!r} is not a directory: pass a Hugging Face model or "
            "tokenizer directory containing tokenizer.json and tokenizer_config.json (Hub names resolve to "
            "one through forkpoint.inputs.hub.resolve_model_dir, as LLM(...) does)"
        )
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"no tokenizer files in {str(directory)!r}: expected {' and '.join(TOKENIZER_FILES)}; "
            "pass tokenizer=... pointing at a directory that has them"
        )
    try:
        # tokenizer.json is loaded as written: AutoTokenizer would pick a class from config.json's
        # model_type and rebuild the pre-tokenizer from that class's defaults instead
        loader = PreTrainedTokenizerFast if (directory / "tokenizer.json").is_file() else AutoTokenizer
        tokenizer = loader.from_pretrained(str(directory), local_files_only=True)
    except Exception as err:  # tokenizers raises bare Exception on some malformed files
        raise ValueError(f"could not load the tokenizer in {str(directory)!r}: {err}") from err

    base_vocab_size = len(tokenizer)
    if checkpoint_token is None:
        return LoadedTokenizer(tokenizer, None, base_vocab_size)
    checkpoint_token_id = register_checkpoint_token(tokenizer, checkpoint_token)
    return LoadedTokenizer(tokenizer, checkpoint_token_id, base_vocab_size)


def register_checkpoint_token(tokenizer: PreTrainedTokenizerBase, checkpoint_token: str) -> int:
    """Register ``checkpoint_token`` as a special token of ``tokenizer`` (in place) unless it is
    already an added token, and return its id. A token that the BPE vocabulary already has keeps
    its id, so the vocabulary grows by at most one.

    Raises ValueError naming the token when it is empty or does not encode to exactly one id.
    """
    if not isinstance(checkpoint_token, str) or not checkpoint_token.strip():
        raise ValueError(
            f"checkpoint_token {checkpoint_token!r} must be a non-empty string such as "
            "'<|mamba_checkpoint|>', or None to disable checkpoints"
        )
    if checkpoint_token not in tokenizer.get_added_vocab():
        tokenizer.add_special_tokens(
            {"extra_special_tokens": [checkpoint_token]}, replace_extra_special_tokens=False
        )
    ids = tokenizer.encode(checkpoint_token, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(
            f"checkpoint_token {checkpoint_token!r} encodes to {len(ids)} ids {ids}, not exactly one: "
            "choose a token that the tokenizer keeps whole (an added special token), "
            "or pass checkpoint_token=None to disable checkpoints"
        )
    return ids[0]
