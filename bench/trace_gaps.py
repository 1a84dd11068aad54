"""Where a step's GPU idle time goes: the host code running while no kernel does.

Input: a Chrome trace exported by torch.profiler (`prof.export_chrome_trace`) of a window with CPU and
CUDA activity, recorded `with_stack=True` so that Python frames appear as "python_function" events.

A GPU *gap* is an interval of at least `min_gap_us` in which no kernel, memcpy or memset runs
(the union of all device events). The device event that ends a gap was launched by a host runtime call
(matched by its "correlation" id: `cudaLaunchKernel`, `cudaGraphLaunch`, `cudaMemcpyAsync`, Triton's
`cuLaunchKernelEx`, ...). If that
launch came after the gap began, the device waited for the host for `launch - gap start` microseconds
("host-bound"): the report samples that part of the gap every `sample_us` and charges each sample to the
innermost Python frame of the project (`frame_prefix`) running on the launching thread, and to its
innermost frame of any kind. The rest of a gap (launched early, started late: a dependency, a graph's
own launch latency) is "device-side".

    report = idle_report(json.load(open(path)), min_gap_us=10)
    report["host_bound_us"], report["by_project_frame"][:10]
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})


@dataclass(frozen=True)
class Span:
    """One trace event's interval, microseconds since the trace's origin; `key` is its name."""

    start: float
    end: float
    key: str


@dataclass(frozen=True)
class Gap:
    """No device work in [start, end); the next device event was launched by the host at `launch`
    (on thread `thread`), or None when no launch matched it."""

    start: float
    end: float
    launch: float | None
    thread: tuple | None

    @property
    def host_bound_us(self) -> float:
        return 0.0 if self.launch is None else max(0.0, min(self.launch, self.end) - self.start)


def device_gaps(events: Sequence[dict], min_gap_us: float) -> list[Gap]:
    """Gaps of at least `min_gap_us` between device events (their union), first to last device event."""
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES and "ts" in e),
                    key=lambda e: float(e["ts"]))
    launches = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = (float(e["ts"]), (e.get("pid"), e.get("tid")))
    gaps: list[Gap] = []
    reach = None
    for e in device:
        start = float(e["ts"])
        if reach is not None and start - reach >= min_gap_us:
            launch, thread = launches.get(e.get("args", {}).get("correlation"), (None, None))
            gaps.append(Gap(reach, start, launch, thread))
        end = start + float(e.get("dur", 0.0))
        reach = end if reach is None else max(reach, end)
    return gaps


def _frames_by_thread(events: Sequence[dict]) -> dict[tuple, list[Span]]:
    frames: dict[tuple, list[Span]] = {}
    for e in events:
        if e.get("cat") == "python_function" and "ts" in e:
            start = float(e["ts"])
            frames.setdefault((e.get("pid"), e.get("tid")), []).append(
                Span(start, start + float(e.get("dur", 0.0)), str(e.get("name", ""))))
    for spans in frames.values():
        spans.sort(key=lambda s: (s.start, -s.end))
    return frames


def _charge(spans: list[Span], samples: list[tuple[float, float]], prefix: str, tables: dict[str, dict]) -> None:
    """Charge each (time, weight) sample to the innermost span covering it (tables["anywhere"]), to the
    innermost one whose key contains `prefix` (tables["project"]) and to the innermost three of those
    (tables["project_stack"], "inner < outer < outermost"): one sweep over `spans` (sorted by start, longest
    first; frames of one thread nest, so the open ones form a stack)."""
    stack: list[Span] = []
    index = 0
    for at, weight in sorted(samples):
        while index < len(spans) and spans[index].start <= at:
            while stack and stack[-1].end < spans[index].start:
                stack.pop()
            stack.append(spans[index])
            index += 1
        while stack and stack[-1].end < at:
            stack.pop()
        mine = [s.key for s in reversed(stack) if prefix in s.key][:3] or ["(no frame)"]
        keys = {"anywhere": stack[-1].key if stack else "(no frame)", "project": mine[0],
                "project_stack": " < ".join(mine)}
        for table, key in keys.items():
            tables[table][key] = tables[table].get(key, 0.0) + weight


def idle_report(trace: dict, min_gap_us: float = 10.0, sample_us: float = 5.0,
                frame_prefix: str = "forkpoint/", top: int = 25) -> dict:
    """The device window, its busy and idle microseconds, the gaps' host-bound and device-side parts,
    and the host-bound part charged to frames: `by_project_frame` (innermost `frame_prefix` frame),
    `by_project_stack` (its innermost three) and `by_frame` (innermost frame of any kind), each [(frame,
    us)] largest first, `top` of them."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES and "ts" in e]
    if not device:
        return {"device_events": 0}
    first = min(float(e["ts"]) for e in device)
    last = max(float(e["ts"]) + float(e.get("dur", 0.0)) for e in device)
    gaps = device_gaps(events, min_gap_us)
    frames = _frames_by_thread(events)
    samples: dict[tuple, list[tuple[float, float]]] = {}
    for gap in gaps:
        bound = gap.host_bound_us
        if bound > 0 and gap.thread in frames:
            count = max(1, int(bound // sample_us))
            weight = bound / count
            samples.setdefault(gap.thread, []).extend((gap.start + (k + 0.5) * weight, weight) for k in range(count))
    tables: dict[str, dict] = {"project": {}, "project_stack": {}, "anywhere": {}}
    for thread, points in samples.items():
        _charge(frames[thread], points, frame_prefix, tables)
    idle = sum(g.end - g.start for g in gaps)
    return {
        "device_events": len(device), "window_us": round(last - first, 1), "gaps": len(gaps),
        "gap_idle_us": round(idle, 1), "host_bound_us": round(sum(g.host_bound_us for g in gaps), 1),
        "device_side_us": round(idle - sum(g.host_bound_us for g in gaps), 1),
        **{f"by_{name}": [(k, round(v, 1)) for k, v in sorted(table.items(), key=lambda kv: -kv[1])[:top]]
           for name, table in (("project_frame", tables["project"]), ("project_stack", tables["project_stack"]),
                               ("frame", tables["anywhere"]))},
    }


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a Chrome trace from torch.profiler (with_stack=True)")
    parser.add_argument("--min-gap-us", type=float, default=10.0)
    args = parser.parse_args()
    with open(args.trace) as f:
        report = idle_report(json.load(f), args.min_gap_us)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
