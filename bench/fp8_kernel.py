"""Block-wise FP8 GEMM and FP8 experts against bf16 (and torch's block-scaled _scaled_mm) on one GPU.

Times, with triton.testing.do_bench_cudagraph (median ms of CUDA-graph replays), at the projection shapes of
Qwen3.5-35B-A3B /
Qwen3-Next-80B-A3B (hidden 2048) and their experts (E = 256 / 512, I = 512, top-8 / top-10):
  linear: bf16 F.linear | forkpoint.kernels.fp8.triton.fp8_linear (activation quantisation included) |
          torch._scaled_mm with 1 x 128 / 128 x 128 block scales (activation quantisation included; when
          this torch build has it)
  experts: forkpoint.kernels.moe.grouped.fused_moe (bf16) | forkpoint.kernels.fp8.moe_fp8.fused_moe_fp8
Prints a table and writes <out>/<name>.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import kernel_bench  # noqa: E402

from forkpoint.kernels.fp8 import reference  # noqa: E402
from forkpoint.kernels.fp8 import triton as fp8  # noqa: E402
from forkpoint.kernels.moe import grouped  # noqa: E402

LINEARS = {"gdn_in_proj (8192+4096 x 2048)": (12288, 2048), "attn_qkv (8192+1024 x 2048)": (9216, 2048),
           "out_proj (2048 x 4096)": (2048, 4096), "shared_gate_up (1024 x 2048)": (1024, 2048)}
EXPERTS = {"35B experts (E256 I512 top8)": (256, 2048, 512, 8), "80B experts (E512 I512 top10)": (512, 2048, 512, 10)}
ROWS = (1, 16, 64, 256, 1024, 8192)


def bench(fn, rep: float) -> float:
    """Median ms of `fn` replayed in a CUDA graph (GPU time: no Python launch overhead, as the engine's
    graphs run the projections and experts)."""
    return triton.testing.do_bench_cudagraph(fn, rep=rep)


def scaled_mm(x, q, s):
    xq, xs = fp8.quantize_activations(x, 128)
    return torch._scaled_mm(xq, q.T, scale_a=xs.T.contiguous().T, scale_b=s.T, out_dtype=torch.bfloat16)


def main() -> None:
    ap = kernel_bench.parser(__doc__, "fp8_kernel_h200", rep=100.0)
    args = ap.parse_args()
    results = kernel_bench.results_header(args)
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'shape':40s} {'M':>6s} {'bf16 ms':>9s} {'fp8 triton':>11s} {'scaled_mm':>10s}")
    for label, (n, k) in LINEARS.items():
        w = torch.randn(n, k, generator=gen, device="cuda") / k**0.5
        q, s = reference.quantize_blocks(w, (128, 128))
        wb = w.bfloat16()
        for m in ROWS:
            x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
            t_bf16 = bench(lambda: torch.nn.functional.linear(x, wb), rep=args.rep)
            t_fp8 = bench(lambda: fp8.fp8_linear(x, q, s, (128, 128)), rep=args.rep)
            try:
                scaled_mm(x, q, s)
                t_mm = bench(lambda: scaled_mm(x, q, s), rep=args.rep)
            except (RuntimeError, TypeError, ValueError):
                t_mm = None
            results["rows"].append({"op": "linear", "shape": label, "m": m, "bf16_ms": t_bf16, "fp8_triton_ms": t_fp8,
                                    "scaled_mm_ms": t_mm})
            print(f"{label:40s} {m:6d} {t_bf16:9.4f} {t_fp8:11.4f} {t_mm if t_mm is None else round(t_mm, 4)!s:>10s}")
    print(f"\n{'experts':40s} {'T':>6s} {'bf16 ms':>9s} {'fp8 ms':>11s}")
    for label, (e, hidden, inter, top_k) in EXPERTS.items():
        w1 = torch.randn(e, 2 * inter, hidden, generator=gen, device="cuda") / hidden**0.5
        w2 = torch.randn(e, hidden, inter, generator=gen, device="cuda") / inter**0.5
        q1, s1 = reference.quantize_blocks(w1, (128, 128))
        q2, s2 = reference.quantize_blocks(w2, (128, 128))
        w1b, w2b = w1.bfloat16(), w2.bfloat16()
        del w1, w2
        for t in ROWS:
            x = torch.randn(t, hidden, generator=gen, device="cuda").bfloat16()
            weights, ids = torch.topk(torch.rand(t, e, generator=gen, device="cuda"), top_k, dim=-1)
            t_bf16 = bench(lambda: grouped.fused_moe(x, w1b, w2b, weights, ids), rep=args.rep)
            t_fp8 = bench(
                lambda: fp8.fused_moe_fp8(x, q1, s1, q2, s2, (128, 128), weights, ids), rep=args.rep)
            results["rows"].append({"op": "experts", "shape": label, "m": t, "bf16_ms": t_bf16, "fp8_ms": t_fp8})
            print(f"{label:40s} {t:6d} {t_bf16:9.4f} {t_fp8:11.4f}")
    out = Path(args.out) / f"{args.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
