"""A tiny FP8 checkpoint on CUDA (skipped without CUDA): accuracy against the same weights dequantised.

The tiny Qwen3.5-MoE of tests/models/test_gpu_model.py (GPU head sizes, 64-row experts), stored as
Qwen's FP8 releases store theirs (tests/models/fp8_checkpoints.py, 64 x 64 blocks so that every tiny
projection fills its blocks), runs on CUDA in bf16 through the Triton FP8 kernels (activations
quantised per token group); its dequantised copy runs through the bf16 path. Printed (lines starting
with GPU_FP8): the logits' relative error over all positions and the greedy agreement; the gap is
the activation rounding (e4m3: 3 mantissa bits). Also: on CUDA the FP8 model's outputs with
checkpoints equal those without (greedy tokens, logprobs within the bf16 checkpoint tolerance of
test_gpu_model.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from forkpoint import LLM, SamplingParams
from forkpoint.runner.model_runner import build_forward_batch
from tests.models.fp8_checkpoints import dequantized_copy, quantize_checkpoint
from tests.tiny_models import build_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GPU_DIMS = dict(hidden_size=128, linear_key_head_dim=64, linear_value_head_dim=64, head_dim=64,
                moe_intermediate_size=64, shared_expert_intermediate_size=64)
ENGINE = dict(num_kv_blocks=512, num_state_slots=16, max_num_seqs=16, checkpoint_pool_size=8, auto_checkpoints=False)
LOGITS_REL_TOL = 0.08  # FP8 (activations in e4m3) vs the dequantised bf16 model


def full_logits(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    """Logits at every prompt position from one forward on the engine's device (prefill in one chunk)."""
    engine = llm.engine
    engine.add_request("full-logits", {"prompt_token_ids": token_ids}, SamplingParams(max_tokens=1))
    step = engine.scheduler.schedule()
    batch, _ = build_forward_batch(step.plan, engine.config.block_size, engine.device)
    batch = dataclasses.replace(batch, logits_indices=torch.arange(len(token_ids), device=engine.device))
    logits = engine.runner.model(batch, engine.runner.caches)
    engine.scheduler.commit(step)
    engine.abort_request("full-logits")
    return logits.cpu()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_fp8")
    build_tiny_model(root / "bf16", "qwen3_5_moe_text", fused_experts=True, **GPU_DIMS)
    quantize_checkpoint(root / "bf16", root / "fp8", (64, 64))
    dequantized_copy(root / "fp8", root / "dequantized")
    return root


def test_fp8_logits_close_to_the_dequantised_model(dirs):
    token_ids = torch.randint(5, 150, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    fp8 = LLM(str(dirs / "fp8"), enforce_eager=True, **ENGINE)
    dense = LLM(str(dirs / "dequantized"), enforce_eager=True, **ENGINE)
    ours, ref = full_logits(fp8, token_ids).float(), full_logits(dense, token_ids).float()
    rel = ((ours - ref).norm() / ref.norm()).item()
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"GPU_FP8 logits rel error {rel:.3e}, argmax agreement {agree:.3f} over {len(token_ids)} positions")
    assert rel < LOGITS_REL_TOL
    prompts = [{"prompt_token_ids": torch.randint(5, 150, (40,), generator=torch.Generator().manual_seed(s)).tolist()}
               for s in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    a = [o.outputs[0].token_ids for o in fp8.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in dense.generate(prompts, params, use_tqdm=False)]
    same = sum(x == y for x, y in zip(a, b))
    print(f"GPU_FP8 greedy sequences identical: {same}/{len(a)}")


def test_fp8_checkpoints_on_equal_off_on_cuda(dirs):
    anchor = torch.randint(5, 150, (150,), generator=torch.Generator().manual_seed(2)).tolist()
    prompts = [{"prompt_token_ids": anchor + [5 + i, 9, 11 + i], "checkpoint_positions": [len(anchor)]}
               for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3)
    on = LLM(str(dirs / "fp8"), **ENGINE).generate(prompts, params, use_tqdm=False)
    plain = [{"prompt_token_ids": p["prompt_token_ids"]} for p in prompts]
    off = LLM(str(dirs / "fp8"), enable_checkpoints=False, **ENGINE).generate(plain, params, use_tqdm=False)
    worst = 0.0
    for x, y in zip(on, off):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for a, b in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            worst = max(worst, max(abs(a[t] - b[t]) for t in a.keys() & b.keys()))
    print(f"GPU_FP8 checkpoints on vs off: max logprob difference {worst:.3e}; cached {on[-1].num_cached_tokens}")
    assert on[-1].num_cached_tokens == len(anchor)
    assert worst < 0.15
