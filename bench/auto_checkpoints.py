"""Reuse without markers: an agent-style trace and a RAG-style trace, automatic checkpoints on vs off.

agent: S concurrent sessions of T turns; each turn sends the whole conversation so far (context
    grows from --agent-start to about --agent-end tokens) plus new tokens, and appends the reply.
rag:   one long document, Q questions sent one after another and then Q more together, no marker.

For each trace and mode (auto_checkpoints on / off, same engine settings otherwise) it reports the
prompt tokens computed, wall time, and TTFT per turn (agent) or per question (rag); prints a table
and writes JSON + PNG. CPU: the embedded default model. GPU: `--shape qwen35-35b` builds
Qwen3.5-35B-A3B shapes with seeded random bf16 weights (load_format="dummy").

    python bench/auto_checkpoints.py --threads 1                      # CPU, embedded default model
    python bench/auto_checkpoints.py --shape qwen35-35b --device cuda \
        --agent-start 2048 --agent-end 20480 --sessions 8 --turns 10 --doc 16384 --questions 32
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from host_info import VOCAB_LIMIT, code_version, machine_info, machine_line  # noqa: E402

from forkpoint import LLM, SamplingParams  # noqa: E402


def build(args, auto: bool) -> LLM:
    kwargs = dict(auto_checkpoints=auto, max_num_batched_tokens=args.max_num_batched_tokens, device=args.device,
                  checkpoint_pool_size=args.checkpoint_slots, max_model_len=args.max_model_len)
    if args.shape == "qwen35-35b":
        from e2e_gpu import full_config, make_model_dir  # the same shapes as the 1-to-N benchmark
        model_dir = make_model_dir(full_config(), Path(args.workdir) / "qwen35_35b")
        return LLM(str(model_dir), load_format="dummy", **kwargs)
    return LLM(args.model, num_kv_blocks=args.num_kv_blocks, **kwargs)


def timed_generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list, float, list[float]]:
    """Outputs, wall seconds, and per-prompt time to first token (from submission)."""
    engine, start = llm.engine, time.perf_counter()
    ids = [f"b{time.perf_counter_ns()}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params, stream=True)
    outputs, ttft = {}, {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.outputs[0].token_ids and output.request_id not in ttft:
                ttft[output.request_id] = time.perf_counter() - start
            if output.finished:
                outputs[output.request_id] = output
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return [outputs[i] for i in ids], time.perf_counter() - start, [ttft[i] for i in ids]


def agent_trace(llm: LLM, args, rng: np.random.Generator) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=args.reply_tokens, ignore_eos=True)
    grow = max(1, (args.agent_end - args.agent_start) // max(1, args.turns - 1))
    sessions = [rng.integers(0, VOCAB_LIMIT, args.agent_start).tolist() for _ in range(args.sessions)]
    before = llm.metrics()["prompt_tokens_computed"]
    turns = []
    for turn in range(args.turns):
        outs, wall, ttft = timed_generate(llm, sessions, params)
        turns.append({"turn": turn, "context": len(sessions[0]), "wall_s": wall, "ttft_p50_s": float(np.median(ttft)),
                      "cached_mean": float(np.mean([o.num_cached_tokens for o in outs]))})
        new_tokens = max(1, grow - args.reply_tokens)
        sessions = [s + o.outputs[0].token_ids + rng.integers(0, VOCAB_LIMIT, new_tokens).tolist()
                    for s, o in zip(sessions, outs)]
    computed = llm.metrics()["prompt_tokens_computed"] - before
    return {"turns": turns, "prompt_tokens_computed": computed, "wall_s": sum(t["wall_s"] for t in turns)}


def rag_trace(llm: LLM, args, rng: np.random.Generator) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    document = rng.integers(0, VOCAB_LIMIT, args.doc).tolist()
    questions = [document + rng.integers(0, VOCAB_LIMIT, args.question_tokens).tolist()
                 for _ in range(2 * args.questions)]
    before = llm.metrics()["prompt_tokens_computed"]
    one_by_one = [timed_generate(llm, [q], params) for q in questions[: args.questions]]
    together, wall, ttft = timed_generate(llm, questions[args.questions:], params)
    computed = llm.metrics()["prompt_tokens_computed"] - before
    return {"sequential_ttft_s": [r[2][0] for r in one_by_one], "batch_ttft_p50_s": float(np.median(ttft)),
            "batch_wall_s": wall, "prompt_tokens_computed": computed,
            "wall_s": sum(r[1] for r in one_by_one) + wall,
            "cached": [r[0][0].num_cached_tokens for r in one_by_one] + [o.num_cached_tokens for o in together]}


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, style in (("on", "-o"), ("off", "--s")):
        turns = results[mode]["agent"]["turns"]
        left.plot([t["context"] for t in turns], [t["ttft_p50_s"] * 1e3 for t in turns], style, label=f"auto {mode}")
        right.plot(np.array(results[mode]["rag"]["sequential_ttft_s"]) * 1e3, style, label=f"auto {mode}")
    left.set(xlabel="context tokens", ylabel="TTFT p50 per turn (ms)", title="agent trace")
    right.set(xlabel="question (one at a time)", ylabel="TTFT (ms)", title="RAG trace")
    for axis in (left, right):
        axis.legend()
        axis.grid(alpha=0.3)
    fig.suptitle(machine_line(results["machine"]), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF model directory (default: the embedded default model)")
    parser.add_argument("--shape", choices=["default", "qwen35-35b"], default="default")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--agent-start", type=int, default=512)
    parser.add_argument("--agent-end", type=int, default=3072)
    parser.add_argument("--reply-tokens", type=int, default=8)
    parser.add_argument("--doc", type=int, default=3072)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--question-tokens", type=int, default=24)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--checkpoint-slots", type=int, default=64)
    parser.add_argument("--workdir", default="/tmp/forkpoint-bench")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--tag", default="cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {"machine": machine_info(), "code": code_version(), "args": vars(args)}
    for mode in ("on", "off"):
        llm = build(args, auto=mode == "on")
        rng = np.random.default_rng(0)  # the same traces in both modes
        results[mode] = {"agent": agent_trace(llm, args, rng), "rag": rag_trace(llm, args, rng)}
        del llm
        gc.collect()  # the 35B engine must leave the GPU before the next one loads
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    on, off = results["on"], results["off"]
    print("| trace | auto on: tokens computed | auto off | ratio | wall on (s) | wall off (s) | speedup |")
    print("|---|---|---|---|---|---|---|")
    for trace in ("agent", "rag"):
        a, b = on[trace], off[trace]
        print(f"| {trace} | {a['prompt_tokens_computed']:,} | {b['prompt_tokens_computed']:,} | "
              f"{b['prompt_tokens_computed'] / max(1, a['prompt_tokens_computed']):.2f}x | {a['wall_s']:.2f} | "
              f"{b['wall_s']:.2f} | {b['wall_s'] / a['wall_s']:.2f}x |")
    print("\n| turn | context | TTFT p50 on (ms) | off (ms) | cached (mean, on) |")
    print("|---|---|---|---|---|")
    for t_on, t_off in zip(on["agent"]["turns"], off["agent"]["turns"]):
        print(f"| {t_on['turn']} | {t_on['context']} | {t_on['ttft_p50_s'] * 1e3:.0f} | "
              f"{t_off['ttft_p50_s'] * 1e3:.0f} | "
              f"{t_on['cached_mean']:.0f} |")
    print(f"\nRAG: one at a time, TTFT median on {np.median(on['rag']['sequential_ttft_s']) * 1e3:.0f} ms vs off "
          f"{np.median(off['rag']['sequential_ttft_s']) * 1e3:.0f} ms; {args.questions} together: TTFT p50 "
          f"{on['rag']['batch_ttft_p50_s'] * 1e3:.0f} vs {off['rag']['batch_ttft_p50_s'] * 1e3:.0f} ms")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"auto_checkpoints_{args.tag}.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, out / f"auto_checkpoints_{args.tag}.png")
    print(f"wrote {out / f'auto_checkpoints_{args.tag}.json'} and .png")


if __name__ == "__main__":
    main()
