"""Engine behaviour without checkpoints: batching invariance, preemption, sampling, errors."""

from __future__ import annotations

import pytest
import torch

from forkpoint import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(moe_model):
    return LLM(str(moe_model[0]), num_kv_blocks=96, max_num_seqs=8, max_num_batched_tokens=40, auto_checkpoints=False)


def prompts(count: int, seed: int) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 50, (count,), generator=generator).tolist()
    return [{"prompt_token_ids": torch.randint(5, 150, (n,), generator=generator).tolist()} for n in lengths]


def test_batch_invariance(llm):
    batch = prompts(7, seed=1)
    together = llm.generate(batch, GREEDY, use_tqdm=False)
    for prompt, out in zip(batch, together):
        alone = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
    llm.engine.check_integrity()


def test_preemption_under_tiny_pool_gives_same_outputs(moe_model, llm):
    generator = torch.Generator().manual_seed(2)
    batch = [{"prompt_token_ids": torch.randint(5, 150, (10,), generator=generator).tolist()} for _ in range(5)]
    expected = [o.outputs[0].token_ids for o in llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=12,
                                                                                     ignore_eos=True), use_tqdm=False)]
    tiny = LLM(str(moe_model[0]), num_kv_blocks=16, block_size=4, max_num_seqs=4, enable_checkpoints=False)
    outs = tiny.generate(batch, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert tiny.metrics()["preemptions"] > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    tiny.engine.check_integrity()
    assert tiny.metrics()["kv_blocks_used"] == 0 and tiny.metrics()["state_slots_used"] == 0


def test_sampling_controls(llm):
    prompt = prompts(1, seed=3)[0]
    seeded = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=11, max_tokens=8, ignore_eos=True)
    a = llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b
    top1 = llm.generate(prompt, SamplingParams(temperature=1.0, top_k=1, seed=5, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    greedy = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    assert top1 == greedy.token_ids
    stop_at = greedy.token_ids[3]
    stopped = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop_at]),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == greedy.token_ids[: greedy.token_ids.index(stop_at) + 1]
    assert stopped.finish_reason == "stop"
    stop_text = llm.get_tokenizer().decode([greedy.token_ids[2]])
    by_text = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, stop=[stop_text]),
                           use_tqdm=False)[0].outputs[0]
    assert by_text.finish_reason == "stop" and stop_text not in by_text.text
    with_logprobs = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=3, logprobs=4),
                                 use_tqdm=False)[0].outputs[0]
    for token, entry in zip(with_logprobs.token_ids, with_logprobs.logprobs):
        assert token in entry and len(entry) == 4 and entry[token] == max(entry.values())
        assert all(v <= 0 for v in entry.values())


@pytest.mark.parametrize("kwargs,field", [
    (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_k=-5), "top_k"),
    (dict(min_p=2.0), "min_p"), (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n"),
    (dict(logprobs=-1), "logprobs"), (dict(stop=[""]), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
])
def test_invalid_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_invalid_prompts_leave_nothing_behind(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [5] * 5000}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="160"):
        llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [5, 160]}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["w1", "w2"], [GREEDY], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_integrity()
    assert llm.generate("w1 w2", GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_abort_mid_generation_frees_everything(llm):
    engine = llm.engine
    engine.add_request("a", prompts(1, seed=4)[0], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    engine.add_request("b", prompts(1, seed=5)[0], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.abort_request("a")
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()
    assert llm.metrics()["state_slots_used"] == 0 and llm.metrics()["kv_blocks_used"] == 0


def test_sequence_outgrowing_the_whole_pool_ends_with_length_not_a_hang(moe_model):
    small = LLM(str(moe_model[0]), num_kv_blocks=4, block_size=4, enable_checkpoints=False)
    out = small.generate({"prompt_token_ids": [5, 6, 7, 8, 9]},
                         SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.outputs[0].token_ids) == 4 * 4 - 5 + 1  # every KV slot used; the last token needs none
    small.engine.check_integrity()
    assert small.metrics()["kv_blocks_used"] == 0


def test_repetition_penalty_changes_greedy_output_of_repeating_model(llm):
    prompt = prompts(1, seed=9)[0]
    plain = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    penalised = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                    frequency_penalty=2.0, presence_penalty=2.0),
                             use_tqdm=False)[0].outputs[0].token_ids
    repeats = len(plain) - len(set(plain))
    assert repeats > 0, "precondition: the tiny random model repeats itself without penalties"
    assert len(penalised) - len(set(penalised)) < repeats


@pytest.mark.parametrize("n", [1, 3])
def test_each_prompt_is_reported_as_often_as_its_caller_reads(llm, n):
    """stream: one cumulative output per step; without: only the finished one; with report_first_token: the
    first token's and the finished one (the server's responses that do not stream), all ending equal."""
    engine = llm.engine
    prompt = prompts(1, seed=21)[0]
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, n=n)
    modes = {"every": dict(stream=True), "final": dict(stream=False),
             "first": dict(stream=False, report_first_token=True)}
    for name, mode in modes.items():
        engine.add_request(name, prompt, params, **mode)
    reports: dict[str, list] = {name: [] for name in modes}
    while engine.has_unfinished_requests():
        for output in engine.step():
            reports[output.request_id].append(output)
    # every step that samples a token for the streamed prompt reports it: 7 steps for one sequence; n > 1
    # siblings wait for the prompt's checkpoint unless it exists already, so they may sample in other steps
    sampled = [sum(len(c.token_ids) for c in o.outputs) for o in reports["every"]]
    assert sampled == sorted(set(sampled)) and sampled[-1] == 7 * n and len(sampled) >= 7
    assert [len(reports[name]) for name in ("final", "first")] == [1, 2]
    first = reports["first"][0]
    assert not first.finished and 1 <= max(len(c.token_ids) for c in first.outputs) < 7
    finals = [reports[name][-1] for name in modes]
    assert all(o.finished for o in finals)
    assert len({tuple((c.text, tuple(c.token_ids)) for c in o.outputs) for o in finals}) == 1
    engine.check_integrity()
