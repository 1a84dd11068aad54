"""Load run of the OpenAI-compatible server: many concurrent clients sending 1-to-N requests.

Starts `forkpoint serve` (embedded default model unless --model) on a free loopback port, or uses
--url. Each of --clients asyncio clients (the official openai client) loops until --duration s
have passed, sending streaming completions `anchor + <|mamba_checkpoint|> + suffix`: anchors of
--anchor-words random words are handed out in groups of --n requests (the first request
of a group produces the anchor's checkpoint, the rest reuse it), suffixes are fresh each time.

Reports requests/s, end-to-end latency and TTFT p50/p99, the error count (anything but a complete
200 response with usage), cached-token share, the server's CPU time per request (from /proc; less
sensitive than wall time to other load on a small machine) and its RSS (VmRSS) at the start and
the end of the run; writes bench/results/server_load.json and server_load.png (throughput and RSS
over time, latency histogram).

Usage:
    python bench/server_load.py                                   # 64 clients, 60 s
    python bench/server_load.py --clients 16 --duration 20 --n 4
    python bench/server_load.py --url http://127.0.0.1:8000 --server-pid 12345
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from openai import AsyncOpenAI
from served import start_server

from forkpoint.server.bench_cli import percentile

MARKER = "<|mamba_checkpoint|>"
WORDS = ("red", "blue", "cheap", "solid", "oak", "table", "lamp", "steel", "frame", "matte", "glass", "chair",
         "large", "small", "set", "of", "two", "with", "drawer", "shelf", "brass", "linen", "wool", "round")


@dataclass
class Sample:
    start_s: float  # since the run began
    latency_s: float
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    error: str | None = None


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (robust to other load on the machine, unlike wall time)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    return percentile(values, q) if values else float("nan")


def make_work(args: argparse.Namespace):
    """Endless (anchor, suffix) pairs: each anchor serves --n consecutive requests."""
    rng = random.Random(args.seed)
    for group in itertools.count():
        anchor = f"Listing {group}: " + " ".join(rng.choice(WORDS) for _ in range(args.anchor_words))
        for _ in range(args.n):
            yield anchor, " Candidate: " + " ".join(rng.choice(WORDS) for _ in range(args.suffix_words)) + ". Same?"


async def client_loop(client: AsyncOpenAI, model: str, work, t0: float, deadline: float, max_tokens: int,
                      samples: list[Sample]) -> None:
    while time.perf_counter() < deadline:
        anchor, suffix = next(work)
        begin = time.perf_counter()
        first = None
        usage = None
        error = None
        try:
            stream = await client.completions.create(
                model=model, prompt=anchor + MARKER + suffix, max_tokens=max_tokens, temperature=0.0, stream=True,
                stream_options={"include_usage": True})
            async for chunk in stream:
                if first is None and chunk.choices:
                    first = time.perf_counter()
                if chunk.usage is not None:
                    usage = chunk.usage
            if usage is None:
                error = "stream ended without usage"
        except Exception as exc:  # a load run counts every failure instead of stopping
            error = f"{type(exc).__name__}: {exc}"
        end = time.perf_counter()
        cached = (usage.prompt_tokens_details.cached_tokens or 0) if usage and usage.prompt_tokens_details else 0
        samples.append(Sample(begin - t0, end - begin, (first or end) - begin,
                              usage.prompt_tokens if usage else 0, cached, error))


async def run_load(args: argparse.Namespace, url: str, pid: int | None) -> dict:
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    samples: list[Sample] = []
    rss: list[tuple[float, float]] = []
    work = make_work(args)
    async with AsyncOpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=600) as client:
        # warm-up (untimed): first-request allocations belong to start-up, not to the load
        await client.completions.create(model=model, prompt="warm up" + MARKER + " now", max_tokens=1)
        rss_start = rss_mib(pid) if pid else None
        load_start = os.getloadavg()
        cpu_start = cpu_seconds(pid) if pid else None
        t0 = time.perf_counter()
        deadline = t0 + args.duration

        async def watch_rss() -> None:
            while time.perf_counter() < deadline:
                if pid and (value := rss_mib(pid)) is not None:
                    rss.append((time.perf_counter() - t0, value))
                await asyncio.sleep(1.0)

        watcher = asyncio.ensure_future(watch_rss())
        await asyncio.gather(*(client_loop(client, model, work, t0, deadline, args.max_tokens, samples)
                               for _ in range(args.clients)))
        wall = time.perf_counter() - t0
        watcher.cancel()
    rss_end = rss_mib(pid) if pid else None
    cpu_used = cpu_seconds(pid) - cpu_start if pid and cpu_start is not None else None
    ok = [s for s in samples if s.error is None]
    errors = [s for s in samples if s.error is not None]
    prompt = sum(s.prompt_tokens for s in ok)
    return {
        "url": url, "model": model, "clients": args.clients, "duration_s": args.duration, "wall_s": wall,
        "n_per_anchor": args.n, "anchor_words": args.anchor_words, "suffix_words": args.suffix_words,
        "max_tokens": args.max_tokens, "requests": len(samples), "errors": len(errors),
        "error_examples": sorted({s.error for s in errors})[:5],
        "requests_per_s": len(ok) / wall,
        "latency_p50_s": pct([s.latency_s for s in ok], 50),
        "latency_p99_s": pct([s.latency_s for s in ok], 99),
        "ttft_p50_s": pct([s.ttft_s for s in ok], 50),
        "ttft_p99_s": pct([s.ttft_s for s in ok], 99),
        "prompt_tokens": prompt, "cached_tokens": sum(s.cached_tokens for s in ok),
        "server_cpu_s": cpu_used,
        "server_cpu_ms_per_request": 1000 * cpu_used / max(len(ok), 1) if cpu_used is not None else None,
        "rss_start_mib": rss_start, "rss_end_mib": rss_end, "rss_series": rss,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    # other processes on a small machine skew everything: keep the evidence
                    "loadavg_1m_start": load_start[0], "loadavg_1m_end": os.getloadavg()[0]},
        "samples": [{k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(s).items()} for s in samples],
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = [s for s in result["samples"] if s["error"] is None]
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4))
    bin_s = 5  # engine steps finish requests in bursts: per-second counts are mostly noise
    bins = max(1, int(result["duration_s"] // bin_s))  # the drain after the deadline is left out
    done = [0] * bins
    for s in samples:
        if (b := int((s["start_s"] + s["latency_s"]) // bin_s)) < bins:
            done[b] += 1
    left.plot([i * bin_s for i in range(bins)], [count / bin_s for count in done], marker="o")
    left.set(xlabel="time (s)", ylabel=f"requests/s ({bin_s} s bins)", title="throughput", ylim=(0, None))
    middle.hist([s["latency_s"] for s in samples], bins=40)
    middle.set(xlabel="end-to-end latency (s)", ylabel="requests", title="latency")
    if result["rss_series"]:
        t, mib = zip(*result["rss_series"])
        right.plot(t, mib)
    right.set(xlabel="time (s)", ylabel="server RSS (MiB)", title="memory")
    fig.suptitle(f"forkpoint server load: {result['clients']} clients, 1-to-{result['n_per_anchor']}, "
                 f"{result['requests_per_s']:.1f} req/s, {result['errors']} errors")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="a running server (default: start one on loopback)")
    parser.add_argument("--server-pid", type=int, default=None, help="pid of the --url server, for RSS")
    parser.add_argument("--model", default=None, help="model directory for the started server (default: embedded)")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="extra argument for the started `forkpoint serve` (repeatable)")
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients (default: 64)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load (default: 60)")
    parser.add_argument("--n", type=int, default=8, help="requests per anchor (default: 8)")
    parser.add_argument("--anchor-words", type=int, default=200, help="words of anchor text (default: 200)")
    parser.add_argument("--suffix-words", type=int, default=12, help="words of suffix text (default: 12)")
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens generated per request (default: 4)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"), help="output directory")
    args = parser.parse_args()

    process = None
    url, pid = args.url, args.server_pid
    if url is None:
        process, url = start_server(["--log-level", "warning", "--max-waiting-requests", str(args.clients * 4),
                                             *args.server_arg], args.model, 300)
        pid = process.pid
    try:
        result = asyncio.run(run_load(args, url, pid))
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=60)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "server_load.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "server_load.png")
    print(f"{result['clients']} clients x {result['wall_s']:.0f} s, 1-to-{result['n_per_anchor']} requests "
          f"against {url}")
    print(f"requests: {result['requests']}  errors: {result['errors']}  requests/s: {result['requests_per_s']:.2f}")
    print(f"latency p50 {result['latency_p50_s']:.2f} s  p99 {result['latency_p99_s']:.2f} s | "
          f"TTFT p50 {result['ttft_p50_s']:.2f} s  p99 {result['ttft_p99_s']:.2f} s")
    print(f"prompt tokens {result['prompt_tokens']}, cached {result['cached_tokens']} "
          f"({result['cached_tokens'] / max(result['prompt_tokens'], 1):.0%})")
    if result["rss_start_mib"] is not None:
        print(f"server RSS: {result['rss_start_mib']:.0f} MiB at start, {result['rss_end_mib']:.0f} MiB at end; "
              f"server CPU {result['server_cpu_s']:.0f} s ({result['server_cpu_ms_per_request']:.0f} ms per request); "
              f"load average {result['machine']['loadavg_1m_start']:.1f} -> {result['machine']['loadavg_1m_end']:.1f}")
    for example in result["error_examples"]:
        print(f"error: {example}")
    print(f"wrote {out / 'server_load.json'} and {out / 'server_load.png'}")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
