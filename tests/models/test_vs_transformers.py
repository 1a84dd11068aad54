"""forkpoint's model against Hugging Face transformers on tiny random checkpoints (float32, CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from forkpoint import LLM, SamplingParams
from forkpoint.runner.model_runner import build_forward_batch

MODEL_TYPES = [
    ("qwen3_5_moe_text", False),
    ("qwen3_5_moe_text", True),
    ("qwen3_5_text", False),
    ("qwen3_next", False),
    ("qwen3_5_moe", True),
]


def full_logits(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    """Logits at every prompt position from one forkpoint forward (prefill in one chunk)."""
    engine = llm.engine
    engine.add_request("full-logits", {"prompt_token_ids": token_ids}, SamplingParams(max_tokens=1))
    step = engine.scheduler.schedule()
    plan = step.plan
    batch, _ = build_forward_batch(plan, engine.config.block_size, engine.device)
    batch = dataclasses.replace(batch, logits_indices=torch.arange(len(token_ids)))
    logits = engine.runner.model(batch, engine.runner.caches)
    engine.scheduler.commit(step)
    engine.abort_request("full-logits")
    engine.check_integrity()
    return logits


def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=torch.tensor([token_ids]))
    return out.logits[0].float()


def hf_greedy(model, token_ids: list[int], max_tokens: int) -> list[int]:
    ids = list(token_ids)
    for _ in range(max_tokens):
        ids.append(int(hf_logits(model, ids)[-1].argmax()))
    return ids[len(token_ids):]


@pytest.mark.parametrize("model_type,fused", MODEL_TYPES)
def test_logits_match_transformers(tiny_model_factory, model_type, fused):
    directory, hf_model = tiny_model_factory(model_type, fused)
    llm = LLM(str(directory), num_kv_blocks=64, max_num_seqs=8)
    generator = torch.Generator().manual_seed(1)
    token_ids = torch.randint(5, 150, (83,), generator=generator).tolist()  # > one GDN chunk of 64
    ours = full_logits(llm, token_ids)
    ref = hf_logits(hf_model, token_ids)
    rel = (ours - ref).norm() / ref.norm()
    assert rel <= 1e-4, f"relative error {rel:.2e}"


@pytest.mark.parametrize("model_type,fused", MODEL_TYPES[:1] + MODEL_TYPES[3:4])
def test_greedy_generation_matches_transformers_under_chunking_and_batching(tiny_model_factory, model_type, fused):
    directory, hf_model = tiny_model_factory(model_type, fused)
    # a small token budget forces chunked prefill and mixes prefills with decodes
    llm = LLM(str(directory), max_num_batched_tokens=24, num_kv_blocks=96, max_num_seqs=4,
              auto_checkpoints=False)
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(5, 150, (n,), generator=generator).tolist() for n in (40, 7, 66, 19, 3)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, 6)
    llm.engine.check_integrity()
    assert llm.metrics()["kv_blocks_used"] == 0
