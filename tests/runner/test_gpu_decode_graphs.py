"""Whole-step decode graphs (runner/decode_graphs.py) and the start-up warm-up (runner/warmup.py) on
CUDA (skipped without): graph decodes against the eager decode of the same engine, and a random mix
of served steps after the warm-up that must not compile, autotune or capture anything (beyond the
per-step GDN core graph of prefill steps, runner/piecewise.py, which is captured by design).
Measured values are printed (`pytest -s`, lines starting with GPU_DECODE)."""

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


def decode_step_ms(llm, num_seqs: int, steps: int = 12) -> float:
    """Median wall time of a decode step of `num_seqs` sequences (sampling included)."""
    engine = llm.engine
    generator = torch.Generator().manual_seed(num_seqs)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(f"tpot-{num_seqs}-{i}", {"prompt_token_ids": random_ids(generator, 40)}, params,
                           stream=False)
    engine.step()  # the prefill
    times = []
    while engine.has_unfinished_requests():
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[:-1])


def test_decode_graphs_match_the_eager_decode(model_dir):  # noqa: F811
    llm = make_llm(model_dir)
    runner = llm.engine.runner
    graphs = runner.decode_graphs
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4, 8, 16]  # 16 request slots
    assert runner.warmup is not None and runner.warmup.steps >= 20
    generator = torch.Generator().manual_seed(11)
    marker = llm.checkpoint_token_id
    anchor = random_ids(generator, 70)
    prompts = [{"prompt_token_ids": anchor + [marker] + random_ids(generator, n)} for n in (3, 20, 1, 45)]
    prompts += [{"prompt_token_ids": random_ids(generator, n)} for n in (1, 9, 130, 33, 64, 5, 17)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=5)
              for m in (12, 3, 9, 16, 7, 2, 10, 5, 14, 4, 8)]
    assert llm.reset_prefix_cache()  # both runs from an empty cache: the same steps (see the Mamba2 graph test)
    with_graphs = llm.generate(prompts, params, use_tqdm=False)
    replays = graphs.replays
    assert replays >= 12
    runner.decode_graphs = None
    assert llm.reset_prefix_cache()
    eager = llm.generate(prompts, params, use_tqdm=False)
    assert [o.num_cached_tokens for o in eager] == [o.num_cached_tokens for o in with_graphs]
    worst = max(max_logprob_diff(a, b) for a, b in zip(with_graphs, eager))
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(with_graphs, eager))
    timing = {}
    for n in (1, 16):
        timing[f"eager_{n}"] = decode_step_ms(llm, n)
    runner.decode_graphs = graphs
    for n in (1, 16):
        timing[f"graph_{n}"] = decode_step_ms(llm, n)
    print(f"GPU_DECODE graphs vs eager: {replays} replays, max top-5 logprob diff {worst:.2e}, "
          f"{same}/{len(prompts)} generations identical; decode step ms {timing}")
    assert worst <= GRAPH_LOGPROB_TOL
    llm.engine.check_integrity()


class CompileCounter:
    """Counts Triton in-memory cache misses (a kernel variant compiled or loaded for the first time in
    this process), autotuner benchmarks and CUDA graph captures while installed; `core_captures`:
    the per-step recurrent core graphs `piecewise` attempted meanwhile (captured by design)."""

    def __init__(self, monkeypatch, piecewise) -> None:
        self._piecewise = piecewise
        self._core_start = piecewise.core_graph_steps + piecewise.core_capture_failures
        import triton
        from triton.runtime.autotuner import Autotuner

        self.compiled: list[str] = []
        self.autotuned: list[str] = []
        self.captures = 0
        previous = triton.knobs.runtime.jit_cache_hook

        def on_miss(*args, **kwargs):
            self.compiled.append(str(kwargs.get("repr", args)))
            return previous(*args, **kwargs) if previous is not None else False

        monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", on_miss)
        bench = Autotuner._bench

        def counting_bench(tuner, *args, **kwargs):
            self.autotuned.append(getattr(tuner.fn, "__name__", str(tuner.fn)))
            return bench(tuner, *args, **kwargs)

        monkeypatch.setattr(Autotuner, "_bench", counting_bench)
        capture_begin = torch.cuda.CUDAGraph.capture_begin

        def counting_capture(graph, *args, **kwargs):
            self.captures += 1
            return capture_begin(graph, *args, **kwargs)

        monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", counting_capture)

    @property
    def core_captures(self) -> int:
        return self._piecewise.core_graph_steps + self._piecewise.core_capture_failures - self._core_start


def test_nothing_compiles_after_the_warm_up(model_dir, monkeypatch):  # noqa: F811
    # a small token budget: chunked prefills next to decodes, two-phase checkpoint steps
    llm = make_llm(model_dir, max_num_batched_tokens=512)
    runner = llm.engine.runner
    piecewise = runner.piecewise
    counter = CompileCounter(monkeypatch, piecewise)
    generator = torch.Generator().manual_seed(21)
    marker = llm.checkpoint_token_id
    steps_before = llm.engine.metrics()["steps"]
    for _round in range(4):
        anchor = random_ids(generator, int(torch.randint(1, 400, (1,), generator=generator)))
        prompts, params = [], []
        for _ in range(int(torch.randint(1, 17, (1,), generator=generator))):
            suffix = random_ids(generator, int(torch.randint(1, 300, (1,), generator=generator)))
            kind = int(torch.randint(0, 3, (1,), generator=generator))
            ids = anchor + [marker] + suffix if kind == 0 else anchor + suffix if kind == 1 else suffix
            prompts.append({"prompt_token_ids": ids})
            params.append(SamplingParams(temperature=0.0, ignore_eos=True,
                                         max_tokens=int(torch.randint(1, 9, (1,), generator=generator))))
        llm.generate(prompts, params, use_tqdm=False)
    core_captures = counter.core_captures
    steps = llm.engine.metrics()["steps"]
    print(f"GPU_DECODE after warm-up ({runner.warmup}): steps {steps} (from {steps_before}), "
          f"Triton cache misses {len(counter.compiled)}, autotunes {len(counter.autotuned)}, "
          f"graph captures {counter.captures} (per-step GDN core graphs {core_captures}); "
          f"compiled: {sorted(set(counter.compiled))[:12]}; autotuned: {sorted(set(counter.autotuned))}")
    assert not counter.compiled
    assert not counter.autotuned
    assert counter.captures == core_captures
    llm.engine.check_integrity()


def test_a_burst_of_many_consumers_compiles_nothing_after_the_warm_up(model_dir, monkeypatch):  # noqa: F811
    # The 35B run's only slow step (docs/e2e_h200.md, session 4): the first full 8,192-token step of
    # a 256-consumer burst behind one checkpoint ran at 3.99x its fitted time. The same layout here:
    # one producer, then full steps of many short consumer suffixes read from it (phase 2 with
    # hundreds of segments), two bursts with their steps timed (the first against the second).
    llm = make_llm(model_dir, num_kv_blocks=4096, num_state_slots=256, max_num_seqs=256)
    runner = llm.engine.runner
    piecewise = runner.piecewise
    counter = CompileCounter(monkeypatch, piecewise)
    generator = torch.Generator().manual_seed(5)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []  # per burst, the wall time of each step: the first burst's against the second's
    for burst in range(2):
        anchor = random_ids(generator, 624) + [llm.checkpoint_token_id]
        for i in range(256):
            suffix = random_ids(generator, int(torch.randint(24, 40, (1,), generator=generator)))
            engine.add_request(f"burst-{burst}-{i}", {"prompt_token_ids": anchor + suffix}, params, stream=False)
        times.append([])
        while engine.has_unfinished_requests():
            torch.cuda.synchronize()
            start = time.perf_counter()
            engine.step()
            torch.cuda.synchronize()
            times[-1].append(round(1e3 * (time.perf_counter() - start), 1))
    core_captures = counter.core_captures
    print(f"GPU_DECODE two bursts of 256 consumers after warm-up: step ms {times}; "
          f"Triton cache misses {len(counter.compiled)}, autotunes {len(counter.autotuned)}, "
          f"graph captures {counter.captures} (per-step core graphs {core_captures}); "
          f"compiled: {sorted(set(counter.compiled))[:12]}")
    assert engine.metrics()["prompt_tokens_cached"] == 2 * 255 * 624  # every consumer read its checkpoint
    assert not counter.compiled
    assert not counter.autotuned
    assert counter.captures == core_captures
    engine.check_integrity()
