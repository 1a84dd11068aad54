"""The server's image hook: chat `image_url` parts become engine prompts with expanded placeholders
and decoded images (decoded off the event loop), checkpoints placed after them count image tokens;
then the same over HTTP, with the 400s of bad images and of images sent to /v1/completions (tiny
multimodal model)."""

from __future__ import annotations

import asyncio
import base64
import io
import threading

import pytest

from forkpoint import LLM, SamplingParams
from forkpoint.server.config import MarkerPolicy, ServerConfig
from forkpoint.server.errors import APIError
from forkpoint.server.prompts import PromptBuilder
from forkpoint.server.protocol import ChatMessage, ContentPart
from tests.server.conftest import serve
from tests.tiny_models import IMAGE, random_image, words

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


def test_images_are_decoded_off_the_event_loop(tiny_model_factory, monkeypatch):
    """The handlers' `from_messages_async` decodes images in a worker thread (a large photograph
    takes tens of milliseconds to decode and hash: on the loop it would stall every stream) and
    builds the same prompt as `from_messages`."""
    directory, _ = tiny_model_factory("qwen3_5_moe")
    llm = LLM(str(directory), num_kv_blocks=64, max_num_seqs=4)
    prompts = builder(llm)
    load, threads = prompts.images.load, []

    def spy(data):
        threads.append(threading.get_ident())
        return load(data)

    monkeypatch.setattr(prompts.images, "load", spy)
    request = messages(data_url(random_image(3, 40, 24)), 1)

    async def on_the_loop():
        return threading.get_ident(), await prompts.from_messages_async(request)

    loop_thread, prompt = asyncio.run(on_the_loop())
    assert threads and threads[0] != loop_thread
    expected = prompts.from_messages(request)
    assert (prompt.token_ids, prompt.checkpoint_positions) == (expected.token_ids, expected.checkpoint_positions)
    assert [i.content_hash for i in prompt.multi_modal_data["image"]] == [
        i.content_hash for i in expected.multi_modal_data["image"]]
    with pytest.raises(APIError, match="cannot be decoded|not an image"):
        asyncio.run(prompts.from_messages_async(messages("data:image/png;base64,aGVsbG8=", 1)))


def test_images_over_http(tiny_model_factory):
    """Chat with image_url parts over HTTP: the second request reuses the checkpoint after the
    image; bad image data is a 400; /v1/completions and /tokenize refuse images with a 400 that
    says where images go."""
    directory, _ = tiny_model_factory("qwen3_5_moe")
    llm = LLM(str(directory), num_kv_blocks=128, max_num_seqs=4)
    url = data_url(random_image(1, 40, 24))
    with serve(llm, ServerConfig()) as srv:
        bodies = [{"model": srv.model, "max_tokens": 1, "temperature": 0.0,
                   "messages": [m.model_dump(exclude_none=True) for m in messages(url, i)]} for i in range(2)]
        responses = [srv.post("/v1/chat/completions", json=body) for body in bodies]
        assert [r.status_code for r in responses] == [200, 200], responses[0].text
        position = builder(llm).from_messages(messages(url, 0)).checkpoint_positions[0]
        assert responses[1].json()["usage"]["prompt_tokens_details"]["cached_tokens"] == position
        tokenized = srv.post("/tokenize", json={"model": srv.model, "messages": bodies[0]["messages"]}).json()
        assert tokenized["checkpoint_positions"] == [position]

        bad = {**bodies[0], "messages": [m.model_dump(exclude_none=True)
                                         for m in messages("data:image/png;base64,aGVsbG8=", 0)]}
        response = srv.post("/v1/chat/completions", json=bad)
        assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
        assert "image 0" in response.json()["error"]["message"]

        cases = [({"prompt": [{"type": "image_url", "image_url": {"url": url}}]}, "prompt"),
                 ({"prompt": {"prompt": "w1", "multi_modal_data": {"image": [url]}}}, "prompt"),
                 ({"prompt": "w1 w2", "multi_modal_data": {"image": [url]}}, "multi_modal_data"),
                 ({"prompt": f"w1 {IMAGE} w2"}, "prompt")]
        for body, param in cases:
            response = srv.post("/v1/completions", json={"model": srv.model, "max_tokens": 1, **body})
            error = response.json()["error"]
            assert response.status_code == 400 and error["param"] == param, response.text
            assert "/v1/chat/completions" in error["message"]
        srv.wait_idle()
        srv.engine_call(lambda engine: engine.check_integrity())
