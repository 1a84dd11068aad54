"""Many sessions, few checkpoint rows, through the engine: each session's latest turn end survives
the others' turns (eviction by value, cache/eviction.py), so every turn from the second on computes
only its new tokens, and the outputs equal an engine's without checkpoints (float32 CPU, tiny model)."""

from __future__ import annotations

import torch

from forkpoint import LLM, SamplingParams
from tests.helpers import assert_same_outputs

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)


def test_each_sessions_turn_end_survives_the_other_sessions_turns(model_dir):
    """6 completion sessions (the client resends the text: prompt + reply + 8 new tokens) in round
    robin, 4 turns, 8 checkpoint rows: a turn registers a prompt end and a turn end, 12 per round, so
    least recently used eviction lost every turn end before its session came back (0 tokens reused)."""
    generator = torch.Generator().manual_seed(3)
    sessions, turns = 6, 4
    prompts = [[10 + s] + torch.randint(0, 150, (39,), generator=generator).tolist() for s in range(sessions)]
    llm = LLM(str(model_dir), num_kv_blocks=512, checkpoint_pool_size=8)
    plain = LLM(str(model_dir), enable_checkpoints=False, num_kv_blocks=512)
    for turn in range(turns):
        for session in range(sessions):
            prompt = {"prompt_token_ids": prompts[session]}
            out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
            assert_same_outputs([out], plain.generate([prompt], GREEDY, use_tqdm=False))
            llm.engine.check_integrity()
            if turn:  # the previous turn's end: its prompt and all but the last reply token
                assert out.num_cached_tokens == len(prompts[session]) - 8 - 1, (session, turn)
            reply = list(out.outputs[0].token_ids)
            prompts[session] = prompts[session] + reply + torch.randint(0, 150, (8,), generator=generator).tolist()
    metrics = llm.metrics()
    assert metrics["checkpoints_evicted"] > 0 and metrics["checkpoint_slots_total"] == 8
