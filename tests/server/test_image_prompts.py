"""The server's image hook: chat `image_url` parts become engine prompts with expanded placeholders
and decoded images, checkpoints placed after them count image tokens (no HTTP: PromptBuilder and
the engine directly, on a tiny multimodal model)."""

from __future__ import annotations

import base64
import io

import pytest

from forkpoint import LLM, SamplingParams
from forkpoint.server.config import MarkerPolicy
from forkpoint.server.errors import APIError
from forkpoint.server.prompts import PromptBuilder
from forkpoint.server.protocol import ChatMessage, ContentPart
from tests.tiny_models import random_image, words

MARKER = "<|mamba_checkpoint|>"


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def builder(llm: LLM, images=True) -> PromptBuilder:
    engine = llm.engine
    return PromptBuilder(engine.tokenizer, checkpoint_token=MARKER, checkpoint_token_id=llm.checkpoint_token_id,
                         max_checkpoints=4, policy=MarkerPolicy.ALLOW, images=engine.images if images else None)


def messages(url: str, suffix: int) -> list[ChatMessage]:
    return [ChatMessage(role="user", content=[
        ContentPart(type="text", text=words(*range(30, 45))),
        ContentPart(type="image_url", image_url={"url": url}),
        ContentPart(type="text", text=words(3, 4), checkpoint=True),
        ContentPart(type="text", text=words(suffix, 9)),
    ])]


def test_image_url_parts_reach_the_engine_expanded(tiny_model_factory):
    directory, _ = tiny_model_factory("qwen3_5_moe")
    llm = LLM(str(directory), num_kv_blocks=64, max_num_seqs=4)
    url = data_url(random_image(1, 40, 24))  # 15 image tokens
    prompts = [builder(llm).from_messages(messages(url, i)) for i in range(2)]
    # <|im_start|> user, 15 words, <|vision_start|>, 15 image tokens, <|vision_end|>, 2 words: then the marker
    assert prompts[0].checkpoint_positions == (36,)
    assert prompts[0].token_ids.count(llm.engine.model_config.vision.image_token_id) == 15
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    outs = llm.generate([p.engine_input() for p in prompts], params, use_tqdm=False)
    position = prompts[0].checkpoint_positions[0]
    assert [o.num_cached_tokens for o in outs] == [0, position]
    assert outs[0].prompt_token_ids == prompts[0].token_ids
    llm.engine.check_integrity()


def test_image_errors_are_400(tiny_model_factory):
    directory, _ = tiny_model_factory("qwen3_5_moe")
    llm = LLM(str(directory), num_kv_blocks=64, max_num_seqs=4)
    with pytest.raises(APIError, match="not fetched"):
        builder(llm).from_messages(messages("https://example.com/a.png", 1))
    with pytest.raises(APIError, match="takes no images"):
        builder(llm, images=False).from_messages(messages(data_url(random_image(1, 16, 16)), 1))
