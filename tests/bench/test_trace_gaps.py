"""bench/trace_gaps.py: a step's GPU gaps split into host-bound and device-side parts, and the host-bound
part charged to the Python frames running while the device waited."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

from trace_gaps import device_gaps, idle_report  # noqa: E402

HOST = {"pid": 1, "tid": 7}


def kernel(ts: float, dur: float, correlation: int) -> dict:
    return {"cat": "kernel", "name": "k", "ts": ts, "dur": dur, "args": {"correlation": correlation}}


def launch(ts: float, correlation: int) -> dict:
    return {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1, **HOST,
            "args": {"correlation": correlation}}


def frame(ts: float, dur: float, name: str) -> dict:
    return {"cat": "python_function", "name": name, "ts": ts, "dur": dur, **HOST}


def test_a_gap_is_host_bound_up_to_the_launch_of_the_kernel_that_ends_it():
    events = [kernel(0, 10, 1), launch(0, 1), launch(40, 2), kernel(50, 10, 2), launch(55, 3), kernel(62, 5, 3)]
    gaps = device_gaps(events, min_gap_us=5)
    assert [(g.start, g.end) for g in gaps] == [(10, 50)]  # 60 -> 62 is under the threshold
    assert gaps[0].host_bound_us == 30  # launched at 40: 10 us of launch-to-start latency


def test_host_bound_time_goes_to_the_innermost_frames_running_then():
    events = [kernel(0, 10, 1), launch(0, 1), launch(90, 2), kernel(100, 10, 2),
              frame(0, 200, "forkpoint/engine/engine.py(1): step"),
              frame(5, 100, "forkpoint/runner/piecewise.py(9): forward"),
              frame(20, 30, "torch/cuda/graphs.py(3): capture_begin"),
              frame(60, 20, "forkpoint/models/recurrent.py(4): plan")]
    report = idle_report({"traceEvents": events}, min_gap_us=5, sample_us=1)
    assert report["gap_idle_us"] == 90 and report["host_bound_us"] == 80 and report["device_side_us"] == 10
    project = dict(report["by_project_frame"])
    assert project["forkpoint/models/recurrent.py(4): plan"] == pytest.approx(20)
    assert project["forkpoint/runner/piecewise.py(9): forward"] == pytest.approx(60)  # torch's frame counts here
    assert dict(report["by_frame"])["torch/cuda/graphs.py(3): capture_begin"] == pytest.approx(30)
    stacks = dict(report["by_project_stack"])
    assert stacks["forkpoint/models/recurrent.py(4): plan < forkpoint/runner/piecewise.py(9): forward < "
                  "forkpoint/engine/engine.py(1): step"] == pytest.approx(20)


def test_no_device_events_is_an_empty_report():
    assert idle_report({"traceEvents": [launch(0, 1)]}) == {"device_events": 0}
