"""Structured outputs: bitmask application against a per-token reference, grammar compilation and
caching, and every mode obeyed under sampling on the embedded default model (real Qwen3.5 tokenizer)."""

from __future__ import annotations

import dataclasses
import gc
import json
import re
import threading
import time

import pytest
import torch

from forkpoint import LLM, SamplingParams, StructuredOutputsParams
from forkpoint.structured import apply_bitmask_
from forkpoint.structured.bitmask import unpack_bitmask


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100])
def test_bitmask_matches_per_token_reference(vocab):
    generator = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, words), dtype=torch.int32, generator=generator)
    allowed = unpack_bitmask(bitmask, vocab)
    for r in range(3):
        for t in range(vocab):
            assert bool(allowed[r, t]) == bool((int(bitmask[r, t // 32]) >> (t % 32)) & 1)
    logits = torch.randn(5, vocab, generator=generator)
    got = logits.clone()
    rows = torch.tensor([4, 0, 2])
    apply_bitmask_(got, rows, bitmask)
    for i, r in enumerate(rows.tolist()):
        expected = logits[r].masked_fill(~allowed[i], float("-inf"))
        assert torch.equal(got[r], expected)
    assert torch.equal(got[[1, 3]], logits[[1, 3]])  # rows without a grammar untouched


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=2048, num_kv_blocks=512, checkpoint_pool_size=8)


def test_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="choice has 4097 strings; at most 4096"):
        StructuredOutputsParams(choice=[f"c{i}" for i in range(4097)])
    assert len(StructuredOutputsParams(choice=[f"c{i}" for i in range(4096)]).choice) == 4096
    with pytest.raises(ValueError, match="json"):
        StructuredOutputsParams(json="{not json")


def test_invalid_grammar_is_a_value_error_and_leaves_nothing(llm):
    engine = llm.engine
    for bad in (StructuredOutputsParams(regex="[unclosed"), StructuredOutputsParams(grammar="start: missing_rule")):
        with pytest.raises(ValueError, match="does not compile"):
            llm.generate("x", SamplingParams(structured_outputs=bad), use_tqdm=False)
    assert not engine.has_unfinished_requests()
    engine.check_integrity()


def test_compiled_grammars_are_cached(llm):
    compiler = llm.engine.grammars
    spec = StructuredOutputsParams(choice=["alpha", "beta"])
    before = compiler.num_compiled
    first = compiler.matcher(spec)
    second = compiler.matcher(StructuredOutputsParams(choice=["alpha", "beta"]))
    assert compiler.num_compiled == before + 1
    tokenizer = llm.get_tokenizer()
    allowed = first.allowed_token_ids(compiler.vocab_size)
    assert allowed and all("alpha".startswith(t) or "beta".startswith(t) for t in map(tokenizer.decode,
                                                                                           ([i] for i in allowed)))
    assert first.accept(tokenizer.encode("alpha", add_special_tokens=False)[0])
    assert second.allowed_token_ids(compiler.vocab_size) == allowed  # copies do not share state
    del first, second


def test_two_threads_compile_one_new_constraint_once(llm, monkeypatch):
    """Both threads get the grammar; the one that finds it being compiled waits for that compile (slowed
    here to 0.3 s so that the two overlap; llguidance, like the sleep, releases the GIL)."""
    compiler = llm.engine.grammars
    real_compile = compiler._compile
    calls: list[StructuredOutputsParams] = []

    def slow_compile(spec):
        calls.append(spec)
        time.sleep(0.3)
        return real_compile(spec)

    monkeypatch.setattr(compiler, "_compile", slow_compile)
    spec = StructuredOutputsParams(choice=[f"twin{i}" for i in range(512)])
    before = compiler.num_compiled
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def compile_it() -> None:
        barrier.wait()
        try:
            compiler.ensure_compiled(spec)
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=compile_it) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors and len(calls) == 1
    assert compiler.num_compiled == before + 1 and compiler.num_compiling == 0


def test_an_ahead_compile_raises_the_matchers_error_and_leaves_nothing_in_flight(llm):
    compiler = llm.engine.grammars
    before = compiler.num_compiled
    for bad in (StructuredOutputsParams(regex="[still unclosed"), StructuredOutputsParams(grammar="start: nowhere")):
        with pytest.raises(ValueError, match=f"structured_outputs.{bad.kind} does not compile"):
            compiler.ensure_compiled(bad)
        assert compiler.num_compiling == 0
        with pytest.raises(ValueError, match="does not compile"):  # a later call compiles (and fails) again
            compiler.matcher(bad)
        assert compiler.num_compiling == 0
    assert compiler.num_compiled == before


def test_a_matcher_after_an_ahead_compile_is_a_cache_hit(llm):
    compiler = llm.engine.grammars
    spec = StructuredOutputsParams(regex="[0-9]{3}-ahead")
    compiler.ensure_compiled(spec)
    compiled = compiler.num_compiled
    compiler.ensure_compiled(spec)
    matcher = compiler.matcher(StructuredOutputsParams(regex="[0-9]{3}-ahead"))
    assert compiler.num_compiled == compiled
    tokenizer = llm.get_tokenizer()
    allowed = {tokenizer.decode([i]) for i in matcher.allowed_token_ids(compiler.vocab_size)}
    assert allowed and all(text.isdigit() for text in allowed)
    del matcher


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 3},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "count", "ok"], "additionalProperties": False}
MODES = [
    (StructuredOutputsParams(choice=["yes", "no", "not sure"]), lambda text: text in ("yes", "no", "not sure")),
    (StructuredOutputsParams(regex=r"[A-Z][a-z]{1,4}-[0-9]{2}"),
     lambda text: re.fullmatch(r"[A-Z][a-z]{1,4}-[0-9]{2}", text) is not None),
    (StructuredOutputsParams(json=SCHEMA), lambda text: _matches_schema(json.loads(text))),
    (StructuredOutputsParams(grammar='start: "(" num ("+" num)* ")"\nnum: /[0-9]/'),
     lambda text: re.fullmatch(r"\([0-9](\+[0-9])*\)", text) is not None),
]


def _matches_schema(value) -> bool:
    return (set(value) == {"name", "count", "ok"} and isinstance(value["name"], str) and len(value["name"]) <= 3
            and isinstance(value["count"], int) and 0 <= value["count"] <= 9 and isinstance(value["ok"], bool))


@pytest.mark.parametrize("spec, obeys", MODES, ids=["choice", "regex", "json", "grammar"])
def test_each_mode_is_obeyed_under_sampling(llm, spec, obeys):
    params = SamplingParams(n=2, temperature=1.5, seed=7, max_tokens=32, structured_outputs=spec)
    outputs = llm.generate(["Q: anything<|mamba_checkpoint|> A:"], params, use_tqdm=False)
    for output in outputs:
        for completion in output.outputs:
            assert completion.finish_reason == "stop", completion.text
            assert obeys(completion.text), completion.text
    del outputs
    gc.collect()
    assert llm.engine.grammars.num_live_matchers == 0  # released when the prompts left
    llm.engine.check_integrity()


def test_abort_releases_the_matcher(llm):
    engine = llm.engine
    engine.add_request("so-abort", "Answer:", SamplingParams(max_tokens=30, structured_outputs=StructuredOutputsParams(
        regex="[a-z]{40}")))
    engine.step()
    assert engine.grammars.num_live_matchers == 1
    engine.abort_request("so-abort")
    while engine.has_unfinished_requests():
        engine.step()
    gc.collect()
    assert engine.grammars.num_live_matchers == 0
    engine.check_integrity()


def test_processors_offline(llm):
    tokenizer = llm.get_tokenizer()
    yes, no = (tokenizer.encode(w, add_special_tokens=False)[0] for w in (" yes", " no"))
    out = llm.generate("Same product? Answer:", SamplingParams(temperature=1.0, seed=3, max_tokens=6,
                                                                allowed_token_ids=[yes, no]), use_tqdm=False)[0]
    assert set(out.outputs[0].token_ids) <= {yes, no}
    out = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=3, logit_bias={yes: 100.0}),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [yes] * 3
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=4, min_tokens=3, logit_bias={eos: 100.0}),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids[:2] != [eos, eos] and eos not in out.outputs[0].token_ids[:3]
    assert out.outputs[0].token_ids[3] == eos and out.outputs[0].finish_reason == "stop"
    biased = SamplingParams(temperature=0.0, max_tokens=2, logit_bias={yes: 30.0})
    assert llm.generate("Hello", biased, use_tqdm=False)[0].outputs[0].token_ids[0] == yes
    banned = dataclasses.replace(biased, bad_words=["yes"])  # " yes" and "yes" are one token each
    assert yes not in llm.generate("Hello", banned, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate("Hello", SamplingParams(allowed_token_ids=[10**7]), use_tqdm=False)


def test_a_panic_message_loses_its_rust_backtrace():
    from forkpoint.structured.compiler import _without_backtrace

    panic = "panic: assertion failed: grammar.symbols.len() < 65525\n<backtrace>\n   0: <unknown>\n   1: <unknown>"
    assert _without_backtrace(panic) == "panic: assertion failed: grammar.symbols.len() < 65525"
    assert _without_backtrace("lexer too big\nline 2") == "lexer too big\nline 2"
