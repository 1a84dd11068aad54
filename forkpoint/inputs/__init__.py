"""Prompt inputs: tokenizer loading, chat templates, checkpoint-marker parsing, and the embedded
default model (a small random-weight Qwen3.5-MoE with the real Qwen3.5 tokenizer)."""

from forkpoint.inputs.chat import render_chat, render_chat_with_images
from forkpoint.inputs.default_model import DEFAULT_MODEL_NOTICE, ensure_default_model
from forkpoint.inputs.markers import (
    ParsedPrompt,
    RawPrompt,
    prompt_to_token_ids,
    strip_checkpoint_markers,
    validate_token_ids,
)
from forkpoint.inputs.tokenizer import LoadedTokenizer, load_tokenizer, register_checkpoint_token

__all__ = [
    "DEFAULT_MODEL_NOTICE",
    "LoadedTokenizer",
    "ParsedPrompt",
    "RawPrompt",
    "ensure_default_model",
    "load_tokenizer",
    "prompt_to_token_ids",
    "register_checkpoint_token",
    "render_chat",
    "render_chat_with_images",
    "strip_checkpoint_markers",
    "validate_token_ids",
]
