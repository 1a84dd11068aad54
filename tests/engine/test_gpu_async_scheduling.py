"""Asynchronous scheduling on CUDA (skipped without): the same outputs as synchronous steps on one
engine (whole-step decode graphs, bf16), no host synchronisation while a step is enqueued ahead of the
one running (`torch.cuda.set_sync_debug_mode("error")` around the runner, its sampler's enqueue inside),
and the decode step times of both modes printed (`pytest -s`, lines starting with GPU_ASYNC)."""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from forkpoint import SamplingParams
from tests.models.test_gpu_model import max_logprob_diff, random_ids
from tests.runner.test_gpu_cuda_graphs import GRAPH_LOGPROB_TOL, make_llm, model_dir  # noqa: F401 (fixture)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


class NoSyncAhead:
    """Wraps a bound method: calls that are part of a step enqueued ahead (a `feed` is given, or every
    call while `ahead` is set) run under sync-debug mode "error", so any host synchronisation raises."""

    def __init__(self, owner, name: str, probe: NoSyncAhead | None = None) -> None:
        self._method, self._probe, self.ahead, self.checked = getattr(owner, name), probe, False, 0
        setattr(owner, name, self)

    def __call__(self, *args, **kwargs):
        ahead = kwargs.get("feed") is not None or (self._probe is not None and self._probe.ahead)
        self.ahead = ahead
        if not ahead:
            return self._method(*args, **kwargs)
        self.checked += 1
        torch.cuda.set_sync_debug_mode("error")
        try:
            return self._method(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def decode_times(llm, tag: str, num_seqs: int, steps: int = 16) -> list[float]:
    engine = llm.engine
    generator = torch.Generator().manual_seed(num_seqs)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": random_ids(generator, 40)}, params, stream=False)
    engine.step()  # the prefill
    times = []
    torch.cuda.synchronize()
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times[1:-1]


def test_async_scheduling_on_cuda(model_dir):  # noqa: F811
    llm = make_llm(model_dir)
    engine = llm.engine
    generator = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": random_ids(generator, n)} for n in (7, 30, 64, 3, 19)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=5) for m in (12, 9, 16, 5, 14)]
    params[1] = SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True, logprobs=5,
                               presence_penalty=0.4)
    synchronous = llm.generate(prompts, params, use_tqdm=False)
    stop = synchronous[2].outputs[0].token_ids[6]
    params[2] = SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[stop], logprobs=5)
    synchronous[2] = llm.generate(prompts[2], params[2], use_tqdm=False)[0]

    engine.async_scheduling = True
    runner = NoSyncAhead(engine.runner, "execute")
    sampler = NoSyncAhead(engine.runner.sampling.sampler, "sample_async", probe=runner)
    overlapped = llm.generate(prompts, params, use_tqdm=False)
    assert runner.checked > 10 and sampler.checked == runner.checked
    for ours, theirs in zip(overlapped, synchronous, strict=True):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        assert ours.outputs[0].finish_reason == theirs.outputs[0].finish_reason
        assert max_logprob_diff(ours, theirs) <= GRAPH_LOGPROB_TOL
    engine.check_integrity()
    assert llm.metrics()["state_slots_used"] == 0

    for num_seqs in (1, 8):
        engine.async_scheduling = False
        sync_ms = 1e3 * statistics.median(decode_times(llm, f"sync{num_seqs}", num_seqs))
        engine.async_scheduling = True
        async_ms = 1e3 * statistics.median(decode_times(llm, f"async{num_seqs}", num_seqs))
        # printed, not asserted: under the GPU check's 8 workers sharing one GPU the asynchronous step once took
        # 1.38x the synchronous one, alone 0.81-0.86x (docs/gpu_test_log.md, session 22); bench/ measures speed
        print(f"GPU_ASYNC N={num_seqs}: decode step {sync_ms:.3f} ms synchronous, {async_ms:.3f} ms asynchronous")
