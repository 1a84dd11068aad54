"""Speculative decoding's mechanism at a chosen acceptance: TPOT with an ORACLE drafter against plain decode.

BENCHMARK ONLY: with random (dummy) weights the MTP head's drafts are meaningless, so this script replaces
them (in this process only, never in serving) with the target's own greedy continuation, with every draft
after the first `a` of each step corrupted: each verification then accepts exactly `a` drafts (acceptance
length a + 1 tokens per step), for a = 0 .. k. The continuation (--reference) is the speculative engine's
own, from a run with its MTP drafts (the default), or the plain run's. In bf16 on the GPU the two can
differ: a verify step computes a position's attention through the prefill kernel, a decode step through
the decode kernel, and random weights leave near ties, so the plain run's continuation stops matching after
the first difference and acceptance falls to 1 (session 15's rows at 16 and 64 sequences); every position
of a speculative run goes through a verify step, whatever the acceptance. The MTP head still runs
(its pass and chain: its cost is in the numbers). Per batch size N: N sequences of --prompt-len random
tokens decode --tokens greedy tokens; TPOT = decode wall time / tokens per sequence (the prefill step
excluded). With CUDA graphs, uniform verify steps (every sequence verifies k drafts, as here) replay the
whole-step verify graphs (runner/decode_graphs.py); at acceptance k + 1 the row also times the same steps
with them detached (`oracle_a{k+1}_verify_graphs_off_tpot_ms`: the piecewise graphs). Results: a printed
table and bench/results/<name>.json (and .png when matplotlib imports).

Usage:
    python bench/speculative_oracle.py                                   # tiny CPU model (tests/tiny_models.py)
    python bench/speculative_oracle.py --model DIR --load-format dummy --device cuda --seqs 1 16 64 --k 3
    python bench/speculative_oracle.py --shape qwen3.5-35b-a3b --device cuda --out $OUT    # 35B shapes, dummy
    python bench/speculative_oracle.py --shape qwen3.5-35b-a3b --tiny --seqs 1 2 --tokens 9  # its CPU dry run
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from host_info import code_version, machine_info, machine_line  # noqa: E402

from forkpoint import LLM, SamplingParams  # noqa: E402
from forkpoint.runner.speculative import FinishedStep  # noqa: E402


class OracleDrafter:
    """Shadows `runner.drafter.execute` (this process only): each request's drafts become its reference
    continuation with drafts a + 1 .. k corrupted, so every verification accepts exactly `accepted`."""

    def __init__(self, llm: LLM, continuations: dict[tuple[int, ...], list[int]], k: int, accepted: int,
                 vocab: int) -> None:
        self.engine, self.continuations, self.k = llm.engine, continuations, k
        self.accepted, self.vocab = accepted, vocab
        drafter = llm.engine.runner.drafter
        self._execute = drafter.execute
        drafter.execute = self

    def __call__(self, runner, plan) -> FinishedStep:
        result = self._execute(runner, plan).result()
        emitted = {rid: 1 for rid in result.request_ids}
        emitted.update({v.request_id: len(v.tokens) for v in result.verified})
        requests = {r.request_id: r for r in self.engine.scheduler.running}
        drafts = {}
        for request_id in result.drafts:
            request = requests[request_id]
            done = len(request.output_token_ids) + emitted.get(request_id, 0)
            reference = self.continuations[tuple(request.prompt_token_ids)][done: done + self.k]
            drafts[request_id] = tuple(t if i < self.accepted else (t + 1) % self.vocab
                                       for i, t in enumerate(reference))
        return FinishedStep(dataclasses.replace(result, drafts=drafts))


def decode_tpot(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list]:
    """Seconds per output token per sequence over the decode steps (after the prefill step), outputs."""
    engine = llm.engine
    for i, ids in enumerate(prompts):
        engine.add_request(f"b{i}", {"prompt_token_ids": ids}, params)
    engine.step()  # the prefill (and the first drafts)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / (params.max_tokens - 1), [outputs[f"b{i}"] for i in range(len(prompts))]


def model_dir_for(args: argparse.Namespace) -> tuple[str, str]:
    """(model directory, load format): --model as given; else with --shape a config.json at those shapes
    with one MTP layer (dummy weights, bench/e2e_gpu.py's config; --tiny: its tiny sizes); else a tiny
    random model with MTP weights (tests/tiny_models.py)."""
    if args.model is not None:
        return args.model, args.load_format
    root = Path(tempfile.mkdtemp())
    if args.shape is not None:
        from e2e_gpu import full_config, make_model_dir, tiny_config

        config = {**(tiny_config() if args.tiny else full_config()), "mtp_num_hidden_layers": 1}
        return str(make_model_dir(config, root / args.shape)), "dummy"
    from tests.tiny_models import add_mtp_weights, build_tiny_model

    build_tiny_model(root / "base", "qwen3_5_moe_text")
    add_mtp_weights(root / "base", root / "mtp")
    return str(root / "mtp"), args.load_format


def free(llm: LLM) -> None:
    """Drop an engine and its device memory before the next one loads (two 35B engines do not fit)."""
    del llm.engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model dir with MTP layers (default: a tiny random one)")
    parser.add_argument("--shape", default=None, choices=["qwen3.5-35b-a3b"],
                        help="instead of --model: these shapes with one MTP layer, dummy weights")
    parser.add_argument("--tiny", action="store_true", help="with --shape: its tiny sizes (a CPU dry run)")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=33)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--reference", default="speculative", choices=["speculative", "plain"],
                        help="whose greedy continuation the oracle proposes: the speculative engine's own "
                             "(a run with its MTP drafts, default) or the plain run's")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--name", default="speculative_oracle")
    args = parser.parse_args()
    model, load_format = model_dir_for(args)
    common = dict(load_format=load_format, device=args.device, enable_checkpoints=False,
                  num_state_slots=max(args.seqs) * (1 + args.k), max_num_seqs=max(args.seqs))
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    plain = LLM(model, **common)
    vocab = plain.engine.model_config.vocab_size
    batches, rows = {}, {}
    for seqs in args.seqs:  # the plain engine first, then the speculative one: one engine on the device at a time
        generator = torch.Generator().manual_seed(seqs)
        prompts = [torch.randint(5, min(vocab, 150), (args.prompt_len,), generator=generator).tolist()
                   for _ in range(seqs)]
        plain_tpot, reference = decode_tpot(plain, prompts, params)
        batches[seqs] = (prompts, reference)
        rows[seqs] = {"seqs": seqs, "plain_tpot_ms": plain_tpot * 1e3}
    free(plain)
    spec = LLM(model, speculative_config={"method": "mtp", "num_speculative_tokens": args.k}, **common)
    for seqs, (prompts, plain_outputs) in batches.items():
        row = rows[seqs]
        mtp_tpot, mtp_outputs = decode_tpot(spec, prompts, params)  # its own drafts (random weights: ~0 accepted)
        row["mtp_drafts_tpot_ms"] = mtp_tpot * 1e3
        row["speculative_equals_plain"] = ([o.outputs[0].token_ids for o in mtp_outputs]
                                           == [o.outputs[0].token_ids for o in plain_outputs])
        reference = mtp_outputs if args.reference == "speculative" else plain_outputs
        continuations = {tuple(o.prompt_token_ids): list(o.outputs[0].token_ids) for o in reference}
        for accepted in range(args.k + 1):
            oracle = OracleDrafter(spec, continuations, args.k, accepted, vocab)
            tpot, outputs = decode_tpot(spec, prompts, params)
            spec.engine.runner.drafter.execute = oracle._execute
            same = [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in reference]
            row[f"oracle_a{accepted + 1}_tpot_ms"] = tpot * 1e3
            row[f"oracle_a{accepted + 1}_same_tokens"] = same
            verify_graphs = spec.engine.runner.verify_graphs
            if accepted == args.k and verify_graphs is not None:  # the same steps without the verify graphs
                row["verify_graph_replays"] = verify_graphs.replays
                spec.engine.runner.verify_graphs = None
                oracle = OracleDrafter(spec, continuations, args.k, accepted, vocab)
                tpot, _ = decode_tpot(spec, prompts, params)
                spec.engine.runner.drafter.execute = oracle._execute
                spec.engine.runner.verify_graphs = verify_graphs
                row[f"oracle_a{accepted + 1}_verify_graphs_off_tpot_ms"] = tpot * 1e3
        print(json.dumps(row))
    rows = list(rows.values())
    machine = machine_info()
    print(f"ORACLE DRAFTER (benchmark only): {machine_line(machine)}; model {model}; k = {args.k}; the oracle "
          f"proposes the {args.reference} run's continuation")
    print(f"{'N':>4} {'plain':>9} " + " ".join(f"{'acc ' + str(a + 1):>9}" for a in range(args.k + 1)) + "   (TPOT ms)")
    for row in rows:
        print(f"{row['seqs']:>4} {row['plain_tpot_ms']:>9.2f} "
              + " ".join(f"{row[f'oracle_a{a + 1}_tpot_ms']:>9.2f}" for a in range(args.k + 1))
              + (f"   (verify graphs off at acc {args.k + 1}: "
                 f"{row[f'oracle_a{args.k + 1}_verify_graphs_off_tpot_ms']:.2f})"
                 if f"oracle_a{args.k + 1}_verify_graphs_off_tpot_ms" in row else "")
              + f"   oracle outputs equal the reference at every a: "
              f"{all(row[f'oracle_a{a + 1}_same_tokens'] for a in range(args.k + 1))}; speculative (MTP drafts) "
              f"equals plain: {row['speculative_equals_plain']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"drafter": "ORACLE (benchmark only)", "reference": args.reference, "model": model, "k": args.k,
              "tokens": args.tokens,
              "prompt_len": args.prompt_len, "machine": machine, "code": code_version(), "rows": rows}
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"wrote {out / args.name}.json (no matplotlib: no plot)")
        return
    figure, axis = plt.subplots(figsize=(6, 4))
    for row in rows:
        lengths = list(range(1, args.k + 2))
        axis.plot(lengths, [row[f"oracle_a{a}_tpot_ms"] / row["plain_tpot_ms"] for a in lengths], marker="o",
                  label=f"N = {row['seqs']}")
    axis.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
    axis.set_xlabel("acceptance length (tokens per verification), ORACLE drafter")
    axis.set_ylabel("TPOT / plain decode TPOT")
    axis.set_title(f"speculative decoding, k = {args.k} ({machine_line(machine)})", fontsize=8)
    axis.legend()
    figure.tight_layout()
    figure.savefig(out / f"{args.name}.png", dpi=120)
    print(f"wrote {out / args.name}.json and .png")


if __name__ == "__main__":
    main()
