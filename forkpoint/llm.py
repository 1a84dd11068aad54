"""The offline API, shaped like vLLM's `LLM`: build once, then `generate` or `chat`.

    from forkpoint import LLM, SamplingParams
    llm = LLM()                                   # embedded default model, LLM("hf_dir") or LLM("org/name")
    outs = llm.generate([anchor + "<|mamba_checkpoint|>" + q for q in questions],
                        SamplingParams(temperature=0.0, max_tokens=8))
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

from tqdm.auto import tqdm

from forkpoint.config import EngineConfig
from forkpoint.engine.engine import LLMEngine
from forkpoint.inputs.chat import chat_encoder, render_chat_with_images
from forkpoint.inputs.default_model import default_cache_root
from forkpoint.inputs.hub import resolve_engine_paths
from forkpoint.inputs.turns import reply_continues, turn_boundaries
from forkpoint.kernels.cache_dirs import configure_kernel_caches
from forkpoint.outputs import RequestOutput
from forkpoint.sampling_params import SamplingParams

logger = logging.getLogger("forkpoint")


class LLM:
    """An engine plus the offline conveniences. `model` and `tokenizer` are local directories or Hugging
    Face Hub names (`"Qwen/Qwen3.5-35B-A3B"`: downloaded once into the Hub cache, or read from it alone
    under `HF_HUB_OFFLINE=1`; `revision=`, `tokenizer_revision=` and `download_dir=` as in vLLM).
    Extra keyword arguments go to `EngineConfig`
    (e.g. `checkpoint_pool_size`, `checkpoint_wait_s`, `num_kv_blocks`, `num_state_slots`, and for
    multimodal checkpoints `max_images_per_prompt`, `image_min_pixels`, `image_max_pixels`,
    `image_embedding_cache_bytes`).

    `quantization` (vLLM's name): None reads it from the checkpoint's `quantization_config` (block-wise
    FP8 as Qwen's FP8 releases store it); "fp8" with `load_format="dummy"` builds FP8 dummy weights from
    an unquantised config. `kv_cache_dtype`: "auto" only (the KV cache in the model dtype).

    Images (multimodal Qwen3.5 checkpoints), as in vLLM::

        llm.generate({"prompt": "<|vision_start|><|image_pad|><|vision_end|>Describe it.",
                      "multi_modal_data": {"image": [pil_image_or_path]}})
        llm.chat([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}},
            {"type": "text", "text": "Describe it."}]}])
    """

    def __init__(self, model: str | None = None, *, tokenizer: str | None = None, dtype: str = "auto",
                 device: str = "auto", seed: int = 0, max_model_len: int | None = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, block_size: int = 16, enable_checkpoints: bool = True,
                 checkpoint_token: str = "<|mamba_checkpoint|>", max_checkpoints_per_request: int = 4,
                 load_format: str = "auto", quantization: str | None = None, kv_cache_dtype: str = "auto",
                 **kwargs) -> None:
        config = EngineConfig(
            model=model, tokenizer=tokenizer, dtype=dtype, device=device, seed=seed, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
            enable_checkpoints=enable_checkpoints, checkpoint_token=checkpoint_token,
            max_checkpoints_per_request=max_checkpoints_per_request, load_format=load_format,
            quantization=quantization, kv_cache_dtype=kv_cache_dtype, **kwargs,
        )
        # before anything compiles: kernels and autotune choices persist under the forkpoint cache
        caches = configure_kernel_caches(default_cache_root() / "kernels")
        logger.info("kernel caches: Triton %s (autotune choices kept: %s)", caches["TRITON_CACHE_DIR"],
                    caches["TRITON_CACHE_AUTOTUNING"] == "1")
        self.engine = LLMEngine(resolve_engine_paths(config))
        self._ids = itertools.count()

    @property
    def checkpoint_token_id(self) -> int | None:
        return self.engine.checkpoint_token_id

    def get_tokenizer(self):
        return self.engine.tokenizer

    def metrics(self) -> dict[str, int | float]:
        return self.engine.metrics()

    def checkpoint_keys(self) -> frozenset[bytes]:
        """Keys of the ready checkpoints (what a router needs to send consumers to this engine)."""
        return self.engine.checkpoint_keys()

    def reset_prefix_cache(self) -> bool:
        """Forget every checkpoint and indexed prompt (vLLM's method); False while requests run."""
        return self.engine.reset_prefix_cache()

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for one prompt or a list; outputs come back in prompt order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.engine.default_sampling_params()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts: pass one or one each")
        request_ids = []
        try:
            for prompt, param in zip(prompts, params):
                request_id = f"offline-{next(self._ids)}"
                self.engine.add_request(request_id, prompt, param, stream=False)
                request_ids.append(request_id)
        except Exception:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        return self._run(request_ids, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool = True, chat_template: str | None = None, add_generation_prompt: bool = True,
             **template_kwargs) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of conversations.
        Content may mix text parts and image parts (`image_url` with a data URL, or `image`)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        config = self.engine.config
        encode = chat_encoder(self.engine.tokenizer, chat_template=chat_template, **template_kwargs)
        prompts = []
        for conversation in conversations:
            text, images = render_chat_with_images(self.engine.tokenizer, conversation,
                                                   add_generation_prompt=add_generation_prompt,
                                                   chat_template=chat_template, **template_kwargs)
            prompt = {"prompt": text, "multi_modal_data": {"image": images}} if images else text
            turns, reusable = (), True  # where the next turn will leave this one (inputs/turns.py)
            if add_generation_prompt and config.enable_checkpoints and config.auto_checkpoints:
                ids = self.engine.tokenizer.encode(text, add_special_tokens=False)
                turns, reusable = turn_boundaries(encode, conversation, ids), reply_continues(encode, conversation, ids)
            prompts.append(self.engine.inputs.process(prompt, turn_positions=turns, turn_end_reusable=reusable))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Generating", disable=not use_tqdm) as progress:
            try:
                while pending:
                    for output in self.engine.step():
                        if output.finished and output.request_id in pending:
                            finished[output.request_id] = output
                            pending.discard(output.request_id)
                            progress.update(1)
            except BaseException:
                for request_id in pending:
                    self.engine.abort_request(request_id)
                raise
        return [finished[request_id] for request_id in request_ids]
