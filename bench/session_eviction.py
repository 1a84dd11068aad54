"""Chat sessions in round robin against a checkpoint pool smaller than they need (issue 26's eviction).

S chat sessions (a shared system prompt, a per-session document), T turns each, one `LLM.chat` call per
session and turn in round robin (as S clients taking turns would), the reply sent back as text with a
tool result after it. Each turn registers a chat-turn, a prompt-end and a turn-end checkpoint, so S
sessions need 3 S rows to keep everything; with fewer, eviction decides whether each session's next turn
finds the checkpoint it starts from. Per pool size (rows, or "default": the memory budget's share) and
turn: prompt tokens, cached tokens; totals, evictions, and evictions of a live session's latest
checkpoint. JSON + PNG under --out. Run it at another commit to compare eviction policies.

Usage:
    python bench/session_eviction.py                           # CPU, embedded default model
    python bench/session_eviction.py --sessions 32 --turns 6 --pool-sizes 48,default
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from plots import stacked_bars, write_results  # noqa: E402

from forkpoint import LLM, SamplingParams  # noqa: E402

VOCAB = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma "
         "tau").split()


def run(pool: str, args: argparse.Namespace) -> dict:
    """One engine with `pool` checkpoint rows ("default": sized from the budget), every session and turn."""
    rng = random.Random(args.seed)

    def words(n: int) -> str:
        return " ".join(rng.choice(VOCAB) for _ in range(n))

    kwargs = dict(max_model_len=args.max_model_len, num_kv_blocks=args.kv_blocks)
    if pool != "default":
        kwargs["checkpoint_pool_size"] = int(pool)
    llm = LLM(args.model, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=args.reply_tokens, ignore_eos=True)
    system = "You are an agent. " + words(args.system_words)
    conversations = [[{"role": "system", "content": system},
                      {"role": "user", "content": f"Document {s}: " + words(args.doc_words)}]
                     for s in range(args.sessions)]
    turns = []
    start = time.perf_counter()
    for turn in range(args.turns):
        prompt = cached = 0
        for conversation in conversations:
            out = llm.chat(conversation, params, use_tqdm=False, enable_thinking=False)[0]
            prompt += len(out.prompt_token_ids)
            cached += out.num_cached_tokens
            conversation += [{"role": "assistant", "content": out.outputs[0].text},
                             {"role": "user", "content": "Tool result: " + words(args.tool_words)}]
        turns.append({"turn": turn, "prompt_tokens": prompt, "cached_tokens": cached})
        print(f"pool {pool:>7}  turn {turn}: prompt {prompt:6d}  cached {cached:6d} ({cached / prompt:.1%})",
              flush=True)
    llm.engine.check_integrity()
    metrics = llm.metrics()
    counters = llm.engine.registry.counters
    return {"pool": pool, "checkpoint_rows": metrics["checkpoint_slots_total"], "turns": turns,
            "prompt_tokens": metrics["prompt_tokens_total"], "computed_tokens": metrics["prompt_tokens_computed"],
            "evicted": metrics["checkpoints_evicted"],
            "evicted_session_latest": getattr(counters, "evicted_session_latest", None),
            "wall_s": time.perf_counter() - start}


def plot(res: dict, path: str) -> None:
    labels, cached, computed = [], [], []
    for result in res["results"]:
        for turn in result["turns"]:
            labels.append(f"{result['checkpoint_rows']}r t{turn['turn']}")
            cached.append(turn["cached_tokens"])
            computed.append(turn["prompt_tokens"] - turn["cached_tokens"])
    stacked_bars(path, labels, {"cached": cached, "computed": computed}, "prompt tokens",
                 f"{res['args']['sessions']} chat sessions in round robin: reuse per pool size and turn",
                 size=(max(8, len(labels) * 0.5), 4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--pool-sizes", default="16,default", help="checkpoint rows per run, comma-separated")
    parser.add_argument("--system-words", type=int, default=300)
    parser.add_argument("--doc-words", type=int, default=150)
    parser.add_argument("--tool-words", type=int, default=60)
    parser.add_argument("--reply-tokens", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--kv-blocks", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--name", default="session_eviction_cpu")
    args = parser.parse_args()
    results = [run(pool, args) for pool in args.pool_sizes.split(",")]
    print(f"{'rows':>6} {'prompt':>8} {'computed':>9} {'evicted':>8} {'latest evicted':>15} {'wall s':>7}")
    for r in results:
        print(f"{r['checkpoint_rows']:>6} {r['prompt_tokens']:>8} {r['computed_tokens']:>9} {r['evicted']:>8} "
              f"{r['evicted_session_latest']!s:>15} {r['wall_s']:>7.1f}")
    print("results:", write_results({"args": vars(args), "results": results}, args.out, args.name, plot))


if __name__ == "__main__":
    main()
