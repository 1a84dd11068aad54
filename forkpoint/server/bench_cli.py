"""`forkpoint bench`: the 1-to-N workload, checkpoints on vs off, offline or against a server.

A group is one anchor of P tokens and N requests ``anchor + suffix_i`` (S tokens each), all sent
at once. With checkpoints on, each request carries ``checkpoint_positions=[P]`` (the structured
form of a marker after the anchor), so one request produces the anchor's checkpoint and the others
reuse it. Off sends the same shapes without the checkpoint and with fresh anchors, so nothing can
be reused: the engine computes N(P+S) prompt tokens instead of P+NS, an ideal speedup of
N(P+S)/(P+NS).

Offline (default) drives `LLM.engine` directly; ``--url`` sends the requests to a running
server through the openai client (streaming, to time the first token).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import platform
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from forkpoint.server.engine_args import engine_kwargs

SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "ze", "po", "qua", "dre", "fin", "gor", "hul", "jex")


@dataclass(frozen=True)
class BenchRequest:
    token_ids: list[int]
    checkpoint_positions: list[int]


@dataclass(frozen=True)
class RequestResult:
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class RunSummary:
    n: int
    checkpoints: bool
    requests: int
    wall_s: float
    requests_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    prompt_tokens: int
    tokens_computed: int
    tokens_reused: int
    cpu_s: float | None  # CPU time of the engine's process (offline only): robust to a busy machine


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--url", default=None,
                       help="base URL of a running forkpoint server, e.g. http://127.0.0.1:8000 (default: run offline)")
    group.add_argument("--api-key", default="EMPTY", help="API key sent to the server (default: EMPTY)")
    group.add_argument("--anchor-tokens", type=int, default=512, help="P, shared anchor length (default: 512)")
    group.add_argument("--suffix-tokens", type=int, default=32, help="S, per-request suffix length (default: 32)")
    group.add_argument("--n", default="1,4,16", help="comma-separated group sizes N (default: 1,4,16)")
    group.add_argument("--groups", type=int, default=2,
                       help="groups per (N, mode), each with its own anchor (default: 2)")
    group.add_argument("--max-tokens", type=int, default=1, help="tokens generated per request (default: 1)")
    group.add_argument("--concurrency", type=int, default=64, help="most requests in flight (default: 64)")
    group.add_argument("--workload-seed", type=int, default=0,
                       help="seed of the random anchors and suffixes (default: 0)")
    group.add_argument("--out", default="bench/results", help="output directory (default: bench/results)")
    group.add_argument("--name", default="bench_1toN", help="file stem of the JSON and PNG written to --out "
                                                              "(default: bench_1toN)")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def ideal_speedup(n: int, p: int, s: int) -> float:
    return n * (p + s) / (p + n * s)


def make_groups(tokenize: Callable[[str], list[int]], *, n: int, groups: int, anchor_tokens: int,
                suffix_tokens: int, checkpoints: bool, rng: random.Random) -> list[list[BenchRequest]]:
    """`groups` lists of N requests; every anchor and suffix is fresh random text, tokenised and cut
    to exactly P and S tokens."""

    def tokens(count: int) -> list[int]:
        words = " ".join("".join(rng.choices(SYLLABLES, k=rng.randint(1, 3))) for _ in range(count))
        ids = tokenize(words)
        if len(ids) < count:
            raise ValueError(f"could not build {count} tokens of random text")
        return ids[:count]

    result = []
    for _ in range(groups):
        anchor = tokens(anchor_tokens)
        positions = [anchor_tokens] if checkpoints else []
        result.append([BenchRequest(anchor + tokens(suffix_tokens), positions) for _ in range(n)])
    return result


def summarize(n: int, checkpoints: bool, results: list[RequestResult], wall_s: float,
              cpu_s: float | None) -> RunSummary:
    ttfts = [r.ttft_s for r in results]
    prompt = sum(r.prompt_tokens for r in results)
    reused = sum(r.cached_tokens for r in results)
    return RunSummary(n, checkpoints, len(results), wall_s, len(results) / wall_s, percentile(ttfts, 50),
                      percentile(ttfts, 99), prompt, prompt - reused, reused, cpu_s)


class OfflineTarget:
    """Runs the requests through `LLM.engine` in this process (at most `concurrency` in flight)."""

    def __init__(self, engine_kwargs: dict[str, Any], max_tokens: int, concurrency: int) -> None:
        from forkpoint import LLM, SamplingParams

        self.llm = LLM(**engine_kwargs)
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.concurrency = concurrency
        self.description = f"offline, {engine_kwargs['model'] or 'embedded default model'}"
        self._ids = itertools.count()

    def tokenize(self, text: str) -> list[int]:
        return self.llm.get_tokenizer().encode(text, add_special_tokens=False)

    @staticmethod
    def cpu_time() -> float:
        """CPU seconds of this process, all threads: the engine runs here."""
        return time.process_time()

    def execute(self, requests: list[BenchRequest], progress: tqdm) -> list[RequestResult]:
        engine = self.llm.engine
        queue = list(reversed(requests))
        started: dict[str, tuple[float, float | None]] = {}  # request id -> (start, first token)
        results: list[RequestResult] = []
        while queue or started:
            while queue and len(started) < self.concurrency:
                request = queue.pop()
                request_id = f"bench-{next(self._ids)}"
                engine.add_request(request_id, {"prompt_token_ids": request.token_ids,
                                                "checkpoint_positions": request.checkpoint_positions}, self.params)
                started[request_id] = (time.perf_counter(), None)
            for output in engine.step():
                begin, first = started[output.request_id]
                now = time.perf_counter()
                if first is None and output.outputs[0].token_ids:
                    first = now
                    started[output.request_id] = (begin, first)
                if output.finished:
                    del started[output.request_id]
                    results.append(RequestResult(first - begin, now - begin, len(output.prompt_token_ids),
                                                 output.num_cached_tokens))
                    progress.update(1)
        return results


class ServerTarget:
    """Sends the requests to a running server as streaming completions through the openai client."""

    def __init__(self, url: str, api_key: str, max_tokens: int, concurrency: int) -> None:
        import httpx  # the openai client's HTTP library: needed only against a server

        self.base = url.rstrip("/")
        self.api_key = api_key
        self.max_tokens = max_tokens
        self.concurrency = concurrency
        self._http = httpx.Client(base_url=self.base, timeout=60)
        self.model = self._http.get("/v1/models").json()["data"][0]["id"]
        self.description = f"server {self.base}, model {self.model}"

    def tokenize(self, text: str) -> list[int]:
        """The server's own tokenisation (POST /tokenize), so the token counts are exact."""
        return self._http.post("/tokenize", json={"prompt": text}).json()["tokens"]

    @staticmethod
    def cpu_time() -> None:
        """The server's CPU time is not visible from here."""
        return None

    def execute(self, requests: list[BenchRequest], progress: tqdm) -> list[RequestResult]:
        return asyncio.run(self._execute(requests, progress))

    async def _execute(self, requests: list[BenchRequest], progress: tqdm) -> list[RequestResult]:
        from openai import AsyncOpenAI

        limit = asyncio.Semaphore(self.concurrency)
        async with AsyncOpenAI(base_url=f"{self.base}/v1", api_key=self.api_key, max_retries=0,
                               timeout=600) as client:

            async def one(request: BenchRequest) -> RequestResult:
                async with limit:
                    begin = time.perf_counter()
                    first = usage = None
                    stream = await client.completions.create(
                        model=self.model, prompt=request.token_ids, max_tokens=self.max_tokens, temperature=0.0,
                        stream=True, stream_options={"include_usage": True},
                        extra_body={"checkpoint_positions": request.checkpoint_positions, "ignore_eos": True})
                    async for chunk in stream:
                        if first is None and chunk.choices:
                            first = time.perf_counter()
                        if chunk.usage is not None:
                            usage = chunk.usage
                    end = time.perf_counter()
                    progress.update(1)
                    details = usage.prompt_tokens_details
                    return RequestResult((first or end) - begin, end - begin, usage.prompt_tokens,
                                         (details.cached_tokens or 0) if details else 0)

            return list(await asyncio.gather(*(one(r) for r in requests)))


def print_table(summaries: list[RunSummary], p: int, s: int) -> None:
    off = {r.n: r for r in summaries if not r.checkpoints}
    header = (f"{'N':>4} {'ckpt':>5} {'req/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'computed':>9} {'reused':>8} "
              f"{'speedup':>8} {'CPU s':>7} {'CPU speedup':>11} {'ideal':>6}")
    print(header)
    print("-" * len(header))
    for r in summaries:
        base = off.get(r.n) if r.checkpoints else None
        speedup = f"{r.requests_per_s / base.requests_per_s:.2f}x" if base else "-"
        cpu = f"{r.cpu_s:.1f}" if r.cpu_s is not None else "-"
        cpu_speedup = f"{base.cpu_s / r.cpu_s:.2f}x" if base and r.cpu_s and base.cpu_s else "-"
        ideal = f"{ideal_speedup(r.n, p, s):.2f}x" if r.checkpoints else "-"
        print(f"{r.n:>4} {'on' if r.checkpoints else 'off':>5} {r.requests_per_s:>8.2f} {r.ttft_p50_s:>8.3f}s "
              f"{r.ttft_p99_s:>8.3f}s {r.tokens_computed:>9} {r.tokens_reused:>8} {speedup:>8} {cpu:>7} "
              f"{cpu_speedup:>11} {ideal:>6}")


def plot(summaries: list[RunSummary], p: int, s: int, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = sorted({r.n for r in summaries})
    rate = {(r.n, r.checkpoints): r.requests_per_s for r in summaries}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for on, label in ((False, "checkpoints off"), (True, "checkpoints on")):
        left.plot(ns, [rate[(n, on)] for n in ns], marker="o", label=label)
    left.set(xscale="log", xlabel="N (requests per anchor)", ylabel="requests/s", title="throughput")
    left.legend()
    right.plot(ns, [rate[(n, True)] / rate[(n, False)] for n in ns], marker="o", label="measured")
    right.plot(ns, [ideal_speedup(n, p, s) for n in ns], linestyle="--", label="ideal N(P+S)/(P+NS)")
    right.set(xscale="log", xlabel="N (requests per anchor)", ylabel="speedup on/off", title="speedup")
    right.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_bench(args: argparse.Namespace) -> int:
    ns = [int(x) for x in args.n.split(",") if x.strip()]
    if not ns or min(ns) < 1 or args.anchor_tokens < 1 or args.suffix_tokens < 1 or args.groups < 1:
        raise ValueError("--n values, --anchor-tokens, --suffix-tokens and --groups must be >= 1")
    rng = random.Random(args.workload_seed)
    p, s = args.anchor_tokens, args.suffix_tokens
    if args.url:
        target = ServerTarget(args.url, args.api_key, args.max_tokens, args.concurrency)
    else:
        target = OfflineTarget(engine_kwargs(args), args.max_tokens, args.concurrency)
    plans = [(n, on, make_groups(target.tokenize, n=n, groups=args.groups, anchor_tokens=p, suffix_tokens=s,
                                 checkpoints=on, rng=rng)) for n in ns for on in (False, True)]
    # untimed: one group of each mode, so first-call allocations land in no row
    warmup = [r for on in (False, True) for group in make_groups(
        target.tokenize, n=2, groups=1, anchor_tokens=p, suffix_tokens=s, checkpoints=on, rng=rng) for r in group]
    summaries = []
    total = sum(len(g) for _, _, groups in plans for g in groups)
    with tqdm(total=total, desc="bench", unit="req") as progress:
        target.execute(warmup, tqdm(disable=True))
        for n, on, groups in plans:
            requests = [r for group in groups for r in group]
            begin, cpu = time.perf_counter(), target.cpu_time()
            results = target.execute(requests, progress)
            cpu_end = target.cpu_time()
            summaries.append(summarize(n, on, results, time.perf_counter() - begin,
                                       None if cpu is None else cpu_end - cpu))
    print(f"\n1-to-N benchmark: {target.description}; P={p} anchor tokens, S={s} suffix tokens, "
          f"{args.groups} group(s) per row, max_tokens={args.max_tokens}, concurrency={args.concurrency}")
    print_table(summaries, p, s)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"target": target.description, "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                             "loadavg_1m_end": os.getloadavg()[0]},
              "anchor_tokens": p, "suffix_tokens": s, "groups": args.groups, "max_tokens": args.max_tokens,
              "concurrency": args.concurrency, "results": [
                  {**asdict(r), "ideal_speedup": ideal_speedup(r.n, p, s)} for r in summaries]}
    (out / f"{args.name}.json").write_text(json.dumps(record, indent=2))
    plot(summaries, p, s, out / f"{args.name}.png", f"1-to-N, P={p}, S={s} ({target.description})")
    print(f"wrote {out / args.name}.json and {out / args.name}.png")
    return 0
