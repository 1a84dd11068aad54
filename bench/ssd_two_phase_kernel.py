"""Kernel benchmark: batched two-phase prefill of one Mamba2 layer's recurrent core op.

The op timed is what a Mamba2 mixer runs between in_proj and its gated norm: the short causal conv
(width 4, SiLU, with bias, over the packed x|B|C channels, with conv states) followed by the chunked
SSD scan (fp32 state [H, P, N]) through forkpoint's GPU kernels (`forkpoint.kernels.conv1d.triton`,
`forkpoint.kernels.ssd.fla`, i.e. fla-core's chunk_simple_gla). Layer sizes of
NVIDIA-Nemotron-3-Nano-30B-A3B (config.json: mamba_num_heads 64, mamba_head_dim 64, n_groups 8,
ssm_state_size 128, conv_kernel 4; conv channels 64*64 + 2*8*128 = 6144). Inputs random bf16
(dt fp32, softplus of a normal), never zeros.

For a producer of P tokens and N consumers of S tokens each:
    per-sequence: the prefix in one call, then one call per consumer from the prefix state;
    two-phase:    the prefix in one call, its final states gathered for all N consumers with
                  index_select, every suffix in ONE packed varlen call;
    full:         the N prompts of P+S tokens in one packed call (no checkpoint).
ideal = N(P+S) / (P+NS), the ratio of tokens computed by full and two-phase. Timing:
triton.testing.do_bench medians (eager: the host's launch work included). Also reported: the
two-phase consumers' final states against the full recompute (relative RMS).

Usage (CUDA with fla-core):  python bench/ssd_two_phase_kernel.py --out bench/results
Writes <out>/<name>.json and <out>/<name>.png.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

HEADS, HEAD_DIM, GROUPS, STATE, CONV_W = 64, 64, 8, 128, 4
CONV_DIM = HEADS * HEAD_DIM + 2 * GROUPS * STATE


def offsets(lens):
    return [0, *itertools.accumulate(lens)]


class CoreOp:
    """conv1d (bias, SiLU) + SSD scan over a packed batch."""

    def __init__(self, gen):
        from forkpoint.kernels.conv1d import triton as conv
        from forkpoint.kernels.ssd import fla as ssd

        self.conv, self.ssd = conv, ssd
        self.weight = (0.5 * torch.randn(CONV_DIM, CONV_W, generator=gen, device="cuda")).bfloat16()
        self.bias = (0.1 * torch.randn(CONV_DIM, generator=gen, device="cuda")).bfloat16()
        self.A = -torch.rand(HEADS, generator=gen, device="cuda") * 4 - 0.5
        self.D = torch.randn(HEADS, generator=gen, device="cuda")

    def __call__(self, xbc, dt, conv_state, ssm_state, cu_dev, cu_host):
        y, conv_final = self.conv.causal_conv1d_varlen(xbc, self.weight, self.bias, conv_state, cu_dev, cu_host)
        x, b, c = y.split([HEADS * HEAD_DIM, GROUPS * STATE, GROUPS * STATE], dim=-1)
        o, ssm_final = self.ssd.chunk_ssd(x.view(-1, HEADS, HEAD_DIM), dt, self.A, b.view(-1, GROUPS, STATE),
                                          c.view(-1, GROUPS, STATE), ssm_state, cu_dev, cu_host, D=self.D)
        return o, conv_final, ssm_final


def inputs(gen, tokens):
    xbc = torch.randn(tokens, CONV_DIM, generator=gen, device="cuda").bfloat16()
    dt = F.softplus(torch.randn(tokens, HEADS, generator=gen, device="cuda") - 2.0)
    return xbc, dt


def rel_rms(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def median_ms(fn, args):
    from triton.testing import do_bench

    return do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")


def run_config(op, gen, p, s, n, args) -> dict:
    row = {"P": p, "S": s, "N": n, "ideal": n * (p + s) / (p + n * s)}
    xp, dtp = inputs(gen, p)
    xs, dts = inputs(gen, n * s)
    c0 = torch.randn(1, CONV_DIM, CONV_W - 1, generator=gen, device="cuda").bfloat16()
    s0 = 0.1 * torch.randn(1, HEADS, HEAD_DIM, STATE, generator=gen, device="cuda")
    cu_p, cu_one, cu_s = [0, p], [0, s], offsets([s] * n)
    cu_p_d, cu_one_d, cu_s_d = (torch.tensor(c, device="cuda") for c in (cu_p, cu_one, cu_s))
    zero = torch.zeros(n, dtype=torch.long, device="cuda")

    def two_phase():
        _, c1, s1 = op(xp, dtp, c0, s0, cu_p_d, cu_p)
        return op(xs, dts, c1.index_select(0, zero), s1.index_select(0, zero), cu_s_d, cu_s)

    def per_sequence():
        _, c1, s1 = op(xp, dtp, c0, s0, cu_p_d, cu_p)
        return [op(xs[i * s:(i + 1) * s], dts[i * s:(i + 1) * s], c1, s1, cu_one_d, cu_one) for i in range(n)]

    two_states = two_phase()[2]
    row["state_rel_err_seq"] = rel_rms(two_states, torch.cat([o[2] for o in per_sequence()]))
    row["two_phase_ms"] = median_ms(two_phase, args)
    if n <= args.max_loop_n:
        row["per_sequence_ms"] = median_ms(per_sequence, args)
    full_tokens = n * (p + s)
    # B and C are expanded to heads for fla (2 * T * H * N bf16) beside the conv output and the scan
    est = full_tokens * (2 * CONV_DIM * 3 + 2 * 2 * HEADS * STATE * 2 + 4 * HEADS * HEAD_DIM * 3)
    row["full_est_gb"] = est / 1e9
    if est <= args.mem_limit_gb * 1e9:
        idx = torch.cat([torch.cat([torch.arange(p), p + i * s + torch.arange(s)]) for i in range(n)]).cuda()
        xf, dtf = torch.cat([xp, xs]).index_select(0, idx), torch.cat([dtp, dts]).index_select(0, idx)
        cf, sf = c0.expand(n, -1, -1).contiguous(), s0.expand(n, -1, -1, -1).contiguous()
        cu_f = offsets([p + s] * n)
        cu_f_d = torch.tensor(cu_f, device="cuda")
        ref = op(xf, dtf, cf, sf, cu_f_d, cu_f)
        row["state_rel_err_full"] = rel_rms(two_states, ref[2])
        del ref
        row["full_ms"] = median_ms(lambda: op(xf, dtf, cf, sf, cu_f_d, cu_f), args)
        del xf, dtf
    torch.cuda.empty_cache()
    for key in ("full_ms", "per_sequence_ms"):
        if key in row:
            row["speedup_vs_" + key[:-3]] = row[key] / row["two_phase_ms"]
    return row


def _f(x, nd=3):
    return "-" if x is None else f"{x:.{nd}f}"


def print_table(res):
    print(f"\nMamba2 core op (conv1d + SSD), Nemotron-3-Nano-30B-A3B layer sizes, bf16, fp32 state ({res['device']})")
    print("| P | S | N | per-sequence (ms) | two-phase (ms) | full (ms) | vs per-seq | vs full | ideal | state err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        if "error" in r:
            print(f"| {r['P']} | {r['S']} | {r['N']} | error: {r['error'][:60]} |")
            continue
        print(f"| {r['P']} | {r['S']} | {r['N']} | {_f(r.get('per_sequence_ms'))} | {_f(r['two_phase_ms'])} "
              f"| {_f(r.get('full_ms'))} | {_f(r.get('speedup_vs_per_sequence'), 2)}x "
              f"| {_f(r.get('speedup_vs_full'), 2)}x | {r['ideal']:.1f} "
              f"| {r.get('state_rel_err_full', r['state_rel_err_seq']):.1e} |")


def plot(res, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    rows = [r for r in res["rows"] if "error" not in r]
    for (p, s), color in zip(sorted({(r["P"], r["S"]) for r in rows}), ("C0", "C1", "C2", "C3")):
        sel = sorted((r for r in rows if (r["P"], r["S"]) == (p, s)), key=lambda r: r["N"])
        for key, style, label in (("speedup_vs_full", "o-", "vs full"),
                                  ("speedup_vs_per_sequence", "x--", "vs per-seq")):
            pts = [(r["N"], r[key]) for r in sel if key in r]
            if pts:
                ax.plot(*zip(*pts), style, color=color, label=f"P={p} S={s} {label}")
        ax.plot([r["N"] for r in sel], [r["ideal"] for r in sel], ":", color=color, alpha=0.6)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("consumers N")
    ax.set_ylabel("time ratio to two-phase (dotted: ideal vs full)")
    ax.set_title(f"Mamba2 layer (Nemotron-3-Nano sizes), {res['device']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--name", default="ssd_two_phase_kernel")
    ap.add_argument("--p", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--s", type=int, nargs="+", default=[128])
    ap.add_argument("--n", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--max-loop-n", type=int, default=64, help="largest N timed with the per-sequence loop")
    ap.add_argument("--mem-limit-gb", type=float, default=60.0, help="skip full recomputes estimated above this")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rep", type=int, default=50)
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop starting new configs after this")
    args = ap.parse_args()
    deadline = time.time() + args.budget_s
    gen = torch.Generator(device="cuda").manual_seed(0)
    op = CoreOp(gen)
    res = {"device": torch.cuda.get_device_name(0), "args": vars(args), "rows": []}
    os.makedirs(args.out, exist_ok=True)
    for n, p, s in itertools.product(args.n, args.p, args.s):
        if time.time() > deadline:
            print(f"P={p} S={s} N={n}: skipped, --budget-s spent", flush=True)
            continue
        try:
            row = run_config(op, gen, p, s, n, args)
        except Exception as e:  # noqa: BLE001 - one failed config must not lose the others
            row = {"P": p, "S": s, "N": n, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            torch.cuda.empty_cache()
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
        with open(os.path.join(args.out, f"{args.name}.json"), "w") as fh:
            json.dump(res, fh, indent=1)
    res["rows"].sort(key=lambda r: (r["P"], r["S"], r["N"]))
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    print_table(res)
    plot(res, os.path.join(args.out, f"{args.name}.png"))


if __name__ == "__main__":
    main()
