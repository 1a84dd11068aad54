"""A chat request's prompt path by stage, turn by turn, for two versions of the code in one run (issue 26's
"prompt" part at a reused turn): what one request costs from `PromptBuilder.from_messages` to its processed
prompt, on the agent-session workload of `bench/agent_sessions.py` (its text generators, via
`bench/prompt_path.py`), with the real Qwen3.5 tokenizer and the embedded default model's chat template,
the segment token cache on (the server's default).

The "before" tree is `forkpoint/` at --before (a git ref, extracted with `git archive`), the "after" tree this
checkout's. Each round runs one child process per tree (alternating which goes first, so both see the same
machine load); a child builds fresh apps and sends every session's request of each turn, in turn order, one
at a time in its own thread, and times the stages by wrapping functions both versions have:

    render     the chat template's renderings (the prompt, its history, the next-turn probe: three before,
               `inputs/chat._render` through transformers' `apply_chat_template`; after, `render_template`,
               the prompt and its history in one pass by `render_chat_and_history`)
    segments   splitting the rendered texts into turn pieces, the cache lookups, joining the ids
               (`SegmentEncoder.encode` less the tokenizer's own calls)
    new text   the tokenizer's Rust encode of the pieces not cached yet (the turn's new reply and tool
               result; it releases the GIL)
    process    the engine's processor: markers, checks, position map, block hashes
    other      the rest of `from_messages` (message policy, turn-boundary prefixes, dataclasses)

Per turn, each child reports the median over sessions; the table shows the median over rounds, and "GIL-held"
(the total less the new text's tokenisation: what 32 requests arriving together serialise on). Both trees'
prompts must have the same token ids, turn positions and checkpoint positions (a digest per turn, asserted).

Usage:
    python bench/prompt_render.py                                   # 32 sessions x 6 turns, issue 26's shapes
    python bench/prompt_render.py --before f6a5900 --rounds 3
    python bench/prompt_render.py --sessions 4 --turns 3 --rounds 1 # quick
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
STAGES = ("render", "segments", "new text", "process", "other")
SHAPE = ("sessions", "turns", "system_words", "doc_words", "tool_words", "reply_tokens", "thinking", "seed")


def child(args: argparse.Namespace) -> None:
    """Runs in a child process: every turn's requests through a fresh `PromptBuilder` of the tree
    `args.child`; prints one JSON line of per-turn medians and digests."""
    sys.path[:0] = [args.child, BENCH]
    from prompt_path import builder_for, conversations, request_body

    from forkpoint import LLM
    from forkpoint.inputs import chat
    from forkpoint.inputs.segment_tokens import DEFAULT_CACHE_BYTES, SegmentEncoder
    from forkpoint.server import prompts as prompts_module
    from forkpoint.server.prompts import PromptBuilder
    from forkpoint.server.protocol import ChatCompletionRequest
    from forkpoint.server.request_params import template_kwargs

    assert chat.__file__.startswith(args.child), chat.__file__
    llm = LLM(max_model_len=16384, num_kv_blocks=1024, auto_checkpoints=True)
    tokenizer = llm.get_tokenizer()
    times: dict[str, float] = {}

    def timed(owner, name: str, label: str) -> None:
        fn = getattr(owner, name)

        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                times[label] = times.get(label, 0.0) + time.perf_counter() - start
        setattr(owner, name, wrapper)

    timed(PromptBuilder, "from_messages", "total")
    timed(chat, "_render", "render")
    if hasattr(prompts_module, "render_chat_and_history"):  # the prompt and its history in one pass (absent before it)
        timed(prompts_module, "render_chat_and_history", "render")
    timed(SegmentEncoder, "encode", "segments+new")
    timed(type(tokenizer), "encode", "new text")
    timed(PromptBuilder, "_process", "process")
    turns = conversations(args, tokenizer)
    prompts, pool = builder_for(llm, DEFAULT_CACHE_BYTES, 1)
    rows = []
    for conversation_list in turns:
        bodies = [ChatCompletionRequest.model_validate_json(request_body(m, args)) for m in conversation_list]
        per_request, digest, tokens = [], hashlib.sha256(), []
        for body in bodies:
            times.clear()
            prompt = prompts.from_messages(body.messages, template_kwargs=template_kwargs(body))
            stages = {"render": times["render"], "segments": times["segments+new"] - times.get("new text", 0.0),
                      "new text": times.get("new text", 0.0), "process": times["process"]}
            stages["other"] = times["total"] - sum(stages.values())
            per_request.append({**stages, "total": times["total"]})
            digest.update(json.dumps([prompt.token_ids, prompt.checkpoint_positions,
                                      prompt.processed.turn_positions]).encode())
            tokens.append(len(prompt.token_ids))
        rows.append({"tokens": statistics.mean(tokens), "digest": digest.hexdigest(),
                     **{k: 1000 * statistics.median(r[k] for r in per_request) for k in (*STAGES, "total")}})
    pool.shutdown(wait=True)
    print(json.dumps(rows))


def run_child(tree: str, args: argparse.Namespace) -> list[dict]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", tree]
    for key in SHAPE:
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=tree).stdout
    return json.loads(out.strip().splitlines()[-1])


def measure(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as before:
        archive = subprocess.run(["git", "-C", ROOT, "archive", args.before, "forkpoint"], capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", before], input=archive, check=True)
        trees = {"before": before, "after": ROOT}
        runs: dict[str, list[list[dict]]] = {name: [] for name in trees}
        for r in range(args.rounds):
            for name in (("before", "after") if r % 2 == 0 else ("after", "before")):
                runs[name].append(run_child(trees[name], args))
    for rnd in range(args.rounds):
        for turn, (a, b) in enumerate(zip(runs["before"][rnd], runs["after"][rnd])):
            if a["digest"] != b["digest"]:
                raise AssertionError(f"turn {turn}: the two trees' prompts differ (ids or positions)")
    result = {}
    for name, rounds in runs.items():
        result[name] = [{"turn": turn, "tokens": rounds[0][turn]["tokens"],
                         **{k: statistics.median(r[turn][k] for r in rounds) for k in (*STAGES, "total")},
                         "rounds_total": [r[turn]["total"] for r in rounds]}
                        for turn in range(len(rounds[0]))]
    return result


def table(res: dict) -> str:
    head = (f"{'turn':>4} {'tokens':>6} {'total before':>12} {'after':>6} {'x':>5} {'GIL-held b/a':>13}   "
            + "  ".join(f"{s + ' b/a':>13}" for s in STAGES))
    lines = [head]
    for b, a in zip(res["paths"]["before"], res["paths"]["after"]):
        held = f"{b['total'] - b['new text']:.2f}/{a['total'] - a['new text']:.2f}"
        lines.append(f"{b['turn']:>4} {b['tokens']:>6.0f} {b['total']:>12.2f} {a['total']:>6.2f} "
                     f"{b['total'] / a['total']:>5.2f} {held:>13}   " +
                     "  ".join(f"{b[s]:>6.2f}/{a[s]:<6.2f}" for s in STAGES))
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    from plots import stacked_bars

    labels, parts = [], {stage: [] for stage in STAGES}
    for b, a in zip(res["paths"]["before"], res["paths"]["after"]):
        for name, row in (("before", b), ("after", a)):
            labels.append(f"turn {row['turn']}\n{name}")
            for stage in STAGES:
                parts[stage].append(row[stage])
    after = (res["code"].get("commit") or "this tree")[:7]
    stacked_bars(Path(path), labels, parts, "ms per request (one at a time, median)",
                 f"chat prompt path by stage: {res['config']['before']} vs {after}",
                 size=(max(8, len(labels) * 0.8), 4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-words", type=int, default=1400)
    parser.add_argument("--doc-words", type=int, default=800)
    parser.add_argument("--tool-words", type=int, default=160)
    parser.add_argument("--reply-tokens", type=int, default=64)
    parser.add_argument("--thinking", default="off", choices=["off", "on", "unset"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--before", default="f6a5900", help="git ref of the code to compare with (its forkpoint/)")
    parser.add_argument("--rounds", type=int, default=3, help="child runs per tree, alternating")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=os.path.join(BENCH, "results"))
    parser.add_argument("--name", default="prompt_render_cpu")
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    sys.path.insert(0, BENCH)
    from host_info import code_version, machine_info
    from plots import write_results

    machine = machine_info()  # the load average before the run
    paths = measure(args)
    res = {"config": {k: v for k, v in vars(args).items() if k not in ("out", "name", "child")},
           "machine": machine, "code": code_version(), "paths": paths}
    print(table(res))
    print("wrote", write_results(res, args.out, args.name, plot))


if __name__ == "__main__":
    main()
