"""Host time per streamed chat chunk at many concurrent streams, on this machine's CPU: the event loop's
work from an engine delta `RequestOutput` to the SSE text of its chunk (serving.py `OpenAIServing._stream`:
`stream_deltas`, `ChatFormat.chunk_choice`, the chunk's JSON and `data: ...` framing), no HTTP.

--streams streams each take --tokens one-token delta outputs (the last one finished, cumulative, as the
engine sends them) and are stepped round-robin, one output each per step, as the engine thread's
deliveries reach the loop. Cases: `plain` (content only), `thinking` (a `<think>` opened by the prompt,
reasoning then content), `logprobs` (top_logprobs 5), `tools` (tool_choice auto, a call in the output),
`n4` (n = 4, usage included). A last row, `handover`: the engine thread handing each step's outputs to
the streams' queues on the event loop (worker.py `deliver_each`), as the process's CPU time per output
and the engine thread's time per step.

--baseline REV also times the code of git revision REV (extracted to a temporary folder, run as a
subprocess with the same arguments), alternating with this checkout's rep by rep, so both numbers come
from one run on one machine. --profile prints a cProfile of this checkout's `plain` case instead.

Usage:
    python bench/stream_chunk_cost.py --baseline main      # bench/results/stream_chunk_cost_cpu.*
    python bench/stream_chunk_cost.py --profile
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import hashlib
import json
import os
import pstats
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from types import SimpleNamespace

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
CASES = ("plain", "thinking", "logprobs", "tools", "n4")
WORDS = (" river", " basin", " flood", " level", " naïve", " café", " 日本語", " 🤖", " \"quoted\"", " back\\slash",
         "\n", " storm")


def case_outputs(case: str, tokens: int, rng: random.Random) -> tuple[list, dict]:
    """The delta outputs of one stream of `case` and the chat options that read them."""
    from forkpoint.outputs import CompletionOutput, Logprob, RequestOutput

    n = 4 if case == "n4" else 1
    pieces = [rng.choice(WORDS) for _ in range(tokens)]
    if case == "thinking":
        pieces[tokens // 2] = "</think>"
    if case == "tools":
        call = ["<tool_call>", '\n{"name": "get', '_weather", "arguments": ', '{"city": "Paris"}}\n', "</tool_call>"]
        pieces[tokens // 2: tokens // 2 + len(call)] = call
        pieces = pieces[:tokens]
    logprobs = case == "logprobs"
    outputs = []
    for step, piece in enumerate(pieces):
        last = step == len(pieces) - 1
        completions = []
        for i in range(n):
            token = 1000 + rng.randrange(5000)
            lps = [{token: Logprob(-0.5, 1), **{token + k: Logprob(-1.0 - k, k + 1) for k in range(1, 5)}}] \
                if logprobs else None
            if last:  # the finished output is cumulative
                completions.append(CompletionOutput(i, "".join(pieces), list(range(1000, 1000 + len(pieces))),
                                                    "stop", [lps[0]] * len(pieces) if logprobs else None))
            else:
                completions.append(CompletionOutput(i, piece, [token], None, lps))
        outputs.append(RequestOutput("r", None, [1, 2, 3], completions, finished=last))
    options = {"thinking": case == "thinking", "tools": case == "tools", "top": 5 if logprobs else None, "n": n,
               "usage": case == "n4"}
    return outputs, options


class FakeGeneration:
    """What `_stream` reads of a `Generation`: params.n, outputs(), close()."""

    def __init__(self, outputs: list, n: int) -> None:
        self.params = SimpleNamespace(n=n)
        self._outputs = outputs

    async def outputs(self):
        for output in self._outputs:
            yield 0, output

    def close(self) -> None:
        pass


def make_stream(tokenizer, outputs: list, options: dict):
    from forkpoint.server.chat_format import ChatFormat, ChatOptions
    from forkpoint.server.serving import OpenAIServing

    tools = ({"name": "get_weather", "parameters": {"type": "object"}},) if options["tools"] else ()
    chat = ChatOptions(tool_mode="auto" if tools else "none", tools=tools, thinking=options["thinking"])
    fmt = ChatFormat(tokenizer, options["top"], chat)
    header = {"id": "chatcmpl-0123456789abcdef0123456789abcdef", "created": 1764950000, "model": "forkpoint-model"}
    serving = SimpleNamespace(model_name="forkpoint-model")
    return OpenAIServing._stream(serving, FakeGeneration(outputs, options["n"]), fmt, header, 1, options["usage"])


async def drive(streams: list) -> tuple[int, str]:
    """Step every stream one chunk at a time, round-robin, until all end; (chunks, sha256 of every
    stream's bytes in turn)."""
    chunks = 0
    digest = hashlib.sha256()
    live = list(streams)
    while live:
        still = []
        for stream in live:
            try:
                event = await stream.__anext__()
            except StopAsyncIteration:
                continue
            chunks += 1
            digest.update(event.encode() if isinstance(event, str) else event)  # what starlette sends
            still.append(stream)
        live = still
    return chunks, digest.hexdigest()


def time_case(tokenizer, case: str, streams: int, tokens: int, profiler: cProfile.Profile | None = None) -> dict:
    """Seconds, chunks and the bytes' digest of `streams` streams of `case` (only the driving is timed,
    and profiled with `profiler`)."""
    rng = random.Random(0)
    built = [case_outputs(case, tokens, rng) for _ in range(streams)]
    gens = [make_stream(tokenizer, outputs, options) for outputs, options in built]
    begin = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    chunks, digest = asyncio.run(drive(gens))
    if profiler is not None:
        profiler.disable()
    return {"seconds": time.perf_counter() - begin, "chunks": chunks, "sha256": digest}


def time_handover(streams: int, steps: int, gap_s: float = 0.002) -> dict:
    """The engine thread's hand-over of a step's outputs to `streams` sinks on a running event loop
    (worker.py `deliver_each`), `steps` times `gap_s` apart (a decode step), each sink drained by a task:
    the engine thread's seconds in `deliver_each`, and the process's CPU seconds over the run (both
    threads: the loop's wake-ups and puts too; the gaps are sleeps)."""
    import threading

    from forkpoint.server import worker

    async def run() -> dict:
        loop = asyncio.get_running_loop()
        sinks = [worker.OutputSink(loop) for _ in range(streams)]
        got = [0]

        async def drain(sink) -> None:
            while True:
                await sink.queue.get()
                got[0] += 1

        tasks = [asyncio.create_task(drain(sink)) for sink in sinks]
        spent = [0.0]

        def engine() -> None:
            for _ in range(steps):
                begin = time.perf_counter()
                worker.deliver_each({sink: [None] for sink in sinks})
                spent[0] += time.perf_counter() - begin
                time.sleep(gap_s)

        cpu = time.process_time()
        thread = threading.Thread(target=engine)
        thread.start()
        while thread.is_alive() or got[0] < streams * steps:
            await asyncio.sleep(0.001)
        cpu = time.process_time() - cpu
        for task in tasks:
            task.cancel()
        return {"seconds": cpu, "engine_seconds": spent[0], "chunks": got[0], "sha256": str(got[0])}

    return asyncio.run(run())


def load_tokenizer():
    from forkpoint import LLM

    return LLM().get_tokenizer()


def child(args: argparse.Namespace) -> None:
    """One rep of every case, as JSON on stdout. Tool call ids come from a seeded generator, so that
    both versions' bytes can be compared."""
    rng = random.Random(1)
    uuid.uuid4 = lambda: uuid.UUID(int=rng.getrandbits(128), version=4)
    tokenizer = load_tokenizer()
    res = {case: time_case(tokenizer, case, args.streams, args.tokens) for case in args.cases}
    print(json.dumps({**res, "handover": time_handover(args.streams, args.tokens)}))


def run_child(root: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--streams", str(args.streams), "--tokens",
           str(args.tokens), "--cases", *args.cases]
    env = {**os.environ, "PYTHONPATH": root}
    out = subprocess.run(cmd, env=env, cwd=root, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64, help="delta outputs per stream")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--baseline", help="git revision to time beside this checkout")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    parser.add_argument("--name", default="stream_chunk_cost_cpu")
    args = parser.parse_args()
    if args.child:
        return child(args)
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if args.profile:
        tokenizer = load_tokenizer()
        profiler = cProfile.Profile()
        time_case(tokenizer, args.cases[0], args.streams, args.tokens, profiler)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        return None

    from host_info import code_version, machine_info, machine_line
    from plots import write_results

    roots = {"this": os.path.abspath(ROOT)}
    tmp = None
    if args.baseline:
        tmp = tempfile.TemporaryDirectory()
        archive = subprocess.run(["git", "archive", args.baseline, "forkpoint"], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp.name], input=archive, check=True)
        roots = {args.baseline: tmp.name, **roots}
    runs: dict[str, list[dict]] = {label: [] for label in roots}
    for _ in range(args.reps):
        for label, root in roots.items():
            runs[label].append(run_child(root, args))
    rows = {}
    for label, reps in runs.items():
        for case in [*args.cases, "handover"]:
            chunks = reps[0][case]["chunks"]
            rows[f"{label}/{case}"] = {
                "version": label, "case": case, "chunks": chunks, "sha256": reps[0][case]["sha256"],
                "us_per_chunk": 1e6 * statistics.median(r[case]["seconds"] for r in reps) / chunks}
        rows[f"{label}/handover"]["engine_us_per_step"] = 1e6 * statistics.median(
            r["handover"]["engine_seconds"] for r in reps) / args.tokens
    res = {"config": {k: v for k, v in vars(args).items() if k != "child"}, "machine": machine_info(),
           "code": code_version(), "rows": rows}
    print(machine_line(res["machine"]))
    print(f"{args.streams} streams x {args.tokens} delta outputs, median of {args.reps} reps")
    print(f"{'case':<10}" + "".join(f"{label + ' us/chunk':>22}" for label in roots) + f"{'bytes equal':>13}")
    for case in args.cases:
        cells = [rows[f"{label}/{case}"] for label in roots]
        same = len({c["sha256"] for c in cells}) == 1
        print(f"{case:<10}" + "".join(f"{c['us_per_chunk']:>22.2f}" for c in cells) + f"{str(same):>13}")
    cells = [rows[f"{label}/handover"] for label in roots]
    print(f"{'handover':<10}" + "".join(f"{c['us_per_chunk']:>22.2f}" for c in cells)
          + "   (process CPU per delivered output)")
    print(f"{'  engine':<10}" + "".join(f"{c['engine_us_per_step']:>22.0f}" for c in cells)
          + f"   (engine thread us per step of {args.streams} sinks)")

    def plot(result: dict, path: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        width = 0.8 / len(roots)
        cases = [*args.cases, "handover"]
        for k, label in enumerate(roots):
            ax.bar([i + k * width for i in range(len(cases))],
                   [result["rows"][f"{label}/{case}"]["us_per_chunk"] for case in cases], width, label=label)
        ax.set_xticks([i + width * (len(roots) - 1) / 2 for i in range(len(cases))], cases)
        ax.set_ylabel("µs per streamed chunk")
        ax.set_title(f"chat chunk host time, {args.streams} streams (CPU)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)

    print("results:", write_results(res, args.out, args.name, plot))
    if tmp is not None:
        tmp.cleanup()
    return None


if __name__ == "__main__":
    main()
