"""How long a message takes to cross the pipe of `--engine-process`, each way, while the engine steps and
other threads of the server process want the GIL (as the event loop, the HTTP work and the tokenizer pool do).

A `ProcessWorker` (no HTTP) drives the engine process; --streams coroutines on this process's event loop each
add a request (greedy, ignore_eos, --tokens tokens) and read its outputs, one request after another, while
--busy-threads threads here run pure-Python work (JSON round trips, as a chat template's rendering holds the
GIL). Every message is stamped on its way (the stamps ride the pickled message as extra attributes, patched in
by this script; the server's messages carry none):

    to the engine (Add)     made (event loop) -> sent (sender thread, before pickling) -> received (the
                            engine process's command reader, unpickled) -> taken (the engine thread's
                            `add_request`: the request's arrival time)
    from the engine         made (engine thread, a step's outputs) -> sent (outbox thread, before pickling)
    (Delivered)             -> received (reader thread, unpickled) -> delivered (the stream's coroutine has it)

One clock (CLOCK_MONOTONIC is the machine's). Modes "CHILD/SERVER": the GIL switch intervals in ms of the
engine process and this one (5: CPython's default; `forkpoint serve --engine-process --gil-switch-interval-ms`
sets both). Per mode, each leg's p50 / p90 / p99 in ms.

Usage:
    python bench/pipe_crossing.py                                    # tiny test model, 5/5 against 0.5/0.5
    python bench/pipe_crossing.py --modes 5/5 0.5/5 5/0.5 0.5/0.5 1/1 --rounds 3
Writes bench/results/pipe_crossing_cpu.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # as the tests: the engine process's ops are tiny
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from host_info import code_version, machine_info, machine_line  # noqa: E402
from plots import write_results  # noqa: E402

from forkpoint.sampling_params import SamplingParams  # noqa: E402
from forkpoint.server import engine_child, process_worker  # noqa: E402
from forkpoint.server.config import MarkerPolicy  # noqa: E402
from forkpoint.server.worker import NewRequest, OutputSink  # noqa: E402

LOG_ENV = "FORKPOINT_BENCH_CROSSING_LOG"  # where the engine process appends each Add's stamps
TO_ENGINE = ("made->sent", "sent->received", "received->taken", "made->taken")
FROM_ENGINE = ("made->sent", "sent->received", "received->delivered", "made->delivered")


def _stamp(message: object, name: str) -> None:
    object.__setattr__(message, name, time.monotonic())  # frozen dataclasses: pickled with their __dict__


class _StampedConnection:
    """A Connection whose `send` stamps `t_sent` before pickling and whose `recv` stamps `t_received` after."""

    def __init__(self, connection, on_received=None) -> None:
        self._connection = connection
        self._on_received = on_received

    def send(self, message) -> None:
        _stamp(message, "t_sent")
        self._connection.send(message)

    def recv(self):
        message = self._connection.recv()
        _stamp(message, "t_received")
        if self._on_received is not None:
            self._on_received(message)
        return message

    def __getattr__(self, name):
        return getattr(self._connection, name)


def _stamped_engine_process(engine_kwargs, served_model_name, marker_policy, log_level, commands, events,
                            switch_interval_s) -> None:
    """`run_engine_process` with stamps: a Delivered where the engine thread makes it (`t_made`) and where the
    outbox thread pickles it (`t_sent`); each Add's stamps appended to $FORKPOINT_BENCH_CROSSING_LOG."""
    log = open(os.environ[LOG_ENV], "a", buffering=1)  # noqa: SIM115 - open for the process's life
    delivered, pickled = engine_child.Delivered, engine_child._pickled

    def made(*args, **kwargs):
        event = delivered(*args, **kwargs)
        _stamp(event, "t_made")
        return event

    def sending(event):
        _stamp(event, "t_sent")
        return pickled(event)

    def received(command):  # the command reader thread only
        if isinstance(command, engine_child.Add):
            log.write(json.dumps({"ids": [r.request_id for r in command.requests], "made": command.t_made,
                                  "sent": command.t_sent, "received": command.t_received}) + "\n")

    engine_child.Delivered = made
    engine_child._pickled = sending
    engine_child.run_engine_process(engine_kwargs, served_model_name, marker_policy, log_level,
                                    _StampedConnection(commands, received), events, switch_interval_s)


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(1e3 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)

    return {"n": len(values), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99),
            "mean": round(1e3 * statistics.fmean(values), 2)}


def _busy(stop: threading.Event, counter: list[int]) -> None:
    """Pure-Python work (a JSON round trip of a 40-message body, ~50 us) until `stop`."""
    body = {"messages": [{"role": "user", "content": f"note {i}: the value is {i * 7 % 97}"} for i in range(40)]}
    while not stop.is_set():
        json.loads(json.dumps(body))
        counter[0] += 1


def _streams(args: argparse.Namespace, worker, sink_kind) -> tuple[int, dict[str, float], list[dict]]:
    """--streams clients, one request after another for --seconds: (requests done, each request's arrival in
    the engine, each delivery's stamps)."""
    arrivals: dict[str, float] = {}
    deliveries: list[dict] = []

    async def stream(index: int, until: float) -> int:
        loop = asyncio.get_running_loop()
        params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
        done = 0
        while time.monotonic() < until:
            request_id = f"s{index}-{done}"
            sink = sink_kind(loop)
            prompt = {"prompt_token_ids": [(index * 7 + done + i) % 100 + 4 for i in range(args.prompt_tokens)]}
            await worker.add_many([NewRequest(request_id, prompt, params)], sink)
            finished = False
            while not finished:
                item, stamps = await sink.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if stamps["made"] is not None:
                    deliveries.append({**stamps, "delivered": time.monotonic()})
                for output in item:
                    if output.metrics is not None:
                        arrivals.setdefault(request_id, output.metrics.arrival_time)
                    finished = finished or output.finished
            done += 1
        return done

    async def run() -> int:
        until = time.monotonic() + args.seconds
        return sum(await asyncio.gather(*(stream(i, until) for i in range(args.streams))))

    return asyncio.run(run()), arrivals, deliveries


def run_mode(args: argparse.Namespace, model: str, mode: str) -> dict:
    """One engine process, one measurement; `mode` "CHILD/SERVER": the switch intervals (ms) of the engine
    process and this one."""
    default = sys.getswitchinterval()
    child_ms, server_ms = (float(x) for x in mode.split("/"))
    log_path = tempfile.mktemp(prefix="crossing-", suffix=".jsonl")
    os.environ[LOG_ENV] = log_path
    entry, add = process_worker.run_engine_process, process_worker.Add
    process_worker.run_engine_process = _stamped_engine_process  # spawn pickles it by name: this module's
    try:
        worker, _ = process_worker.start_engine_process(
            {"model": model, "max_model_len": 2048, "num_kv_blocks": 1024, "max_num_seqs": 64},
            served_model_name="bench", marker_policy=MarkerPolicy("allow"), log_level="warning",
            switch_interval_s=child_ms / 1e3)
    finally:
        process_worker.run_engine_process = entry
    current: dict = {}  # the event the reader thread is dispatching (one reader thread)
    worker._events = _StampedConnection(worker._events, lambda event: current.update(event=event))
    worker._commands = _StampedConnection(worker._commands)

    def made_add(*a, **k):
        command = add(*a, **k)
        _stamp(command, "t_made")
        return command

    class StampedSink(OutputSink):
        def deliver_threadsafe(self, item) -> None:
            event = current.get("event")
            stamps = {name: getattr(event, f"t_{name}", None) for name in ("made", "sent", "received")}
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (item, stamps))

    process_worker.Add = made_add
    sys.setswitchinterval(server_ms / 1e3)
    stop = threading.Event()
    counters = [[0] for _ in range(args.busy_threads)]
    threads = [threading.Thread(target=_busy, args=(stop, c), daemon=True) for c in counters]
    worker.start()
    for thread in threads:
        thread.start()
    began = time.monotonic()
    try:
        requests, arrivals, deliveries = _streams(args, worker, StampedSink)
    finally:
        elapsed = time.monotonic() - began
        stop.set()
        for thread in threads:
            thread.join()
        sys.setswitchinterval(default)
        process_worker.Add = add
        worker.shutdown(timeout_s=0.0)
    with open(log_path) as log:
        adds = [json.loads(line) for line in log]
    os.unlink(log_path)
    to_engine: dict[str, list[float]] = {leg: [] for leg in TO_ENGINE}
    for a in adds:
        taken = arrivals.get(a["ids"][0])
        to_engine["made->sent"].append(a["sent"] - a["made"])
        to_engine["sent->received"].append(a["received"] - a["sent"])
        if taken is not None:
            to_engine["received->taken"].append(taken - a["received"])
            to_engine["made->taken"].append(taken - a["made"])
    from_engine: dict[str, list[float]] = {leg: [] for leg in FROM_ENGINE}
    for d in deliveries:
        from_engine["made->sent"].append(d["sent"] - d["made"])
        from_engine["sent->received"].append(d["received"] - d["sent"])
        from_engine["received->delivered"].append(d["delivered"] - d["received"])
        from_engine["made->delivered"].append(d["delivered"] - d["made"])
    return {"mode": mode, "engine_switch_interval_ms": child_ms, "server_switch_interval_ms": server_ms,
            "seconds": round(elapsed, 2), "requests": requests,
            "tokens_per_s": round(requests * args.tokens / elapsed, 1),
            "busy_slices_per_s": round(sum(c[0] for c in counters) / elapsed, 1),
            "to_engine": {leg: _percentiles(v) for leg, v in to_engine.items()},
            "from_engine": {leg: _percentiles(v) for leg, v in from_engine.items()}}


def plot(result: dict, path: str) -> None:
    """Each direction's whole crossing, p50 and p90, per mode (all rounds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = [m["mode"] for m in result["modes"]]
    xs = range(len(labels))
    for ax, (direction, leg) in zip(axes, (("to_engine", "made->taken"), ("from_engine", "made->delivered"))):
        for offset, q in ((-0.2, "p50"), (0.2, "p90")):
            ax.bar([x + offset for x in xs], [m[direction][leg].get(q, 0) for m in result["modes"]], 0.4, label=q)
        ax.set_xticks(list(xs), labels, rotation=30)
        ax.set_ylabel(f"{direction.replace('_', ' ')}: {leg} (ms)")
        ax.set_xlabel("GIL switch interval, engine process / server process (ms)")
        ax.legend()
    fig.suptitle(f"pipe crossings: {result['streams']} streams, {result['busy_threads']} busy threads "
                 f"({result['model']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: the tiny test model, built here)")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32, help="tokens per request")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--busy-threads", type=int, default=2, help="threads of pure-Python work in this process")
    parser.add_argument("--seconds", type=float, default=8.0, help="per mode and round")
    parser.add_argument("--rounds", type=int, default=1, help="times each mode runs (alternating)")
    parser.add_argument("--modes", nargs="+", default=["5/5", "0.5/0.5"],
                        help="ENGINE/SERVER GIL switch intervals in ms (5: CPython's default)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--name", default="pipe_crossing_cpu")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from tests.tiny_models import build_tiny_model

        model = os.path.join(tempfile.mkdtemp(prefix="forkpoint-tiny-"), "qwen3_5_text")
        build_tiny_model(Path(model), "qwen3_5_text")
    result = {"code": code_version(), "machine": machine_info(), "model": args.model or "tiny test model",
              "command": " ".join(sys.argv), "streams": args.streams, "tokens": args.tokens,
              "busy_threads": args.busy_threads, "modes": []}
    print(machine_line(result["machine"]), flush=True)
    for round_ in range(args.rounds):
        for mode in args.modes:
            row = run_mode(args, model, mode)
            row["round"] = round_ + 1
            result["modes"].append(row)
            print(f"round {round_ + 1}, {mode}: {row['requests']} requests", flush=True)
    def cell(stats: dict) -> str:
        return f"{stats.get('p50', 0):>6.1f} /{stats.get('p90', 0):>6.1f} /{stats.get('p99', 0):>6.1f}"

    print(f"{'engine/server ms':>16} {'round':>5} {'tokens/s':>8} {'busy/s':>7}  "
          f"{'to engine p50/p90/p99 (ms)':<28} {'from engine p50/p90/p99 (ms)':<28}")
    for m in result["modes"]:
        print(f"{m['mode']:>16} {m['round']:>5} {m['tokens_per_s']:>8.0f} {m['busy_slices_per_s']:>7.0f}  "
              f"{cell(m['to_engine']['made->taken']):<28} {cell(m['from_engine']['made->delivered']):<28}")
    print("legs, p50 (ms): to engine " + " | ".join(TO_ENGINE[:3]) + "; from engine " + " | ".join(FROM_ENGINE[:3]))
    for m in result["modes"]:
        legs = [m["to_engine"][leg].get("p50", 0) for leg in TO_ENGINE[:3]]
        legs += [m["from_engine"][leg].get("p50", 0) for leg in FROM_ENGINE[:3]]
        print(f"{m['mode']:>16} {m['round']:>5}  " + "  ".join(f"{v:>6.2f}" for v in legs))
    print(f"commit {result['code']['commit']} (forkpoint modified: {result['code']['forkpoint_modified']})")
    print(f"wrote {write_results(result, args.out, args.name, plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
