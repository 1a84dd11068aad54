"""Speculative decoding through the HTTP server (`--speculative-config`): greedy answers equal the
server without it (completions and chat, streamed and not, logprobs within 1e-5, 5e-5 over the real
Qwen3.5 vocabulary, where batching alone moves them by 1.5e-5; reuse unchanged),
acceptance metrics in /metrics and the stats line, and clear start-up errors.

Models (float32 CPU): the tiny word-level Qwen3.5 (dense) and a copy of the embedded default model
(Qwen3.5-MoE with the real Qwen3.5 tokenizer and chat template), each with random MTP weights added
(tests/tiny_models.add_mtp_weights). Random MTP heads are almost never right, so the speculative
servers' drafts come from an oracle (tests/engine/test_speculative.OracleDrafts): the plain engine's
own greedy continuation of the request's prompt, 30% of its positions corrupted, so that through the
server verification accepts several tokens a step, rejects, and rolls the recurrent state back.
"""

from __future__ import annotations

import json
import shutil
import signal
from collections.abc import Iterator

import httpx
import pytest

from forkpoint import LLM, SamplingParams
from forkpoint.inputs.default_model import ensure_default_model
from forkpoint.server.cli import build_parser, main
from forkpoint.server.config import ServerConfig
from forkpoint.server.engine_args import engine_kwargs
from forkpoint.server.stats import StatsLine, speculative_summary
from forkpoint.speculative_config import SpeculativeConfig
from tests.engine.test_speculative import OracleDrafts
from tests.server.conftest import MARKER, RunningServer, serve, serve_process
from tests.tiny_models import add_mtp_weights, token_words

K = 3
SPEC = {"method": "mtp", "num_speculative_tokens": K}
SMALL = {"max_model_len": 1024, "num_kv_blocks": 512, "checkpoint_pool_size": 16}
SPEC_JSON = json.dumps(SPEC)
CHAT_TOKENS = 12  # the most tokens a request with drafts asks the chat servers for
SAME_SCHEMA = {"type": "object", "properties": {"same": {"type": "boolean"}}, "required": ["same"]}


class PlainContinuations(dict):
    """prompt ids -> the plain engine's greedy continuation (`max_tokens` tokens, EOS ignored), computed on
    first use with `llm` (an engine no server owns): the oracle's drafts for any request a test sends. A
    request of up to max_tokens - K tokens gets a full draft at every step."""

    def __init__(self, llm: LLM, max_tokens: int) -> None:
        super().__init__()
        self.llm = llm
        self.max_tokens = max_tokens

    def __missing__(self, prompt_ids: tuple[int, ...]) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True)
        out = self.llm.generate({"prompt_token_ids": list(prompt_ids)}, params, use_tqdm=False)[0]
        self[prompt_ids] = list(out.outputs[0].token_ids)
        return self[prompt_ids]


def _servers(directory, name: str, continuations: PlainContinuations,
             **kwargs) -> Iterator[tuple[RunningServer, RunningServer]]:
    """(plain server, speculative server with oracle drafts from `continuations`) on the model in `directory`."""
    plain = LLM(str(directory), **SMALL, **kwargs)
    spec = LLM(str(directory), **SMALL, **kwargs, speculative_config=SPEC)
    OracleDrafts(spec, continuations)
    with serve(plain, ServerConfig(served_model_name=name)) as plain_server, \
            serve(spec, ServerConfig(served_model_name=name, log_stats_interval_s=0.2)) as spec_server:
        yield plain_server, spec_server


@pytest.fixture(scope="module")
def word_mtp_model(tiny_model_factory, tmp_path_factory):
    """The tiny word-level Qwen3.5 (dense) with an MTP head."""
    source, _ = tiny_model_factory("qwen3_5_text")
    directory = tmp_path_factory.mktemp("server_mtp")
    add_mtp_weights(source, directory)
    return directory


@pytest.fixture(scope="module")
def word_servers(word_mtp_model):
    continuations = PlainContinuations(LLM(str(word_mtp_model), **SMALL, enable_checkpoints=False), 64)
    yield from _servers(word_mtp_model, "tiny-mtp", continuations, auto_checkpoints=False)


@pytest.fixture(scope="module")
def chat_servers(tmp_path_factory, plain_default_llm):
    """The embedded default model (the real Qwen3.5 chat template) with an MTP head added. The oracle's
    continuations come from the session's plain engine on the embedded model itself (the copy's weights but
    for the head), CHAT_TOKENS + K tokens long: its tests ask for at most CHAT_TOKENS tokens with drafts
    (the structured request verifies none), and each token of a continuation costs a pass over the real
    Qwen3.5 vocabulary."""
    source = ensure_default_model()  # where LLM() without a model loads it from
    directory = tmp_path_factory.mktemp("default_mtp")
    add_mtp_weights(source, directory)
    (directory / "forkpoint_default.json").unlink()  # a copy, not the embedded model
    yield from _servers(directory, "default-mtp", PlainContinuations(plain_default_llm, CHAT_TOKENS + K))


def _completion(server: RunningServer, **kwargs):
    return server.client().completions.create(model=server.model, temperature=0.0, **kwargs)


def _same_logprobs(ours, theirs) -> None:
    assert ours.tokens == theirs.tokens
    assert ours.token_logprobs == pytest.approx(theirs.token_logprobs, abs=1e-5)
    for a, b in zip(ours.top_logprobs, theirs.top_logprobs):
        assert a.keys() == b.keys() and list(a.values()) == pytest.approx(list(b.values()), abs=1e-5)


def test_greedy_completions_equal_the_server_without_it(word_servers):
    plain, spec = word_servers
    anchor = token_words(1, 40)
    prompts = [f"{anchor} {MARKER} {token_words(2, 5)}", f"{anchor} {MARKER} {token_words(3, 9)}", token_words(4, 7)]
    for prompt in prompts:
        ours = _completion(spec, prompt=prompt, max_tokens=14, logprobs=2, n=2)
        theirs = _completion(plain, prompt=prompt, max_tokens=14, logprobs=2, n=2)
        for a, b in zip(ours.choices, theirs.choices):
            assert (a.text, a.finish_reason) == (b.text, b.finish_reason)
            _same_logprobs(a.logprobs, b.logprobs)
        assert ours.usage.completion_tokens == theirs.usage.completion_tokens == 28
        assert ours.usage.prompt_tokens_details.cached_tokens == theirs.usage.prompt_tokens_details.cached_tokens
    # a stop string ends the answer where the plain server ends it (mid-verification when drafts were
    # accepted past it: the tokens after it are dropped)
    full = _completion(plain, prompt=prompts[2], max_tokens=14).choices[0].text.split()
    stop = full[6]
    ours = _completion(spec, prompt=prompts[2], max_tokens=14, stop=[stop]).choices[0]
    theirs = _completion(plain, prompt=prompts[2], max_tokens=14, stop=[stop]).choices[0]
    assert (ours.text, ours.finish_reason) == (theirs.text, theirs.finish_reason) and ours.finish_reason == "stop"
    spec.wait_idle()
    spec.engine_call(lambda engine: engine.check_integrity())
    metrics = spec.engine_call(lambda engine: engine.metrics())
    assert metrics["spec_accepted_tokens"] > 0 and metrics["spec_accepted_tokens"] < metrics["spec_draft_tokens"]


def test_streamed_completions_carry_several_tokens_a_chunk(word_servers):
    plain, spec = word_servers
    prompt = token_words(5, 12)
    reference = _completion(plain, prompt=prompt, max_tokens=20, logprobs=1).choices[0]
    stream = _completion(spec, prompt=prompt, max_tokens=20, logprobs=1, stream=True,
                         stream_options={"include_usage": True})
    chunks = [chunk for chunk in stream if chunk.choices]
    assert "".join(c.choices[0].text for c in chunks) == reference.text
    tokens = [token for c in chunks if c.choices[0].logprobs for token in c.choices[0].logprobs.tokens]
    assert tokens == reference.logprobs.tokens
    assert max(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices[0].logprobs) > 1  # accepted drafts
    assert chunks[-1].choices[0].finish_reason == "length"


def test_sampled_requests_run_and_respect_their_limits(word_servers):
    _, spec = word_servers
    out = spec.client().completions.create(model=spec.model, prompt=token_words(6, 8), max_tokens=9, n=3,
                                           temperature=1.0, seed=7)
    assert [c.finish_reason for c in out.choices] == ["length"] * 3 and out.usage.completion_tokens == 27
    spec.wait_idle()
    spec.engine_call(lambda engine: engine.check_integrity())


@pytest.mark.parametrize(("servers", "extra"), [
    ("word_servers", {"frequency_penalty": 0.5}),
    ("chat_servers", {"extra_body": {"structured_outputs": {"json": SAME_SCHEMA}}}),
])
def test_requests_that_read_their_output_decode_plainly(servers, extra, request):
    """Penalties and structured outputs sample from what was generated: those sequences verify no
    drafts, and answer as the plain server does."""
    plain, spec = request.getfixturevalue(servers)
    spec.wait_idle()
    before = spec.engine_call(lambda engine: engine.metrics())["spec_verifications"]
    ours = _completion(spec, prompt=token_words(8, 9), max_tokens=40, **extra).choices[0]
    theirs = _completion(plain, prompt=token_words(8, 9), max_tokens=40, **extra).choices[0]
    assert (ours.text, ours.finish_reason) == (theirs.text, theirs.finish_reason)
    if servers == "chat_servers":
        assert set(json.loads(ours.text)) == {"same"}
    assert spec.engine_call(lambda engine: engine.metrics())["spec_verifications"] == before


def test_chat_with_the_qwen_template_equals_the_server_without_it(chat_servers):
    plain, spec = chat_servers
    history = [{"role": "system", "content": "You compare product listings."},
               {"role": "user", "content": "Is a red kettle of 1.7 litres the same as a 1.7 l kettle, red?"}]
    for server_pair_turn in range(2):
        answers = []
        for server in (plain, spec):
            out = server.client().chat.completions.create(model=server.model, messages=history, temperature=0.0,
                                                          max_tokens=CHAT_TOKENS, logprobs=True, top_logprobs=2)
            answers.append(out)
        theirs, ours = answers
        assert ours.choices[0].message.content == theirs.choices[0].message.content
        assert [t.token for t in ours.choices[0].logprobs.content] == \
            [t.token for t in theirs.choices[0].logprobs.content]
        # float32 rounding over the 248k-entry vocabulary: the plain engine alone moves these logprobs
        # by 1.5e-5 between a batch of one and a batch of six (measured), so the tolerance is 5e-5 here
        assert [t.logprob for t in ours.choices[0].logprobs.content] == \
            pytest.approx([t.logprob for t in theirs.choices[0].logprobs.content], abs=5e-5)
        # the second turn reads the first turn's checkpoint on both servers, to the same token
        assert ours.usage.prompt_tokens_details.cached_tokens == theirs.usage.prompt_tokens_details.cached_tokens
        if server_pair_turn == 1:
            assert ours.usage.prompt_tokens_details.cached_tokens > 0
        history += [{"role": "assistant", "content": theirs.choices[0].message.content},
                    {"role": "user", "content": "And a blue one?"}]
    stream = spec.client().chat.completions.create(model=spec.model, messages=history, temperature=0.0,
                                                   max_tokens=CHAT_TOKENS, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    reference = plain.client().chat.completions.create(model=plain.model, messages=history, temperature=0.0,
                                                       max_tokens=CHAT_TOKENS)
    assert streamed == reference.choices[0].message.content
    spec.wait_idle()
    spec.engine_call(lambda engine: engine.check_integrity())
    metrics = spec.engine_call(lambda engine: engine.metrics())
    assert 0 < metrics["spec_accepted_tokens"] < metrics["spec_draft_tokens"]  # drafts accepted and rejected


def test_acceptance_in_metrics_and_the_stats_line(word_servers, caplog):
    plain, spec = word_servers
    before = spec.engine_call(lambda engine: engine.metrics())
    _completion(spec, prompt=token_words(7, 10), max_tokens=16)
    spec.wait_idle()
    after = spec.engine_call(lambda engine: engine.metrics())
    scraped = spec.metrics()

    def series(name: str, **labels: str) -> float:
        return scraped[(name, tuple(sorted(labels.items())))]

    assert series("forkpoint_spec_decode_num_drafts_total") == after["spec_verifications"] > 0
    assert series("forkpoint_spec_decode_num_draft_tokens_total") == after["spec_draft_tokens"]
    assert series("forkpoint_spec_decode_num_accepted_tokens_total") == after["spec_accepted_tokens"]
    per_position = [series("forkpoint_spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
                    for i in range(K)]
    assert sum(per_position) == after["spec_accepted_tokens"]
    assert per_position == sorted(per_position, reverse=True)  # a later draft is accepted only after the earlier
    drafted = [series("forkpoint_spec_decode_num_draft_tokens_per_pos_total", position=str(i)) for i in range(K)]
    assert sum(drafted) == after["spec_draft_tokens"] and drafted[0] == after["spec_verifications"]
    assert not any(name.startswith("forkpoint_spec_decode") for name, _ in plain.metrics())

    line = StatsLine(before, 0.0).line(after, 1.0)
    verifications = after["spec_verifications"] - before["spec_verifications"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    drafted_now = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    assert f"mean acceptance length {(accepted + verifications) / verifications:.2f}" in line
    assert f"{accepted:.0f} of {drafted_now:.0f} draft tokens accepted" in line
    busy = {**after, "num_running": 1}  # a busy interval that verified nothing has no speculative part
    assert "speculative" not in StatsLine(after, 1.0).line(busy, 2.0)
    summary = speculative_summary(spec.llm.engine.config.speculative_config)
    assert summary.startswith(f"speculative decoding: mtp head drafts {K} tokens per step")


@pytest.mark.parametrize(("flags", "message"), [
    (["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'], "method 'eagle' is not supported"),
    (["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 0}'], "an integer from 1 to 16, got 0"),
    (["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 17}'], "an integer from 1 to 16, got 17"),
    (["--speculative-config", '{"method": "mtp", "k": 2}'], "unknown keys ['k']"),
    (["--speculative-config", "mtp"], "not JSON"),
])
def test_bad_speculative_configs_are_usage_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *flags])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "argument --speculative-config: " in error and message in error


def test_vllms_older_method_name_is_taken():
    """Qwen3-Next's model card serves with vLLM's '{"method": "qwen3_next_mtp", ...}': the same command works."""
    args = build_parser().parse_args(["serve", "--speculative-config",
                                      '{"method": "qwen3_next_mtp", "num_speculative_tokens": 2}'])
    assert SpeculativeConfig.from_value(engine_kwargs(args)["speculative_config"]) == SpeculativeConfig("mtp", 2)


@pytest.mark.parametrize(("flags", "message"), [
    (["--async-scheduling"], "speculative_config does not run with async_scheduling yet"),
    (["--tensor-parallel-size", "2"], "speculative_config does not run with tensor_parallel_size 2 yet"),
])
def test_refused_combinations_fail_before_loading(flags, message, capsys):
    assert main(["serve", "--speculative-config", SPEC_JSON, *flags]) == 2
    error = capsys.readouterr().err
    assert error.startswith("forkpoint serve: error: ") and message in error and "Traceback" not in error


def test_models_without_mtp_weights_are_start_up_errors(tiny_model_factory, tmp_path, capsys):
    source, _ = tiny_model_factory("qwen3_5_text")
    assert main(["serve", str(source), "--speculative-config", SPEC_JSON]) == 2
    assert "needs a model with MTP layers" in capsys.readouterr().err
    # config.json declares MTP layers, the weights lack them (a conversion that dropped mtp.*)
    declared = tmp_path / "declared"
    shutil.copytree(source, declared)
    config = json.loads((declared / "config.json").read_text())
    (declared / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    assert main(["serve", str(declared), "--speculative-config", SPEC_JSON]) == 2
    error = capsys.readouterr().err
    assert "stores no mtp.* tensors" in error and "Traceback" not in error


def test_generate_reports_the_acceptance(word_mtp_model, capsys):
    assert main(["generate", "--model", str(word_mtp_model), "--speculative-config", SPEC_JSON, "--max-tokens", "6",
                 token_words(9, 6)]) == 0
    out = capsys.readouterr().out
    assert "output (6 tokens, length)" in out and "speculative: mean acceptance length " in out


def test_serve_process_with_the_flag(word_mtp_model, tmp_path):
    """`forkpoint serve MODEL --speculative-config ...` as a real process: the start-up summary says
    what runs, greedy answers come, /metrics has the acceptance series, SIGINT stops it."""
    args = [str(word_mtp_model), "--max-model-len", "1024", "--speculative-config", SPEC_JSON,
            "--served-model-name", "spec-cli"]
    with serve_process(args, tmp_path / "serve.log") as running:
        base, process = running.base_url, running.process
        response = httpx.post(f"{base}/v1/completions", timeout=60,
                              json={"model": "spec-cli", "prompt": token_words(11, 6), "max_tokens": 8,
                                    "temperature": 0.0})
        assert response.json()["usage"]["completion_tokens"] == 8
        assert "forkpoint_spec_decode_num_drafts_total" in httpx.get(f"{base}/metrics").text
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
        assert f"speculative decoding: mtp head drafts {K} tokens per step" in running.output()
