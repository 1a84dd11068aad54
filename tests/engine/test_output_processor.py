"""Output building with incremental text: stop strings cut where a full decode would, streamed
text grows to the full decode, and per-sequence state ends with its sequence."""

from __future__ import annotations

import re

import pytest
import torch

from forkpoint import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(moe_model):
    return LLM(str(moe_model[0]), num_kv_blocks=96, max_num_seqs=8, max_num_batched_tokens=64)


def prompt(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {"prompt_token_ids": torch.randint(5, 150, (12,), generator=generator).tolist()}


def decode(llm: LLM, ids: list[int]) -> str:
    return llm.get_tokenizer().decode(ids, skip_special_tokens=True)


def expected_stop(llm: LLM, ids: list[int], stops: list[str]) -> tuple[list[int], str]:
    """The rule, by full decodes: stop at the first token whose text holds a stop string, and cut
    the text where the earliest one starts."""
    for n in range(1, len(ids) + 1):
        text = decode(llm, ids[:n])
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return ids[:n], text[: min(hits)]
    raise AssertionError("no stop string in the text")


def test_stop_strings_cut_where_a_full_decode_does(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for seed in range(3):
        full = llm.generate(prompt(seed), greedy, use_tqdm=False)[0].outputs[0]
        text = full.text
        assert len(text) > 40
        # stop strings that start inside a token and span a boundary, and a pair of them
        for stops in ([text[5:9]], [text[17:30]], [text[-6:-1]], [text[30:34], text[12:15]]):
            ids, cut = expected_stop(llm, full.token_ids, stops)
            out = llm.generate(prompt(seed), SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                            stop=stops), use_tqdm=False)[0].outputs[0]
            assert out.token_ids == ids and out.text == cut and out.finish_reason == "stop", stops
    assert len(llm.engine.output_processor) == 0
    llm.engine.output_processor.check_integrity(set())


def test_streamed_text_grows_to_the_full_decode(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, n=2)
    engine.add_request("stream-a", prompt(7), params)
    engine.add_request("stream-b", prompt(8), SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True))
    texts: dict[tuple[str, int], list[str]] = {}
    final = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            for completion in output.outputs:
                texts.setdefault((output.request_id, completion.index), []).append(completion.text)
                if output.finished:
                    final[(output.request_id, completion.index)] = completion
        live = {s.request_id for g in engine._groups.values() for s in g.sequences}
        engine.output_processor.check_integrity(live)
    assert set(final) == {("stream-a", 0), ("stream-a", 1), ("stream-b", 0)}
    for key, seen in texts.items():
        assert all(b.startswith(a) for a, b in zip(seen, seen[1:])), key
        assert seen[-1] == decode(llm, final[key].token_ids)
    assert len(engine.output_processor) == 0


def test_an_aborted_sequence_is_freed(llm):
    engine = llm.engine
    engine.add_request("abort-me", prompt(9), SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert len(engine.output_processor) == 1
    engine.abort_request("abort-me")
    engine.output_processor.free("abort-me")
    engine.output_processor.check_integrity(set())
    engine.check_integrity()


def test_request_metrics_say_when_a_prompt_was_queued_scheduled_and_sampled(llm):
    """Nine prompts, at most eight sequences: the ninth waits for a slot. Its metrics count the steps
    scheduled before it was admitted, and arrival <= first scheduling <= first token."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    start = engine.metrics()["steps"]
    for i in range(9):
        engine.add_request(f"timing-{i}", prompt(20 + i), params)
    late = engine.sequences("timing-8")[0]
    steps_before = None
    final = {}
    while engine.has_unfinished_requests():
        steps = engine.metrics()["steps"]
        for output in engine.step():
            final[output.request_id] = output
        if steps_before is None and late.first_scheduled_time is not None:
            steps_before = steps - start  # the steps this call's step waited behind
    assert steps_before is not None and steps_before > 0
    for request_id, output in final.items():
        times = output.metrics
        assert times.arrival_time <= times.first_scheduled_time <= times.first_token_time, request_id
        assert times.time_in_queue == times.first_scheduled_time - times.arrival_time
    assert final["timing-8"].metrics.queued_steps == steps_before
    assert final["timing-0"].metrics.queued_steps == 0
    llm.engine.check_integrity()


def stream_texts(llm: LLM, request_id: str, request_prompt: dict, params: SamplingParams) -> list[str]:
    """The text of every output of one streamed request (one sequence), step by step."""
    engine = llm.engine
    engine.add_request(request_id, request_prompt, params)
    texts = []
    while engine.has_unfinished_requests():
        texts.extend(output.outputs[0].text for output in engine.step() if output.request_id == request_id)
    return texts


def generated(llm: LLM, request_prompt: dict, **kwargs):
    params = SamplingParams(**{"temperature": 0.0, **kwargs})
    out = llm.generate(request_prompt, params, use_tqdm=False)[0].outputs[0]
    texts = stream_texts(llm, f"stream-{len(str(kwargs))}-{out.token_ids[:2]}", request_prompt, params)
    assert texts[-1] == out.text, (texts, out.text)
    if not params.stop or params.include_stop_str_in_output:  # else the last output cuts a tail the server held back
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), texts
    return out


def test_include_stop_str_in_output_cuts_right_after_the_stop_string(llm):
    """The stop string stays in the text; the tokens are those of the run that cuts before it."""
    for seed in range(2):
        text = generated(llm, prompt(seed), max_tokens=24, ignore_eos=True).text
        for stops in ([text[5:9]], [text[17:30]], [text[30:34], text[12:15]]):
            cut = generated(llm, prompt(seed), max_tokens=24, ignore_eos=True, stop=stops)
            kept = generated(llm, prompt(seed), max_tokens=24, ignore_eos=True, stop=stops,
                             include_stop_str_in_output=True)
            start, stop = min((text.find(s), s) for s in stops)
            assert cut.text == text[:start] and kept.text == text[:start + len(stop)], stops
            assert kept.token_ids == cut.token_ids and kept.finish_reason == cut.finish_reason == "stop"
    llm.engine.output_processor.check_integrity(set())


def test_special_tokens_kept_and_joined(llm):
    """skip_special_tokens=False keeps them (the word-level decoder puts a space before each token);
    spaces_between_special_tokens=False joins two in a row."""
    tokenizer = llm.get_tokenizer()
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    mixed = dict(temperature=1.0, seed=1, max_tokens=16, ignore_eos=True, allowed_token_ids=[start, 30, 31],
                 logit_bias={start: 4.0})
    plain = generated(llm, prompt(4), **mixed)
    ids = plain.token_ids
    assert start in ids and any(a == b == start for a, b in zip(ids, ids[1:]))
    assert plain.text == decode(llm, ids) and "<|im_start|>" not in plain.text
    kept = generated(llm, prompt(4), **mixed, skip_special_tokens=False)
    assert kept.text == tokenizer.decode(ids, skip_special_tokens=False) and "<|im_start|> <|im_start|>" in kept.text
    joined = generated(llm, prompt(4), **mixed, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert joined.text == re.sub(r"(?<=<\|im_start\|>) (?=<\|im_start\|>)", "", kept.text)
    assert joined.token_ids == ids and "<|im_start|><|im_start|>" in joined.text


def test_the_stop_token_text_is_left_out_unless_stop_strings_are_kept(llm):
    """vLLM: the EOS or stop_token_ids token that ended the sequence adds no text, special or not, unless
    include_stop_str_in_output (then a special EOS shows only with skip_special_tokens=False)."""
    tokenizer = llm.get_tokenizer()
    eos = dict(max_tokens=8, min_tokens=3, logit_bias={tokenizer.eos_token_id: 30.0})
    ends = generated(llm, prompt(5), **eos)
    ids = ends.token_ids
    assert ids[-1] == tokenizer.eos_token_id and len(ids) == 4 and ends.finish_reason == "stop"
    words = decode(llm, ids[:3])
    assert ends.text == generated(llm, prompt(5), **eos, skip_special_tokens=False).text == words
    assert generated(llm, prompt(5), **eos, include_stop_str_in_output=True).text == words
    assert generated(llm, prompt(5), **eos, skip_special_tokens=False,
                     include_stop_str_in_output=True).text == words + " <|im_end|>"
    greedy = generated(llm, prompt(6), max_tokens=8, ignore_eos=True).token_ids
    by_token = dict(max_tokens=8, ignore_eos=True, stop_token_ids=[greedy[3]])
    stopped = generated(llm, prompt(6), **by_token)
    assert stopped.token_ids == greedy[:greedy.index(greedy[3]) + 1]
    assert stopped.text == decode(llm, stopped.token_ids[:-1])
    assert generated(llm, prompt(6), **by_token, include_stop_str_in_output=True).text == decode(llm, stopped.token_ids)
    llm.engine.output_processor.check_integrity(set())


@pytest.mark.parametrize("seed", range(3))
def test_delta_outputs_add_up_to_a_prefix_of_the_finished_output(llm, seed):
    """A prompt added with deltas=True reports only what is new until its finished output, which is whole and
    equal to the cumulative mode's; what the deltas sent is always a prefix of it (held back where a stop
    string may start, cut there once it completes), with the same token ids and logprobs."""
    text = llm.generate(prompt(seed), SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    greedy = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
    cases = [SamplingParams(**greedy, stop=[text[17:30]]),
             SamplingParams(**greedy, stop=[text[17:30]], include_stop_str_in_output=True),
             SamplingParams(temperature=1.0, seed=seed, n=3, max_tokens=24, ignore_eos=True, logprobs=2,
                            stop=[text[30:34], text[12:15]]),
             SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)]
    engine = llm.engine
    for i, params in enumerate(cases):
        engine.add_request(f"cumulative-{i}", prompt(seed), params)
        engine.add_request(f"delta-{i}", prompt(seed), params, deltas=True)
    finals, sent = {}, {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
            elif output.request_id.startswith("delta"):
                for c in output.outputs:
                    key = (output.request_id, c.index)
                    so_far = sent.get(key, ("", [], []))
                    sent[key] = (so_far[0] + c.text, so_far[1] + c.token_ids, so_far[2] + (c.logprobs or []))
    for i in range(len(cases)):
        whole, delta = finals[f"cumulative-{i}"], finals[f"delta-{i}"]
        assert ([(o.text, o.token_ids, o.finish_reason, o.logprobs) for o in delta.outputs]
                == [(o.text, o.token_ids, o.finish_reason, o.logprobs) for o in whole.outputs])
        for o in delta.outputs:
            text_sent, ids_sent, logprobs_sent = sent.get((delta.request_id, o.index), ("", [], []))
            assert o.text.startswith(text_sent) and o.token_ids[: len(ids_sent)] == ids_sent
            assert o.logprobs is None or o.logprobs[: len(logprobs_sent)] == logprobs_sent
    plain = finals["delta-3"].outputs[0]
    assert len(sent[("delta-3", 0)][1]) == 15 and len(sent[("delta-3", 0)][0]) > len(plain.text) // 2
    assert len(engine.output_processor) == 0
    engine.check_integrity()


@pytest.fixture(scope="module")
def qwen_tokenizer(tmp_path_factory):
    """The Qwen3.5 tokenizer alone (the embedded model's vocabulary, inputs/qwen_vocab.py), no weights."""
    from transformers import AutoTokenizer

    from forkpoint.inputs import qwen_vocab

    directory = tmp_path_factory.mktemp("qwen_tokenizer")
    qwen_vocab.write_tokenizer(directory, model_max_length=4096)
    return AutoTokenizer.from_pretrained(str(directory))


def test_delta_outputs_never_send_part_of_a_character_or_of_a_stop_string(qwen_tokenizer):
    """Tokens fed one at a time through `make_delta_output` (multi-byte characters split over byte tokens,
    a stop string that starts inside a word and one that never completes): every delta is new text whose
    concatenation is always a prefix of the finished text, with no replacement character, and the
    finished output equals the cumulative one."""
    from forkpoint.cache.hashing import PrefixHasher
    from forkpoint.engine.output_processor import OutputProcessor
    from forkpoint.engine.request import Request, RequestStatus

    text = "naïve café 日本語 🤖🧪 tool ok <stop-here> tail after"
    ids = qwen_tokenizer.encode(text, add_special_tokens=False)
    for stops, include in (([], False), (["<stop-h", "🧪 tx"], False), (["<stop-h"], True)):
        params = SamplingParams(max_tokens=len(ids), ignore_eos=True, stop=stops, include_stop_str_in_output=include)
        processors = OutputProcessor(qwen_tokenizer, eos_token_ids=(), max_model_len=1 << 20)
        requests = [Request(f"{mode}", f"{mode}", 0, [1], (), params, 0.0, PrefixHasher([1], 16), None)
                    for mode in ("delta", "whole")]
        sent, finished = "", {}
        for token in ids:
            for request in requests:
                reason = processors.append_token(request, token, None, 0.0)
                if reason is not None and not request.is_finished:  # as the scheduler finishes it
                    request.finish_reason, request.status = reason, RequestStatus.FINISHED
            if all(r.is_finished for r in requests):
                break
            delta = processors.make_delta_output("delta", None, [1], [], [requests[0]]).outputs[0]
            assert "\ufffd" not in delta.text
            sent += delta.text
        for request in requests:
            finished[request.request_id] = processors.make_output(request.request_id, None, [1], [], [request])
        final = finished["delta"].outputs[0]
        assert final.text == finished["whole"].outputs[0].text and final.text.startswith(sent), (stops, sent)
        if stops:
            assert final.finish_reason == "stop" and final.text.endswith("<stop-h" if include else "ok ")
        else:
            # everything but the last token's text (which comes with the finished output) was sent as it came
            assert final.text == text and sent == qwen_tokenizer.decode(ids[:-1])
