"""Structured-output grammars compile off the engine thread (server/grammar_threads.py): a constraint
still compiling holds no other stream, its request still gets constrained output, and a constraint
that does not compile is still the engine's 400, with nothing left behind."""

from __future__ import annotations

import asyncio
import gc
import threading

import pytest

from forkpoint.sampling_params import StructuredOutputsParams
from forkpoint.server.grammar_threads import GrammarThreads
from forkpoint.server.worker import ServerShuttingDown

# the 400 bodies of the engine-thread compile (the code before grammar_threads.py), as they were, but for `param`:
# the field that carried the constraint (it was the prompt's)
BAD_CONSTRAINTS = [
    ("/v1/completions", "completions", {"prompt": "x", "max_tokens": 2, "guided_regex": "[a-"}, {
        "message": 'structured_outputs.regex does not compile: at 1(8): invalid regex "[a-" (in regex): regex parse '
                   "error:\n    [a-\n    ^\nerror: unclosed character class\n   1 | start: /[a-/\n              ^",
        "type": "invalid_request_error", "param": "guided_regex", "code": None}),
    ("/v1/chat/completions", "chat", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                                      "structured_outputs": {"grammar": "start: missing_rule"}}, {
        "message": 'structured_outputs.grammar does not compile: at 1(8): unknown name: "missing_rule"\n'
                   "   1 | start: missing_rule\n              ^",
        "type": "invalid_request_error", "param": "structured_outputs", "code": None}),
    ("/v1/responses", "responses", {"input": "x", "max_output_tokens": 2, "text": {
        "format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, {
        "message": "structured_outputs.json does not compile: Invalid type: nonsense",
        "type": "invalid_request_error", "param": "text", "code": None}),
]


@pytest.mark.parametrize("path,endpoint,body,error", BAD_CONSTRAINTS, ids=["regex", "grammar", "json_schema"])
def test_a_constraint_that_does_not_compile_is_a_400_naming_its_field(server, path, endpoint, body, error):
    invalid = server.metric("forkpoint_requests_total", endpoint=endpoint, outcome="invalid_request")
    answer = server.post(path, json={"model": server.model, **body})
    assert answer.status_code == 400 and answer.json() == {"error": error}, answer.text
    assert server.metric("forkpoint_requests_waiting") == 0  # its admission places came back
    assert server.engine_call(lambda engine: engine.grammars.num_compiling) == 0
    assert server.metric("forkpoint_requests_total", endpoint=endpoint, outcome="invalid_request") == invalid + 1
    server.wait_idle()
    server.engine_call(lambda engine: engine.check_integrity())


def test_a_compiling_grammar_holds_no_other_stream(server, monkeypatch):
    """The constrained request's compile is held (as a slow llguidance compile would hold it, the GIL
    released) until a plain streaming request has finished: on the engine thread it would hold that
    stream too, and the compile would end by its timeout instead."""
    compiler = server.llm.engine.grammars
    real_compile = compiler._compile
    choices = [f"held-{i}" for i in range(64)]
    compiling, release = threading.Event(), threading.Event()
    released_by_test: list[bool] = []

    def held_compile(spec):
        if spec.choice == choices:
            compiling.set()
            released_by_test.append(release.wait(timeout=8))
        return real_compile(spec)

    monkeypatch.setattr(compiler, "_compile", held_compile)
    client = server.client()
    answers = {}

    def ask_constrained() -> None:
        answers["constrained"] = client.completions.create(
            model=server.model, prompt="Pick one:", max_tokens=8, temperature=0,
            extra_body={"structured_outputs": {"choice": choices}})

    asker = threading.Thread(target=ask_constrained)
    asker.start()
    try:
        assert compiling.wait(timeout=10), "the constrained request's compile did not start"
        stream = client.completions.create(model=server.model, prompt="Count:", max_tokens=12, temperature=0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
        chunks = list(stream)
        assert not release.is_set()
        assert sum(1 for c in chunks if c.choices and c.choices[0].text) > 1  # tokens came, one by one
        assert chunks[-1].usage.completion_tokens == 12
        assert server.metric("forkpoint_requests_waiting") == 1  # the constrained one, still compiling
    finally:
        release.set()
        asker.join(timeout=30)
    assert released_by_test == [True]
    constrained = answers["constrained"].choices[0]
    assert constrained.text in choices and constrained.finish_reason == "stop"
    server.wait_idle()
    gc.collect()
    assert (compiler.num_compiling, compiler.num_live_matchers) == (0, 0)
    server.engine_call(lambda engine: engine.check_integrity())


class _Compiler:
    """`ensure_compiled` of a compiler that refuses the regex "bad" and records the rest with its thread."""

    def __init__(self) -> None:
        self.compiled: list[tuple[str, str]] = []

    def ensure_compiled(self, spec: StructuredOutputsParams) -> None:
        if spec.regex == "bad":
            raise ValueError("structured_outputs.regex does not compile: bad")
        self.compiled.append((spec.regex, threading.current_thread().name))


def test_grammar_threads_compile_off_the_loop_raise_and_refuse_after_shutdown():
    compiler = _Compiler()
    grammars = GrammarThreads(compiler, max_workers=1)

    async def run() -> None:
        await grammars.compile(StructuredOutputsParams(regex="ok"))
        with pytest.raises(ValueError, match="does not compile: bad"):
            await grammars.compile(StructuredOutputsParams(regex="bad"))
        grammars.shutdown()
        with pytest.raises(ServerShuttingDown):
            await grammars.compile(StructuredOutputsParams(regex="late"))

    asyncio.run(run())
    assert compiler.compiled == [("ok", "forkpoint-grammar_0")]
