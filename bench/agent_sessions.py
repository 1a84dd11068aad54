"""Agent sessions through the HTTP server, as an agent framework drives it (issue 26's workload).

S sessions run concurrently, T turns each, through `/v1/chat/completions` (the official openai client,
streaming): a shared system prompt, a per-session document, then per turn the assistant's reply sent
back as text (with a tool call) and a tool result. Phase A is the workload as is; phase B runs the same
shapes on the same server with a unique nonce opening every request, so nothing can be reused.

Per turn (over sessions): prompt tokens, cached tokens (`usage.prompt_tokens_details.cached_tokens`),
the tokens the turn shares with the session's previous turn (the longest common prefix of the rendered
prompts' token ids, from `/tokenize`; turn 0: with the other sessions' first prompts), TTFT p50/p90 and
the miss reasons the server gave (`cache_miss_reason`); totals per phase, and the server's
`forkpoint_cache_misses_total` by reason. JSON + PNG under --out (bench/results/).

`--restart` (started servers only): the server runs with `--checkpoint-dir` (a scratch directory);
after phase A it is stopped and started again on the same directory, and phase R sends the first
turn of new sessions (same system prompt, new documents): its cached tokens show what the restarted
server reused from disk (then phase B runs on the restarted server).

Usage:
    python bench/agent_sessions.py                                  # CPU, embedded default model, small
    python bench/agent_sessions.py --sessions 2 --turns 3 --system-words 60 --doc-words 40 --tool-words 20
    python bench/agent_sessions.py --shape qwen3.5-35b-a3b --sessions 32 --turns 6 --system-words 1400 \\
        --doc-words 800 --tool-words 160 --reply-tokens 64 --server-arg=--device=cuda   # H200, dummy weights
    python bench/agent_sessions.py --url http://127.0.0.1:8000      # a server already running
    python bench/agent_sessions.py --restart                        # + the first turn after a restart
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
from openai import AsyncOpenAI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from host_info import code_version, machine_info  # noqa: E402
from plots import write_results  # noqa: E402
from served import start_server  # noqa: E402

from forkpoint.inputs.turns import common_prefix_length  # noqa: E402
from forkpoint.server.bench_cli import percentile  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a fact up in the archive.",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
WORDS = ("river", "basin", "flood", "level", "spring", "report", "station", "gauge", "rain", "upstream", "dam",
         "valley", "north", "south", "meter", "daily", "peak", "record", "season", "storm", "bank", "city")


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


class Session:
    """One agent's conversation: messages grow by (reply + tool call, tool result) per turn."""

    def __init__(self, index: int, system: str, document: str, tool_results: list[str]) -> None:
        self.index = index
        self.messages = [{"role": "system", "content": system},
                         {"role": "user", "content": f"Document {index}: {document}\nAnswer questions about it."}]
        self.tool_results = tool_results

    def add_turn(self, turn: int, reply: str) -> None:
        call = {"id": f"call-{self.index}-{turn}", "type": "function",
                "function": {"name": "lookup", "arguments": json.dumps({"q": f"fact {turn}"})}}
        self.messages += [{"role": "assistant", "content": reply, "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": call["id"], "content": self.tool_results[turn]}]


def build_sessions(args: argparse.Namespace, documents_seed: int | None = None) -> list[Session]:
    """The sessions of `args.seed`; with `documents_seed`, the same system prompt and new documents."""
    rng = random.Random(args.seed)
    system = "You are a careful research agent. " + text(rng, args.system_words)
    if documents_seed is not None:
        rng = random.Random(documents_seed)
    return [Session(s, system, text(rng, args.doc_words), [text(rng, args.tool_words) for _ in range(args.turns)])
            for s in range(args.sessions)]


async def one_request(client: AsyncOpenAI, http: httpx.AsyncClient, model: str, messages: list[dict],
                      args: argparse.Namespace) -> dict:
    kwargs = {} if args.thinking == "unset" else {"enable_thinking": args.thinking == "on"}
    body = {"messages": messages, "tools": TOOLS, "chat_template_kwargs": kwargs}
    tokenized = (await http.post("/tokenize", json=body)).json()
    begin = time.perf_counter()
    first = None
    usage = None
    reply = []
    stream = await client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, max_tokens=args.reply_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"chat_template_kwargs": kwargs, "ignore_eos": True, "min_tokens": args.reply_tokens})
    async for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            piece = (delta.content or "") + (getattr(delta, "reasoning_content", None) or "")
            if piece and first is None:
                first = time.perf_counter()
            reply.append(delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    end = time.perf_counter()
    details = usage.prompt_tokens_details
    return {"prompt_tokens": usage.prompt_tokens, "cached_tokens": details.cached_tokens or 0,
            "miss_reason": (details.model_extra or {}).get("cache_miss_reason"), "ttft_s": (first or end) - begin,
            "latency_s": end - begin, "ids": tokenized["tokens"], "reply": "".join(reply)}


async def run_phase(url: str, model: str, args: argparse.Namespace, nonce: bool,
                    documents_seed: int | None = None) -> dict:
    """All sessions concurrently, each turn after the one before; returns per-request records."""
    sessions = build_sessions(args, documents_seed)
    records: list[dict] = []
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=3600, max_retries=0)
    async with httpx.AsyncClient(base_url=url, timeout=3600) as http:
        async def drive(session: Session) -> None:
            previous = None
            for turn in range(args.turns):
                messages = session.messages
                if nonce:  # a unique first token run: nothing of this request was ever computed
                    first = messages[0]
                    messages = [{**first, "content": f"[{uuid.uuid4().hex}] " + first["content"]}, *messages[1:]]
                record = await one_request(client, http, model, messages, args)
                record.update(session=session.index, turn=turn, previous=previous)
                records.append(record)
                previous = record["ids"]
                session.add_turn(turn, record["reply"])

        start = time.perf_counter()
        await asyncio.gather(*(drive(s) for s in sessions))
        wall = time.perf_counter() - start
    await client.close()
    first_prompts = [r["ids"] for r in records if r["turn"] == 0]
    for r in records:
        if r["previous"] is not None:
            r["shared_tokens"] = common_prefix_length(r["previous"], r["ids"])
        else:
            r["shared_tokens"] = max((common_prefix_length(r["ids"], other) for other in first_prompts
                                      if other is not r["ids"]), default=0)
    return {"wall_s": wall, "requests": [{k: v for k, v in r.items() if k not in ("ids", "previous", "reply")}
                                         for r in records]}


def summarise(phase: dict, turns: int) -> dict:
    rows = []
    for turn in range(turns):
        rs = [r for r in phase["requests"] if r["turn"] == turn]
        shared = sum(r["shared_tokens"] for r in rs)
        reasons: dict[str, int] = {}
        for r in rs:
            key = r["miss_reason"] or "none"
            reasons[key] = reasons.get(key, 0) + 1
        rows.append({"turn": turn, "prompt_tokens": sum(r["prompt_tokens"] for r in rs) / len(rs),
                     "cached_tokens": sum(r["cached_tokens"] for r in rs) / len(rs),
                     "shared_tokens": sum(r["shared_tokens"] for r in rs) / len(rs),
                     "cached_of_shared": sum(r["cached_tokens"] for r in rs) / max(shared, 1),
                     "ttft_p50_ms": 1000 * percentile([r["ttft_s"] for r in rs], 50),
                     "ttft_p90_ms": 1000 * percentile([r["ttft_s"] for r in rs], 90), "miss_reasons": reasons})
    requests = phase["requests"]
    prompt = sum(r["prompt_tokens"] for r in requests)
    cached = sum(r["cached_tokens"] for r in requests)
    return {"turns": rows, "wall_s": phase["wall_s"], "prompt_tokens": prompt, "cached_tokens": cached,
            "computed_tokens": prompt - cached, "shared_tokens": sum(r["shared_tokens"] for r in requests)}


def scrape_misses(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        if family.name == "forkpoint_cache_misses":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    values[sample.labels["reason"]] = sample.value
    return values


def server_options(args: argparse.Namespace) -> list[str]:
    return ["--log-level", args.server_log_level, "--max-waiting-requests", str(max(args.sessions * 4, 64)),
            *args.server_arg]


def stop_server(process: subprocess.Popen) -> None:
    """SIGTERM: the server shuts down gracefully (the disk tier's writer drains at exit)."""
    process.terminate()
    process.wait(timeout=120)


def model_dir_for(args: argparse.Namespace, scratch: Path) -> str | None:
    """--model, or for --shape a config directory served with dummy weights, or None (the embedded model)."""
    if args.shape == "default":
        return args.model
    from e2e_gpu import full_config, make_model_dir, tiny_config

    cfg = full_config() if args.shape == "qwen3.5-35b-a3b" else tiny_config()
    args.server_arg = ["--load-format", "dummy", *args.server_arg]
    return str(make_model_dir(cfg, scratch / args.shape))


def table(name: str, summary: dict) -> str:
    lines = [f"{name}: {summary['wall_s']:.1f} s, prompt {summary['prompt_tokens']:,} tokens, cached "
             f"{summary['cached_tokens']:,}, computed {summary['computed_tokens']:,}",
             f"{'turn':>4} {'prompt':>8} {'shared':>8} {'cached':>8} {'cached/shared':>13} {'TTFT p50':>9} "
             f"{'TTFT p90':>9}  miss reasons"]
    for row in summary["turns"]:
        lines.append(f"{row['turn']:>4} {row['prompt_tokens']:>8.0f} {row['shared_tokens']:>8.0f} "
                     f"{row['cached_tokens']:>8.0f} {100 * row['cached_of_shared']:>12.1f}% "
                     f"{row['ttft_p50_ms']:>7.0f}ms {row['ttft_p90_ms']:>7.0f}ms  "
                     + ", ".join(f"{k} {v}" for k, v in sorted(row["miss_reasons"].items())))
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reuse, none = res["reuse"]["turns"], res["no_reuse"]["turns"]
    turns = [r["turn"] for r in reuse]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(turns, [r["ttft_p50_ms"] for r in reuse], "o-", label="reuse, p50")
    left.plot(turns, [r["ttft_p90_ms"] for r in reuse], "o--", label="reuse, p90")
    left.plot(turns, [r["ttft_p50_ms"] for r in none], "s-", label="no reuse (nonce), p50")
    left.set_xlabel("turn")
    left.set_ylabel("TTFT (ms)")
    left.legend()
    width = 0.4
    right.bar([t - width / 2 for t in turns], [r["shared_tokens"] for r in reuse], width, label="shared with previous")
    right.bar([t + width / 2 for t in turns], [r["cached_tokens"] for r in reuse], width, label="cached")
    right.plot(turns, [r["prompt_tokens"] for r in reuse], "k.-", label="prompt")
    right.set_xlabel("turn")
    right.set_ylabel("tokens per request (mean)")
    right.legend()
    fig.suptitle(f"agent sessions: {res['config']['sessions']} sessions x {res['config']['turns']} turns, "
                 f"{res['config']['shape']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a running server (default: start one)")
    parser.add_argument("--model", default=None, help="model directory for the started server (default: embedded)")
    parser.add_argument("--shape", default="default", choices=["default", "qwen3.5-35b-a3b", "qwen3.5-tiny"],
                        help="serve a config of these shapes with --load-format dummy (default: --model)")
    parser.add_argument("--server-arg", action="append", default=[], help="one more argument for `forkpoint serve`")
    parser.add_argument("--server-log-level", default="warning")
    parser.add_argument("--start-timeout", type=float, default=900)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=300, help="shared system prompt length in words")
    parser.add_argument("--doc-words", type=int, default=150, help="per-session document length in words")
    parser.add_argument("--tool-words", type=int, default=60, help="tool result length in words")
    parser.add_argument("--reply-tokens", type=int, default=16, help="tokens per assistant reply")
    parser.add_argument("--thinking", default="off", choices=["off", "on", "unset"],
                        help="chat_template_kwargs enable_thinking (default: off)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--name", default="agent_sessions", help="file name of the JSON and PNG (no suffix)")
    parser.add_argument("--restart", action="store_true",
                        help="serve with --checkpoint-dir, restart the server after phase A and send the first turn "
                             "of new sessions (same system prompt, new documents) before phase B")
    args = parser.parse_args(argv)
    if args.restart and args.url is not None:
        parser.error("--restart starts and restarts the server itself: leave out --url")

    process = None
    restart = None
    with tempfile.TemporaryDirectory() as scratch:
        url = args.url
        model_dir = model_dir_for(args, Path(scratch)) if url is None else None
        if args.restart:
            args.server_arg = [*args.server_arg, "--checkpoint-dir", str(Path(scratch) / "checkpoints")]
        if url is None:
            process, url = start_server(server_options(args), model_dir, args.start_timeout)
        try:
            model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
            before = scrape_misses(url)
            reuse = summarise(asyncio.run(run_phase(url, model, args, nonce=False)), args.turns)
            after = scrape_misses(url)
            if args.restart:
                stop_server(process)
                process, url = start_server(server_options(args), model_dir, args.start_timeout)
                first_turn = argparse.Namespace(**{**vars(args), "turns": 1})
                restart = summarise(asyncio.run(run_phase(url, model, first_turn, nonce=False,
                                                          documents_seed=args.seed + 1)), 1)
            none = summarise(asyncio.run(run_phase(url, model, args, nonce=True)), args.turns)
        finally:
            if process is not None:
                stop_server(process)
    res = {"config": {k: v for k, v in vars(args).items() if k not in ("out", "url")}, "reuse": reuse,
           "no_reuse": none, "server_misses_reuse_phase": {k: after[k] - before.get(k, 0) for k in after},
           "machine": machine_info(), "code": code_version()}
    if restart is not None:
        res["restart"] = restart
        print(table("after a restart on the same --checkpoint-dir (first turn, new documents)", restart))
    print(table("reuse", reuse))
    print(table("no reuse (a nonce opens every request)", none))
    print(f"computed prompt tokens: reuse {reuse['computed_tokens']:,} vs {none['computed_tokens']:,} "
          f"({none['computed_tokens'] / max(reuse['computed_tokens'], 1):.2f}x fewer); wall {reuse['wall_s']:.1f} s vs "
          f"{none['wall_s']:.1f} s; server miss reasons (reuse phase): {res['server_misses_reuse_phase']}")
    print("results:", write_results(res, args.out, args.name, plot))
    return res


if __name__ == "__main__":
    main()
