"""Streams beside heavy prompts, with the engine in the server's process or in its own (`--engine-process`).

For each mode a fresh `forkpoint serve` (embedded model unless --model) runs two phases of --seconds each:
`alone`: --streams clients each stream completions (greedy, ignore_eos, --stream-tokens tokens) one after
another; `loaded`: the same streams while --loaders clients send, one after another, chat requests of
--messages short messages (max_tokens 1): one shared history, which the engine reuses after its first
request, and a new last message, so the engine computes little while the server renders and tokenises
the whole conversation each time (the chat template, transformers' message handling, the body's JSON:
Python work in the server process). Per phase: the streams'
tokens per second (chunks received, one token each, over the phase), the p50 over streams of each one's
largest gap between chunks, the loaders' requests done and their p50 time, and the mean hand-off and delivery
of the time to first token (the server's `forkpoint_request_{handoff,delivery}_time_seconds` over the phase:
with --engine-process each includes a crossing of the pipe). One process shares one GIL between the step loop
and that prompt work; with --engine-process the step loop has its own. The mode "engine process, 5 ms" is
`--engine-process --gil-switch-interval-ms 5`: CPython's switch interval, as before the option.

Usage:
    python bench/engine_process.py                                   # both modes, embedded model
    python bench/engine_process.py --streams 32 --loaders 4 --messages 3000 --seconds 20
    python bench/engine_process.py --modes "engine process, 5 ms" "engine process" --rounds 2
Writes bench/results/engine_process_cpu.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from agent_sessions import first_token_parts, mean_parts_ms  # noqa: E402
from host_info import code_version, machine_info, machine_line  # noqa: E402
from plots import write_results  # noqa: E402
from served import start_server  # noqa: E402

MODES = {"one process": [], "engine process, 5 ms": ["--engine-process", "--gil-switch-interval-ms", "5"],
         "engine process": ["--engine-process"]}


async def _stream(client: httpx.AsyncClient, model: str, tokens: int, until: float, times: list[float]) -> None:
    """Completions one after another until `until`; every chunk's arrival time into `times`."""
    body = {"model": model, "prompt": "Count:", "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    while time.monotonic() < until:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    times.append(time.monotonic())
                    if times[-1] >= until:
                        return


async def _load(client: httpx.AsyncClient, model: str, messages: int, until: float, seconds: list[float],
                tag: int) -> None:
    """Chat requests of `messages` messages, one after another until `until`; each one's time into `seconds`."""
    history = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"note {i}: the value is {i * 7 % 97}"}
               for i in range(messages - 1)]
    # the last message differs from its first token on (the junction is where it starts)
    prefix = chr(ord("A") + tag) if tag < 0 else f"{tag}-"
    sent = 0
    while sent == 0 or time.monotonic() < until:
        sent += 1  # the same history each time (the engine reuses it), a new last message
        body = {"model": model, "max_tokens": 1, "temperature": 0,
                "messages": [*history, {"role": "user", "content": f"{prefix}{sent}: summarise"}]}
        began = time.monotonic()
        response = await client.post("/v1/chat/completions", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"a loader's request failed: {response.status_code} {response.text[:300]}")
        seconds.append(time.monotonic() - began)


async def _warm_up(url: str, model: str, messages: int) -> None:
    """Two requests of the loaders' history: the second leaves the first where its last message starts,
    which is where the engine keeps a junction checkpoint that every later request then starts from."""
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        for tag in (-1, -2):  # last messages "@1: ..." and "?1: ...", loaders' "0-1: ...", "1-1: ..."
            await _load(client, model, messages, time.monotonic() + 1e-3, [], tag)


async def phase(url: str, model: str, args: argparse.Namespace, loaded: bool) -> dict:
    limits = httpx.Limits(max_connections=args.streams + args.loaders + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        began = time.monotonic()
        until = began + args.seconds
        streams = [[] for _ in range(args.streams)]
        loads: list[float] = []
        parts = first_token_parts(url)
        tasks = [_stream(client, model, args.stream_tokens, until, times) for times in streams]
        if loaded:
            tasks += [_load(client, model, args.messages, until, loads, i) for i in range(args.loaders)]
        await asyncio.gather(*tasks)
        elapsed = time.monotonic() - began
    means = mean_parts_ms(parts, first_token_parts(url))
    gaps = [max(b - a for a, b in zip(times, times[1:])) for times in streams if len(times) > 1]
    return {"phase": "loaded" if loaded else "alone", "seconds": round(elapsed, 2),
            "stream_tokens_per_s": round(sum(len(t) for t in streams) / elapsed, 1),
            "largest_gap_ms_p50": round(1e3 * statistics.median(gaps), 1) if gaps else None,
            "loader_requests": len(loads),
            "loader_request_s_p50": round(statistics.median(loads), 3) if loads else None,
            "handoff_ms_mean": round(means.get("handoff", 0.0), 2),
            "delivery_ms_mean": round(means.get("delivery", 0.0), 2)}


def plot(result: dict, path: str) -> None:
    """Streams' tokens/s alone and beside the loaders, per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    labels = [m["mode"] for m in result["modes"]]
    xs = range(len(labels))
    for offset, name in ((-0.2, "alone"), (0.2, "loaded")):
        rows = [next(p for p in m["phases"] if p["phase"] == name) for m in result["modes"]]
        left.bar([x + offset for x in xs], [r["stream_tokens_per_s"] for r in rows], 0.4, label=name)
        right.bar([x + offset for x in xs], [r["largest_gap_ms_p50"] or 0 for r in rows], 0.4, label=name)
    left.set_ylabel("streams' tokens/s")
    right.set_ylabel("largest gap per stream, p50 (ms)")
    for ax in (left, right):
        ax.set_xticks(list(xs), labels, rotation=15)
        ax.legend()
    fig.suptitle(f"{result['streams']} streams beside {result['loaders']} clients of {result['messages']}-message "
                 f"chats ({result['model']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: the embedded one)")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--stream-tokens", type=int, default=64)
    parser.add_argument("--loaders", type=int, default=4)
    parser.add_argument("--messages", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--rounds", type=int, default=1, help="times each mode runs (alternating)")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--server-arg", action="append", default=[], help="one more argument for `forkpoint serve`")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--name", default="engine_process_cpu")
    args = parser.parse_args()
    result = {"code": code_version(), "machine": machine_info(), "model": args.model or "embedded model",
              "command": " ".join(sys.argv), "streams": args.streams, "loaders": args.loaders,
              "messages": args.messages, "modes": []}
    print(machine_line(result["machine"]), flush=True)
    for round_ in range(args.rounds):
        for mode in args.modes:
            flags = MODES[mode]
            process, url = start_server(["--log-level", "warning", *flags, *args.server_arg], args.model, 600)
            try:
                model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
                warm = time.monotonic()  # the loaders' shared history, computed once before the phases
                asyncio.run(_warm_up(url, model, args.messages))
                print(f"{mode}: the history computed in {time.monotonic() - warm:.1f} s", flush=True)
                phases = [asyncio.run(phase(url, model, args, loaded)) for loaded in (False, True)]
            finally:
                process.terminate()
                process.wait(timeout=120)
            result["modes"].append({"mode": mode if args.rounds == 1 else f"{mode} #{round_ + 1}", "phases": phases})
    print(f"{'mode':<24} {'phase':<7} {'stream tokens/s':>16} {'largest gap p50 (ms)':>21} {'loader requests':>16} "
          f"{'loader p50 (s)':>15} {'hand-off (ms)':>14} {'delivery (ms)':>14}")
    for m in result["modes"]:
        for p in m["phases"]:
            print(f"{m['mode']:<24} {p['phase']:<7} {p['stream_tokens_per_s']:>16.1f} "
                  f"{p['largest_gap_ms_p50'] or 0:>21.1f} {p['loader_requests']:>16} "
                  f"{p['loader_request_s_p50'] or 0:>15.3f} {p['handoff_ms_mean']:>14.1f} "
                  f"{p['delivery_ms_mean']:>14.1f}")
    print(f"commit {result['code']['commit']} (forkpoint modified: {result['code']['forkpoint_modified']})")
    print(f"wrote {write_results(result, args.out, args.name, plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
