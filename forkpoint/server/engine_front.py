"""What the HTTP front needs to know of an engine to build prompts for it: `EngineFront`.

A server whose engine runs in its own process (`--engine-process`) renders, tokenises and checks
prompts in the server process, so that work never takes the GIL the step loop needs. It needs the
engine's tokenizer (with the marker registered under the same id), its prompt limits (the KV pool's
size is known only once the engine sized its pools), the image front end, and a few settings; the
engine process sends them once, when it is ready, as this picklable value.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from forkpoint.inputs.multimodal import ImagePromptProcessor
from forkpoint.inputs.processor import InputProcessor, PromptLimits
from forkpoint.inputs.tokenizer import load_tokenizer
from forkpoint.llm import LLM


@dataclass(frozen=True)
class EngineFront:
    """model_path / tokenizer_path: the local directories the engine loaded; checkpoint_token: the marker
    string, registered in the tokenizer only when `checkpoint_token_id` is not None (checkpoints on);
    turn_boundaries: chat prompts carry their turn boundaries (automatic checkpoints on);
    default_max_tokens: generation_config.json's max_new_tokens; summary: the engine's start-up lines."""

    model_path: str
    tokenizer_path: str
    checkpoint_token: str
    checkpoint_token_id: int | None
    max_checkpoints_per_request: int
    turn_boundaries: bool
    default_max_tokens: int | None
    max_model_len: int
    images: ImagePromptProcessor
    limits: PromptLimits
    summary: tuple[str, ...]

    @staticmethod
    def of(llm: LLM, summary: list[str]) -> EngineFront:
        engine = llm.engine
        config = engine.config
        return EngineFront(
            model_path=str(engine.model_path),
            tokenizer_path=str(Path(config.tokenizer) if config.tokenizer else engine.model_path),
            checkpoint_token=config.checkpoint_token, checkpoint_token_id=llm.checkpoint_token_id,
            max_checkpoints_per_request=config.max_checkpoints_per_request,
            turn_boundaries=config.enable_checkpoints and config.auto_checkpoints,
            default_max_tokens=engine.generation_defaults.max_new_tokens, max_model_len=engine.max_model_len,
            images=engine.images, limits=engine.inputs.limits, summary=tuple(summary))

    @property
    def takes_images(self) -> bool:
        return self.images.processor is not None

    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        """The engine's tokenizer, loaded again here; raises ValueError when its marker id differs."""
        marker = self.checkpoint_token if self.checkpoint_token_id is not None else None
        loaded = load_tokenizer(Path(self.tokenizer_path), checkpoint_token=marker)
        if loaded.checkpoint_token_id != self.checkpoint_token_id:
            raise ValueError(f"the tokenizer at {self.tokenizer_path} gives the marker id {loaded.checkpoint_token_id} "
                             f"here and {self.checkpoint_token_id} in the engine process")
        return loaded.tokenizer

    def input_processor(self, tokenizer: PreTrainedTokenizerBase) -> InputProcessor:
        """The engine's prompt processing (checks, markers, images, prefix hashes) over `tokenizer`."""
        return InputProcessor(tokenizer, self.checkpoint_token_id, self.images, self.limits)
