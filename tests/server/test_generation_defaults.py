"""generation_config.json's max_new_tokens is the default max_tokens, offline and over HTTP."""

from __future__ import annotations

import json
import shutil

import pytest

from forkpoint import LLM, SamplingParams
from forkpoint.inputs.generation_config import GenerationDefaults
from forkpoint.server.config import ServerConfig
from tests.server.conftest import serve


def test_reading(tmp_path):
    assert GenerationDefaults.from_model_dir(tmp_path) == GenerationDefaults()
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 7, "eos_token_id": 1}))
    assert GenerationDefaults.from_model_dir(tmp_path).max_new_tokens == 7
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 0}))
    with pytest.raises(ValueError, match="max_new_tokens"):
        GenerationDefaults.from_model_dir(tmp_path)


@pytest.fixture(scope="module")
def llm(moe_model, tmp_path_factory):
    directory = tmp_path_factory.mktemp("generation_config")
    shutil.copytree(moe_model[0], directory, dirs_exist_ok=True)
    (directory / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3, "eos_token_id": 1}))
    return LLM(str(directory), num_kv_blocks=64, max_model_len=256)


def test_offline_default(llm):
    ignore = SamplingParams(max_tokens=None, ignore_eos=True)
    assert len(llm.generate("w1 w2", ignore, use_tqdm=False)[0].outputs[0].token_ids) == 3
    assert llm.engine.default_sampling_params().max_tokens == 3
    explicit = SamplingParams(max_tokens=5, ignore_eos=True)  # a request's own max_tokens wins
    assert len(llm.generate("w1 w2", explicit, use_tqdm=False)[0].outputs[0].token_ids) == 5


def test_server_default(llm):
    with serve(llm, ServerConfig(served_model_name="tiny")) as server:
        client = server.client()
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w1"}],
                                              extra_body={"ignore_eos": True})
        assert chat.usage.completion_tokens == 3
        out = client.completions.create(model="tiny", prompt="w1 w2", extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 3  # min(OpenAI's 16, the model's 3)
        out = client.completions.create(model="tiny", prompt="w1 w2", max_tokens=6, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 6
