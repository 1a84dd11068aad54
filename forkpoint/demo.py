"""The demo behind `scripts/demo.sh`: a few completions, then one shared prefix with N questions.

    python -m forkpoint.demo [--model HF_DIR] [--device cpu|cuda] [--max-tokens 16] [--questions 8]
"""

from __future__ import annotations

import argparse
import time

from forkpoint import LLM, SamplingParams

ANCHOR = (
    "Product listing: Stainless steel kettle, 1.7 litres, 2200 W, auto shut-off, boil-dry protection, "
    "cordless 360 degree base, limescale filter, blue LED ring, BPA-free, two year warranty. "
)
CANDIDATES = [
    "Steel kettle 1.7 l, 2200 watts, cordless base, blue light.",
    "Glass teapot with infuser, 1.2 litres.",
    "Cordless electric kettle, stainless, 1.7 litre, 2.2 kW, limescale filter.",
    "Coffee grinder, 150 W, stainless blades.",
    "Travel kettle 0.5 l, dual voltage.",
    "Kettle, 1.7 L, blue LED, boil-dry protection, 2 yr warranty.",
    "Toaster, 2 slots, 800 W.",
    "Stainless kettle, 1.5 litres, 1800 W.",
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="forkpoint demo: completions and a 1-to-N checkpoint")
    parser.add_argument("--model", default=None, help="Hugging Face model dir (default: the embedded model)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--questions", type=int, default=len(CANDIDATES))
    args = parser.parse_args(argv)

    start = time.perf_counter()
    llm = LLM(args.model, device=args.device)
    print(f"loaded {llm.engine.model_path} on {llm.engine.device} in {time.perf_counter() - start:.1f} s")

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"\n{len(prompts)} completions, {generated} tokens in {elapsed:.2f} s ({generated / elapsed:.1f} tok/s)")
    for output in outputs:
        print(f"  {output.prompt!r} -> {output.outputs[0].text!r}")

    marker = "<|mamba_checkpoint|>"
    candidates = (CANDIDATES * (args.questions // len(CANDIDATES) + 1))[: args.questions]
    questions = [f"{ANCHOR}{marker}\nCandidate: {c}\nSame product? Answer:" for c in candidates]
    score = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    before = llm.metrics()
    start = time.perf_counter()
    outputs = llm.generate(questions, score, use_tqdm=False)
    elapsed = time.perf_counter() - start
    after = llm.metrics()
    computed = after["prompt_tokens_computed"] - before["prompt_tokens_computed"]
    total = after["prompt_tokens_total"] - before["prompt_tokens_total"]
    print(f"\n1 anchor x {len(questions)} candidates in {elapsed:.2f} s: computed {computed} of {total} prompt "
          f"tokens; checkpoint at token {outputs[0].checkpoint_positions}")
    for output in outputs:
        print(f"  cached {output.num_cached_tokens:4d}  -> {output.outputs[0].text!r}")
    print("\nmetrics:", {k: v for k, v in after.items() if "checkpoint" in k or k.startswith("requests_")})


if __name__ == "__main__":
    main()
