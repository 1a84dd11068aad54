"""vLLM's default reading of JSON schemas: no properties beyond the listed ones unless the schema allows
them, compact JSON; `StructuredOutputsConfig` switches to strict JSON Schema semantics and free
whitespace."""

from __future__ import annotations

import json

import pytest

from forkpoint import LLM, SamplingParams, StructuredOutputsParams
from forkpoint.config import EngineConfig
from forkpoint.structured import GrammarCompiler
from forkpoint.structured.json_schema import forbid_additional_properties
from forkpoint.structured_outputs_config import StructuredOutputsConfig

SAME = {"type": "object", "properties": {"same": {"type": "boolean"}}, "required": ["same"]}


def test_every_listed_object_forbids_others_unless_it_says_otherwise():
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "b": {"type": "array", "items": {"properties": {"y": {}}}},
        "c": {"anyOf": [{"$ref": "#/$defs/d"}, {"type": "object", "properties": {"z": {}},
                                                 "additionalProperties": True}]},
        "e": {"type": "object"}},
        "$defs": {"d": {"type": "object", "patternProperties": {"^p": {}}}}}
    before = json.dumps(schema)
    out = forbid_additional_properties(schema)
    assert json.dumps(schema) == before  # the caller's schema is not modified
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["b"]["items"]["additionalProperties"] is False
    assert out["properties"]["c"]["anyOf"][1]["additionalProperties"] is True
    assert out["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]["e"]  # lists nothing: any object, as written


def test_config_takes_vllm_keys():
    config = EngineConfig(structured_outputs_config={"disable_any_whitespace": False})
    assert config.structured_outputs_config == StructuredOutputsConfig(disable_any_whitespace=False)
    with pytest.raises(ValueError, match="unknown keys"):
        EngineConfig(structured_outputs_config={"any_whitespace": True})
    with pytest.raises(ValueError, match="true or false"):
        EngineConfig(structured_outputs_config={"disable_any_whitespace": "no"})


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=2048, num_kv_blocks=256, checkpoint_pool_size=8)


def test_vllm_default_schema_returns_valid_json_within_40_tokens(llm):
    """The embedded random-weight model, greedy and sampled: the object closes after its one property."""
    spec = StructuredOutputsParams(json=SAME)
    params = [SamplingParams(temperature=t, seed=s, max_tokens=40, structured_outputs=spec)
              for t in (0.0, 1.0) for s in range(3)]
    for output in llm.generate(["Are these the same product? Answer in JSON."] * len(params), params,
                               use_tqdm=False):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        assert set(json.loads(completion.text)) == {"same"}
    llm.engine.check_integrity()


def _accepts(compiler: GrammarCompiler, tokenizer, text: str) -> bool:
    matcher = compiler.matcher(StructuredOutputsParams(json=SAME))
    return all(matcher.accept(t) for t in tokenizer.encode(text, add_special_tokens=False)) and matcher.is_finished


def test_strict_json_schema_and_free_whitespace_switch(llm):
    tokenizer = llm.get_tokenizer()
    default = llm.engine.grammars
    loose = GrammarCompiler(tokenizer, default.vocab_size, default.eos_token_ids,
                            options=StructuredOutputsConfig(disable_additional_properties=False,
                                                            disable_any_whitespace=False))
    assert _accepts(default, tokenizer, '{"same":true}') and _accepts(loose, tokenizer, '{"same":true}')
    assert not _accepts(default, tokenizer, '{"same":true,"other":1}')
    assert _accepts(loose, tokenizer, '{"same":true,"other":1}')
    assert not _accepts(default, tokenizer, '{ "same": true }')
    assert _accepts(loose, tokenizer, '{ "same": true }')
