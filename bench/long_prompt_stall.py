"""Running streams' token gaps while one long prompt prefills beside them (issue 30: "chunked prefill of one
long prompt must not stall running decodes: their token gap while a 128k prompt prefills stays within 2x of
their own step time").

`stall_row(engine, prompt_tokens, streams, budget, ...)`: `streams` greedy streams (short prompts, ignore_eos)
decode; `baseline_steps` decode-only steps are timed (their step time: each stream emits one token a step); then
one prompt of `prompt_tokens` random ids arrives and every step is timed until its first token. `budget` is the
prefill tokens a step that decodes may take (`EngineConfig.max_prefill_tokens_with_decodes`, set on the
scheduler for the row; a long prompt's chunk then shrinks with its position by the model's attention parity C,
engine/prefill_budget.py); None: no cap, CUDA's default. The row: the decode step's p50, the steps beside the
prompt (p50, max, max over the decode step: the streams' largest token gap over their own step), the prompt's
time to first token and its steps.

Usage (the embedded model on the CPU, or --model DIR [--dummy]; on the H200 `bench/e2e_gpu.py --stall-p` runs the
same rows on its engine):
    python bench/long_prompt_stall.py --prompt-tokens 4096 --budgets none 64 --streams 8
Writes bench/results/long_prompt_stall_cpu.json and .png.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from host_info import VOCAB_LIMIT, code_version, machine_info, machine_line  # noqa: E402
from plots import write_results  # noqa: E402

from forkpoint import LLM, SamplingParams  # noqa: E402


def _timed_step(engine) -> float:
    """One `engine.step()`, the device synchronised after it: seconds."""
    start = time.perf_counter()
    engine.step()
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return time.perf_counter() - start


def stall_row(engine, prompt_tokens: int, streams: int, budget: int | None, rng: np.random.Generator,
              vocab_limit: int, baseline_steps: int = 8) -> dict:
    """The row of one long prompt beside `streams` decoding streams (module docstring); the engine's own
    budget is restored and every request it added is gone afterwards. Times in ms."""
    scheduler = engine.scheduler
    own_budget = scheduler.prefill_with_decodes
    scheduler.prefill_with_decodes = budget
    ids = [f"stall-stream-{i}" for i in range(streams)]
    params = SamplingParams(temperature=0.0, max_tokens=1_000_000, ignore_eos=True)
    try:
        for request_id in ids:
            engine.add_request(request_id, {"prompt_token_ids": rng.integers(0, vocab_limit, 32).tolist()}, params,
                               stream=False)
        while not all(engine.sequences(i) and engine.sequences(i)[0].output_token_ids for i in ids):
            engine.step()
        for _ in range(2):
            engine.step()
        decode = [_timed_step(engine) for _ in range(baseline_steps)]
        engine.add_request("stall-prompt", {"prompt_token_ids": rng.integers(0, vocab_limit, prompt_tokens).tolist()},
                           SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), stream=False)
        beside, start = [], time.perf_counter()
        while engine.sequences("stall-prompt"):
            beside.append(_timed_step(engine))
        ttft = time.perf_counter() - start
    finally:
        scheduler.prefill_with_decodes = own_budget
        for request_id in [*ids, "stall-prompt"]:
            engine.abort_request(request_id)
        while engine.has_unfinished_requests():
            engine.step()
    decode_ms = 1e3 * statistics.median(decode)
    return {"prompt_tokens": prompt_tokens, "streams": streams, "budget": budget,
            "attention_parity": scheduler.attention_parity, "decode_step_ms": round(decode_ms, 2),
            "beside_steps": len(beside), "beside_p50_ms": round(1e3 * statistics.median(beside), 2),
            "beside_max_ms": round(1e3 * max(beside), 2), "max_over_decode": round(1e3 * max(beside) / decode_ms, 2),
            "prompt_ttft_s": round(ttft, 3)}


def print_row(row: dict) -> None:
    budget = row["budget"] if row["budget"] is not None else "none"
    print(f"prompt {row['prompt_tokens']:>7} tokens beside {row['streams']} streams, budget {budget:>5} "
          f"(C {row['attention_parity']}): decode step {row['decode_step_ms']:.1f} ms; {row['beside_steps']} steps "
          f"beside the prompt, p50 {row['beside_p50_ms']:.1f} ms, max {row['beside_max_ms']:.1f} ms = "
          f"{row['max_over_decode']:.2f}x the decode step; the prompt's first token after "
          f"{row['prompt_ttft_s']:.2f} s", flush=True)


def plot(result: dict, path: str) -> None:
    """The streams' largest step beside the prompt over their decode step, one bar per (prompt, budget)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"{r['prompt_tokens']} / {r['budget'] if r['budget'] is not None else 'none'}" for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.bar(labels, [r["max_over_decode"] for r in rows])
    ax.axhline(2.0, color="red", linestyle="--", label="2x the decode step (issue 30)")
    ax.set_xlabel("prompt tokens / prefill budget of a step that decodes")
    ax.set_ylabel("largest step beside the prompt / decode step")
    ax.set_title(f"{rows[0]['streams'] if rows else 0} decoding streams + one long prompt ({result['model']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_budget(text: str) -> int | None:
    return None if text == "none" else int(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    parser.add_argument("--dummy", action="store_true", help="random weights from the model's config.json")
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[4096])
    parser.add_argument("--budgets", type=parse_budget, nargs="+", default=[None, 64],
                        help="prefill tokens a step that decodes may take; 'none': no cap")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--name", default="long_prompt_stall_cpu")
    args = parser.parse_args()
    llm = LLM(args.model, seed=args.seed, **({"load_format": "dummy"} if args.dummy else {}))
    engine = llm.engine
    rng = np.random.default_rng(args.seed)
    result = {"code": code_version(), "machine": machine_info(), "model": args.model or "embedded model",
              "command": " ".join(sys.argv), "rows": []}
    print(machine_line(result["machine"]), flush=True)
    for prompt_tokens in args.prompt_tokens:
        for budget in args.budgets:
            result["rows"].append(stall_row(engine, prompt_tokens, args.streams, budget, rng, VOCAB_LIMIT))
            print_row(result["rows"][-1])
    engine.check_integrity()
    print(f"wrote {write_results(result, args.out, args.name, plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
