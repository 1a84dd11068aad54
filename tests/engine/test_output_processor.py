"""Output building with incremental text: stop strings cut where a full decode would, streamed
text grows to the full decode, and per-sequence state ends with its sequence."""

from __future__ import annotations

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
