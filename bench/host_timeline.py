"""Where the host time of a decode step goes, with asynchronous scheduling on.

`decode_host_timeline` decodes `n` sequences for a few steps with the engine's parts wrapped in
timers (instance attributes shadowing the methods, removed afterwards) and, on CUDA, the same steps
under torch.profiler: the fraction of the window in which some kernel runs. A decode step that
costs more wall time than its kernels is host-bound when `wait` (the host blocked on the step's
tokens) is near zero, and the GPU idles between steps (busy fraction < 1).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager

import torch

from forkpoint.runner import model_runner
from forkpoint.runner.sampler import PendingSample
from forkpoint.sampling_params import SamplingParams


class Timers:
    """Seconds per named part, summed over the calls made while installed."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
                self.calls[name] = self.calls.get(name, 0) + 1
        return timed


@contextmanager
def instrumented(engine, timers: Timers, pieces: bool = False):
    """The engine's step parts timed; with `pieces`, also the piecewise forward's eager parts (the
    embedding, the pieces' replays, the recurrent cores run eagerly and their per-step capture, the
    other cores). Everything restored on exit."""
    shadowed = [(engine.scheduler, "schedule_ahead"), (engine.scheduler, "schedule"), (engine.scheduler, "commit"),
                (engine.runner, "execute"), (engine.runner, "forward"),
                (engine.runner.sampling.sampler, "sample_async"), (engine, "_record")]
    piecewise = getattr(engine.runner, "piecewise", None)
    if pieces and piecewise is not None:
        shadowed += [(piecewise, "_embed"), (piecewise, "_run_piece"), (piecewise, "_recurrent_core"),
                     (piecewise, "_capture_recurrent_core"), (piecewise.model, "core")]
    for owner, name in shadowed:
        setattr(owner, name, timers.wrap(name, getattr(owner, name)))
    build, result = model_runner.build_forward_batch, PendingSample.result
    model_runner.build_forward_batch = timers.wrap("build_forward_batch", build)
    PendingSample.result = timers.wrap("wait_tokens", result)
    try:
        yield
    finally:
        for owner, name in shadowed:
            owner.__dict__.pop(name, None)
        model_runner.build_forward_batch, PendingSample.result = build, result


def busy_fraction(prof, window_us: float) -> float:
    """Union of the kernels' intervals over the profiled window."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if "cuda" in str(getattr(e, "device_type", "")).lower() and e.time_range.end > e.time_range.start)
    busy, reach = 0.0, None
    for start, end in spans:
        if reach is None or start > reach:
            busy += end - start
            reach = end
        elif end > reach:
            busy += end - reach
            reach = end
    return busy / window_us if window_us > 0 else 0.0


def _forward_spans(engine, steps: int) -> dict:
    """GPU time from the start to the end of each step's forward (CUDA events on the stream around
    `runner.forward`: the kernels and the gaps between them, inside a graph too); p50 and min, ms."""
    forward = engine.runner.forward
    pairs = []

    def timed(*args, **kwargs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = forward(*args, **kwargs)
        end.record()
        pairs.append((start, end))
        return out

    engine.runner.forward = timed
    try:
        for _ in range(steps):
            engine.step()
    finally:
        engine.runner.__dict__.pop("forward", None)
    torch.cuda.synchronize(engine.device)
    spans = sorted(start.elapsed_time(end) for start, end in pairs)
    return {"p50": round(spans[len(spans) // 2], 4), "min": round(spans[0], 4), "steps": len(spans)}


def decode_host_timeline(engine, prompts: list[list[int]], steps: int = 24, warm_steps: int = 4) -> dict:
    """Decode `len(prompts)` greedy sequences with `engine.async_scheduling` on: after their prefill
    and `warm_steps` decode steps, time `steps` steps (ms per step: wall, each part, and on CUDA the
    kernels' busy fraction of the profiled window). Leaves async_scheduling as it found it."""
    from torch.profiler import ProfilerActivity, profile

    was_async = engine.async_scheduling
    engine.async_scheduling = True
    params = SamplingParams(temperature=0.0, max_tokens=warm_steps + 3 * steps + 8, ignore_eos=True)
    ids = [f"host-{len(prompts)}-{i}" for i in range(len(prompts))]
    try:
        for request_id, prompt in zip(ids, prompts):
            engine.add_request(request_id, {"prompt_token_ids": prompt}, params, stream=False)
        while not all(len(engine.sequences(i)[0].output_token_ids) > warm_steps for i in ids):
            engine.step()
        timers = Timers()
        with instrumented(engine, timers):
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            wall = time.perf_counter() - start
        report = {"n": len(prompts), "steps": steps, "wall_ms_per_step": 1e3 * wall / steps,
                  "parts_ms_per_step": {k: round(1e3 * v / steps, 4) for k, v in
                                        sorted(timers.seconds.items(), key=lambda kv: -kv[1])},
                  "calls": dict(timers.calls)}
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                start = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                window = time.perf_counter() - start
            report["profiled_wall_ms_per_step"] = 1e3 * window / steps
            report["gpu_busy_fraction"] = round(busy_fraction(prof, 1e6 * window), 4)
            runtime = {}
            for e in prof.key_averages():
                if e.key.startswith("cuda") and e.cpu_time_total > 0:
                    runtime[e.key] = (e.count, round(e.cpu_time_total / 1e3 / steps, 4))
            report["cuda_runtime_ms_per_step"] = dict(sorted(runtime.items(), key=lambda kv: -kv[1][1])[:10])
            report["forward_gpu_span_ms"] = _forward_spans(engine, steps)
        return report
    finally:
        for request_id in ids:
            engine.abort_request(request_id)
        while engine.has_unfinished_requests():
            engine.step()
        engine.async_scheduling = was_async
