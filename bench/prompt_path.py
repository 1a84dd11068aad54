"""The server's prompt path on the CPU: what a chat request costs from its handler to the prompt handed
to the engine thread (issue 26's "prompt" part of the time to first token), on the agent-session
workload of `bench/agent_sessions.py` (its text generators, imported), with the real Qwen3.5 tokenizer
and chat template of the embedded default model (the tests' and the H200 runs' tokenizer files).

The prompts are built by the server's own `PromptBuilder`, taken from `build_app` (its tokenizer pool of
`--tokenizer-workers` threads as configured by default, the engine's `InputProcessor`), once per path:

    plain   --token-cache-mib 0: every rendered text tokenised whole (the path before the segment cache)
    cached  the default: chat prompts tokenised turn by turn with the server's cache of turns seen
            (`forkpoint/inputs/segment_tokens.py`; the ids are the same, which this script asserts)

Each path gets fresh apps (empty caches) and goes through the turns in order, as the sessions do; the
two paths alternate turn by turn (both see the same machine load), and the ids must be equal:

    single      the requests of a turn one after another (`from_messages_async`, through the pool)
    concurrent  the S requests of a turn at once, as S sessions arriving together: per request, the
                time from submission to its built prompt (p50, p90, max), and the turn's wall time;
                speedup = single wall / concurrent wall (up to the worker count if nothing serialises
                them; 1 if they serialise on the GIL)

and per stage (one request at a time, in this thread, the builder's own functions in from_messages'
order): parse (FastAPI's body validation, before the handler: not in the "prompt" part), messages (the
marker policy over the messages), render (the chat template), tokenize, turns (inputs/turns.py: the
history and next-turn renderings, their tokenisation, the common prefixes) and process (the engine's
processor: markers, id and length checks, block hashes).

The replies are `--reply-tokens` random token ids decoded (seeded), as the dummy-weight H200 runs send
back. No `/tokenize` call precedes a request here (agent_sessions.py makes one; real clients do not).

Usage:
    python bench/prompt_path.py                                   # 32 sessions x 6 turns at issue 26's shapes
    python bench/prompt_path.py --sessions 4 --turns 2 --system-words 60 --doc-words 40 --tool-words 20
    python bench/prompt_path.py --workers 8                       # the H200 host's default pool (16 CPUs)
    python bench/prompt_path.py --profile 20                      # + cProfile of the last turn, in one thread
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import pstats
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from agent_sessions import TOOLS, build_sessions  # noqa: E402
from host_info import code_version, machine_info  # noqa: E402
from plots import stacked_bars, write_results  # noqa: E402

from forkpoint import LLM  # noqa: E402
from forkpoint.inputs.chat import chat_encoder, render_chat_with_images  # noqa: E402
from forkpoint.inputs.segment_tokens import DEFAULT_CACHE_BYTES  # noqa: E402
from forkpoint.inputs.turns import reply_continues, turn_boundaries  # noqa: E402
from forkpoint.server.app import build_app  # noqa: E402
from forkpoint.server.bench_cli import percentile  # noqa: E402
from forkpoint.server.config import ServerConfig, default_tokenizer_workers  # noqa: E402
from forkpoint.server.prompts import PromptBuilder  # noqa: E402
from forkpoint.server.protocol import ChatCompletionRequest  # noqa: E402
from forkpoint.server.request_params import template_kwargs  # noqa: E402

PATHS = {"plain": 0, "cached": DEFAULT_CACHE_BYTES}
STAGES = ("parse", "messages", "render", "tokenize", "turns", "process")


def conversations(args: argparse.Namespace, tokenizer) -> list[list[list[dict]]]:
    """[turn][session] -> the messages of that session's request at that turn (agent_sessions' shapes)."""
    sessions = build_sessions(args)
    rng = random.Random(args.seed + 1)
    special = min(tokenizer.get_added_vocab().values())
    turns = []
    for turn in range(args.turns):
        turns.append([json.loads(json.dumps(session.messages)) for session in sessions])
        for session in sessions:
            session.add_turn(turn, tokenizer.decode([rng.randrange(special) for _ in range(args.reply_tokens)]))
    return turns


def request_body(messages: list[dict], args: argparse.Namespace) -> bytes:
    """The JSON body an OpenAI client sends for one turn (as agent_sessions.py does)."""
    kwargs = {} if args.thinking == "unset" else {"enable_thinking": args.thinking == "on"}
    return json.dumps({"model": "forkpoint-default", "messages": messages, "tools": TOOLS, "stream": True,
                       "chat_template_kwargs": kwargs, "max_tokens": args.reply_tokens,
                       "stream_options": {"include_usage": True}}).encode()


def builder_for(llm: LLM, token_cache_bytes: int, workers: int) -> tuple[PromptBuilder, Any]:
    """The PromptBuilder of a fresh app on `llm` (its pool and cache), and the pool to shut down."""
    app = build_app(llm, ServerConfig(token_cache_bytes=token_cache_bytes, tokenizer_workers=workers,
                                      log_stats=False))
    return app.state.prompts, app.state.tokenizer_pool


async def build(prompts: PromptBuilder, body: ChatCompletionRequest) -> list[int]:
    """What the chat handler does before admission: the prompt, built in the tokenizer pool."""
    prompt = await prompts.from_messages_async(body.messages, add_generation_prompt=body.add_generation_prompt,
                                               template_kwargs=template_kwargs(body), cache_salt=None)
    return prompt.token_ids


async def timed(prompts: PromptBuilder, body: ChatCompletionRequest) -> tuple[float, list[int]]:
    start = time.perf_counter()
    ids = await build(prompts, body)
    return time.perf_counter() - start, ids


async def run_turn(prompts: PromptBuilder, bodies: list[ChatCompletionRequest], concurrent: bool,
                   ) -> tuple[list[float], float, list[list[int]]]:
    """(per-request seconds, the turn's wall seconds, the prompts' ids)."""
    start = time.perf_counter()
    if concurrent:
        results = await asyncio.gather(*(timed(prompts, body) for body in bodies))
    else:
        results = [await timed(prompts, body) for body in bodies]
    return [r[0] for r in results], time.perf_counter() - start, [r[1] for r in results]


def stage_times(prompts: PromptBuilder, raw: bytes) -> dict[str, float]:
    """Seconds per stage of one request, in this thread, with the builder's own functions in the order
    `PromptBuilder.from_messages` calls them (its turn boundaries and next-turn probe included)."""
    times: dict[str, float] = {}

    def lap(stage: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        value = fn()
        times[stage] = times.get(stage, 0.0) + time.perf_counter() - start
        return value

    body = lap("parse", lambda: ChatCompletionRequest.model_validate_json(raw))
    kwargs = template_kwargs(body)
    conversation = lap("messages", lambda: [prompts._message(i, m) for i, m in enumerate(body.messages)])
    text, _ = lap("render", lambda: render_chat_with_images(prompts.tokenizer, conversation,
                                                             add_generation_prompt=True, **kwargs))
    ids = lap("tokenize", lambda: prompts._encode_text(text))

    def encode_text(text: str) -> list[int]:  # the turns' renderings: their tokenisation counts as "turns"
        return prompts._encode_text(text)

    encode = chat_encoder(prompts.tokenizer, encode_text, **kwargs)
    turns = lap("turns", lambda: turn_boundaries(encode, conversation, ids))
    reusable = lap("turns", lambda: reply_continues(encode, conversation, ids))
    lap("process", lambda: prompts._process({"prompt_token_ids": ids}, "messages", turns,
                                            turn_end_reusable=reusable))
    return times


def profile(prompts: PromptBuilder, bodies: list[ChatCompletionRequest], top: int) -> tuple[str, dict[str, float]]:
    """cProfile's top `top` (cumulative) of the turn's requests built one by one in this thread (the
    pool's threads are not profiled), by `PromptBuilder.from_messages` as the pool runs it; and the
    seconds per request in all and inside the tokenizer's Rust encode (`encode_batch`, which releases the
    GIL: the rest holds it; cProfile's overhead inflates the Python part)."""
    profiler = cProfile.Profile()
    profiler.enable()
    for body in bodies:
        prompts.from_messages(body.messages, template_kwargs=template_kwargs(body))
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("cumulative").print_stats(top)
    total = sum(entry[3] for key, entry in stats.stats.items() if key[2] == "from_messages")
    encode = sum(entry[2] for key, entry in stats.stats.items() if "encode_batch" in key[2])
    return out.getvalue(), {"request_ms": 1000 * total / len(bodies), "rust_encode_ms": 1000 * encode / len(bodies)}


class PathRun:
    """One path's builders (fresh apps: single, concurrent, stages, and profile with --profile), going
    through the turns in order, and what they measured."""

    def __init__(self, llm: LLM, name: str, args: argparse.Namespace) -> None:
        self.name = name
        self.apps = {role: builder_for(llm, PATHS[name], args.workers)
                     for role in ("single", "concurrent", "stages", *(("profile",) if args.profile else ()))}
        self.turns: list[dict] = []
        self.ids: list[list[list[int]]] = []
        self.profile: str | None = None
        self.gil: list[dict] = []  # per turn, under cProfile: ms per request in all and in the GIL-free encode

    def builder(self, role: str) -> PromptBuilder:
        return self.apps[role][0]

    def turn(self, loop: asyncio.AbstractEventLoop, turn: int, raws: list[bytes], last: bool,
             args: argparse.Namespace) -> None:
        bodies = [ChatCompletionRequest.model_validate_json(raw) for raw in raws]
        single, single_wall, ids = loop.run_until_complete(run_turn(self.builder("single"), bodies, False))
        concurrent, wall, concurrent_ids = loop.run_until_complete(run_turn(self.builder("concurrent"), bodies, True))
        if concurrent_ids != ids:
            raise AssertionError(f"{self.name}: turn {turn}: concurrent prompts differ from single ones")
        self.ids.append(ids)
        stages = [stage_times(self.builder("stages"), raw) for raw in raws]
        if "profile" in self.apps:  # its builder has seen the turns before this one, as the others have
            text, split = profile(self.builder("profile"), bodies, args.profile)
            self.profile = text if last else self.profile
            self.gil.append({"turn": turn, **split})
        self.turns.append({
            "turn": turn, "prompt_tokens_mean": statistics.mean(len(x) for x in ids),
            "single_ms": summary(single), "single_wall_ms": 1000 * single_wall,
            "concurrent_ms": summary(concurrent), "concurrent_wall_ms": 1000 * wall,
            "stages_ms": {stage: 1000 * statistics.median(s.get(stage, 0.0) for s in stages) for stage in STAGES},
        })

    def close(self) -> dict:
        for _, pool in self.apps.values():
            pool.shutdown(wait=True)
        result: dict[str, Any] = {"turns": self.turns, "profile": self.profile, "gil_split": self.gil}
        segments = self.builder("concurrent").segments
        if segments is not None:
            result["cache"] = {"hits": segments.hits, "misses": segments.misses, "cached_bytes": segments.cached_bytes}
        return result


def measure(llm: LLM, turns: list[list[dict]], args: argparse.Namespace) -> dict[str, dict]:
    """Both paths, turn by turn, interleaved (a turn's plain and cached runs see the same machine load);
    asserts that the cached path's ids equal the plain path's."""
    runs = {name: PathRun(llm, name, args) for name in PATHS}
    loop = asyncio.new_event_loop()
    try:
        for turn, conversation_list in enumerate(turns):
            raws = [request_body(messages, args) for messages in conversation_list]
            for run in runs.values():
                run.turn(loop, turn, raws, turn == len(turns) - 1, args)
            if runs["cached"].ids[turn] != runs["plain"].ids[turn]:
                raise AssertionError(f"turn {turn}: the cached path's token ids differ from the plain path's")
    finally:
        loop.close()
        results = {name: run.close() for name, run in runs.items()}
    return results


def summary(values: list[float]) -> dict[str, float]:
    return {"p50": 1000 * percentile(values, 50), "p90": 1000 * percentile(values, 90),
            "max": 1000 * max(values), "mean": 1000 * statistics.mean(values)}


def table(res: dict) -> str:
    lines = [f"{'path':<7} {'turn':>4} {'tokens':>6} {'single p50':>10} {'conc p50':>9} {'conc p90':>9} "
             f"{'conc max':>9} {'conc wall':>9} {'speedup':>7}  stages p50 ms: " + " ".join(f"{s:>8}" for s in STAGES)]
    for name in PATHS:
        for row in res["paths"][name]["turns"]:
            lines.append(f"{name:<7} {row['turn']:>4} {row['prompt_tokens_mean']:>6.0f} "
                         f"{row['single_ms']['p50']:>10.1f} {row['concurrent_ms']['p50']:>9.1f} "
                         f"{row['concurrent_ms']['p90']:>9.1f} {row['concurrent_ms']['max']:>9.1f} "
                         f"{row['concurrent_wall_ms']:>9.1f} {row['single_wall_ms'] / row['concurrent_wall_ms']:>7.2f}"
                         "                " +
                         " ".join(f"{row['stages_ms'][s]:>8.2f}" for s in STAGES))
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    labels, parts = [], {stage: [] for stage in STAGES if stage != "parse"}
    for name in PATHS:
        for row in res["paths"][name]["turns"]:
            labels.append(f"{name}\nturn {row['turn']}")
            for stage in parts:
                parts[stage].append(row["stages_ms"][stage])
    stacked_bars(Path(path), labels, parts, "ms per request (one at a time)",
                 f"prompt path by stage, {res['config']['sessions']} sessions", size=(max(8, len(labels)), 4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-words", type=int, default=1400, help="shared system prompt length in words")
    parser.add_argument("--doc-words", type=int, default=800, help="per-session document length in words")
    parser.add_argument("--tool-words", type=int, default=160, help="tool result length in words")
    parser.add_argument("--reply-tokens", type=int, default=64, help="tokens per assistant reply")
    parser.add_argument("--thinking", default="off", choices=["off", "on", "unset"])
    parser.add_argument("--workers", type=int, default=default_tokenizer_workers(),
                        help=f"tokenizer threads (default: the server's, {default_tokenizer_workers()} here)")
    parser.add_argument("--profile", type=int, default=0,
                        help="print cProfile's top N of the last turn's requests built one by one")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--name", default="prompt_path_cpu")
    args = parser.parse_args()

    llm = LLM(max_model_len=16384, num_kv_blocks=1024, auto_checkpoints=True)
    turns = conversations(args, llm.get_tokenizer())
    machine = machine_info()  # the load average before the run
    paths = measure(llm, turns, args)
    res = {"config": {**{k: v for k, v in vars(args).items() if k not in ("out", "name")}},
           "machine": machine, "code": code_version(), "paths": paths}
    print(table(res))
    for name in PATHS:
        if paths[name].get("cache"):
            print(f"{name}: cache {paths[name]['cache']}")
        for row in paths[name]["gil_split"]:
            print(f"{name} turn {row['turn']}: {row['request_ms']:.1f} ms per request under cProfile, "
                  f"{row['rust_encode_ms']:.1f} ms of it in the tokenizer's GIL-free encode, "
                  f"{row['request_ms'] - row['rust_encode_ms']:.1f} ms holding the GIL")
        if paths[name]["profile"]:
            print(f"--- cProfile, {name}, last turn ---\n{paths[name]['profile']}")
    print("wrote", write_results(res, args.out, args.name, plot))


if __name__ == "__main__":
    main()
