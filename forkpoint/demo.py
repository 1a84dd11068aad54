"""The demo behind `scripts/demo.sh`: a few completions, then one shared prefix with N questions,
run with checkpoints and on a second engine without them, side by side (prompt tokens computed,
time, and whether the answers agree), then the same questions answered with a forced choice.

    python -m forkpoint.demo [--model HF_DIR] [--device cpu|cuda] [--max-tokens 16] [--questions 8]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from forkpoint import LLM, SamplingParams, StructuredOutputsParams

# why a checkpoint exists (cache/checkpoint_types.py CheckpointKind values), as the table says it
REASONS = {"marker": "the marker", "shared_prefix": "shared prefix", "junction": "junction with an earlier prompt",
           "prompt_end": "the same prompt again", "turn_end": "the end of an earlier turn"}

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
    ledger = [_Step("completions (3 prompts)", llm)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    ledger[-1].done(llm)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"\n{len(prompts)} completions, {generated} tokens in {elapsed:.2f} s ({generated / elapsed:.1f} tok/s)")
    for output in outputs:
        print(f"  {output.prompt!r} -> {output.outputs[0].text!r}")

    marker = "<|mamba_checkpoint|>"
    candidates = (CANDIDATES * (args.questions // len(CANDIDATES) + 1))[: args.questions]
    questions = [f"{ANCHOR}{marker}\nCandidate: {c}\nSame product? Answer:" for c in candidates]
    score = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    ledger.append(_Step(f"1 anchor x {len(questions)} candidates", llm))
    with_ckpt = _one_to_n(llm, questions, score)
    ledger[-1].done(llm)

    start = time.perf_counter()
    plain = LLM(args.model, device=args.device, enable_checkpoints=False)
    plain.generate(prompts, params, use_tqdm=False)  # warm up as the first engine was
    print(f"\nloaded a second engine without checkpoints in {time.perf_counter() - start:.1f} s")
    # the very token ids the first engine saw (markers removed), so both compute the same prompts
    without = _one_to_n(plain, [{"prompt_token_ids": o.prompt_token_ids} for o in with_ckpt.outputs], score)

    print(f"\n1 anchor x {len(questions)} candidates, max_tokens 1:")
    print(f"  {'':22s} {'prompt tokens':>13s} {'computed':>9s} {'reused':>7s} {'time':>8s}")
    for name, run in (("with checkpoints", with_ckpt), ("without checkpoints", without)):
        print(f"  {name:22s} {run.total:13d} {run.computed:9d} {run.total - run.computed:7d} {run.seconds:7.2f}s")
    same = [a.outputs[0].token_ids for a in with_ckpt.outputs] == [b.outputs[0].token_ids for b in without.outputs]
    print(f"  computed {without.computed / max(with_ckpt.computed, 1):.1f}x fewer prompt tokens, "
          f"{without.seconds / max(with_ckpt.seconds, 1e-9):.1f}x faster; same answers: {'yes' if same else 'NO'}")
    for output in with_ckpt.outputs:
        print(f"  cached {output.num_cached_tokens:4d}  -> {output.outputs[0].text!r}")

    choice = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=StructuredOutputsParams(
        choice=[" yes", " no"]))
    ledger.append(_Step("same questions, forced choice", llm))
    answers = [o.outputs[0].text for o in llm.generate(questions, choice, use_tqdm=False)]
    ledger[-1].done(llm)
    print(f"\nthe same questions with structured_outputs choice [' yes', ' no']: {answers}")
    print("\nwhat the engine with checkpoints computed and reused (prompt tokens), and why:")
    for line in _ledger_table(ledger):
        print("  " + line)


class _Step:
    """One part of the demo on one engine: its metrics before and after."""

    def __init__(self, name: str, llm: LLM) -> None:
        self.name, self.before, self.after = name, llm.metrics(), None

    def done(self, llm: LLM) -> None:
        self.after = llm.metrics()

    def delta(self, key: str) -> int:
        return int(self.after.get(key, 0) - self.before.get(key, 0))

    def why(self) -> str:
        """The checkpoints that supplied the reused tokens, by reason, and those this step created."""
        used = [f"{REASONS[kind]} x{self.delta(f'checkpoint_hits_{kind}')}" for kind in REASONS
                if self.delta(f"checkpoint_hits_{kind}")]
        made = sum(self.delta(f"checkpoints_created_{kind}") for kind in REASONS)
        parts = [f"reused from: {', '.join(used)}"] if used else ["nothing reusable yet"]
        return "; ".join(parts + ([f"new checkpoints: {made}"] if made else []))


def _ledger_table(steps: list[_Step]) -> list[str]:
    """A small table: per step, prompt tokens, computed, reused, and why."""
    rows = [(s.name, s.delta("prompt_tokens_total"), s.delta("prompt_tokens_computed"), s.why()) for s in steps]
    width = max(len(name) for name, *_ in rows)
    lines = [f"{'':{width}s} {'prompt':>7s} {'computed':>8s} {'reused':>7s}  why"]
    lines += [f"{name:{width}s} {total:7d} {computed:8d} {total - computed:7d}  {why}"
              for name, total, computed, why in rows]
    return lines


@dataclass
class _Run:
    outputs: list
    total: int
    computed: int
    seconds: float


def _one_to_n(llm: LLM, prompts: list[str], params: SamplingParams) -> _Run:
    before = llm.metrics()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = llm.metrics()
    return _Run(outputs, after["prompt_tokens_total"] - before["prompt_tokens_total"],
                after["prompt_tokens_computed"] - before["prompt_tokens_computed"], seconds)

if __name__ == "__main__":
    main()
