"""Rows, their predicted cost and the hard time limit of `e2e_gpu.py` (no forkpoint, no GPU).

A row is one on/off pair (`RowSpec`); `plan_rows` lists them in the order they run, most important
first (`RowPlan`: the default engine's rows, its long-prompt rows, the eager comparison); `Predictor`
says how long a pair will take from the steps the engine has timed so far, so the driver skips (and
records) a pair that would overrun instead of overrunning; `Alarm` stops whatever runs when a hard
limit passes.
"""

from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass

import numpy as np

# ---------------------------------------------------------------- time limits

class OutOfTime(BaseException):
    """Raised by SIGALRM when a hard limit passes. A BaseException, so that no `except Exception`
    on its way (the engine's clean-up, the profile's guard) swallows it."""


class Alarm:
    """One SIGALRM timer; `arm(at, reason)` replaces the previous one (`at`: a perf_counter time or None)."""

    def __init__(self) -> None:
        self.reason = ""
        signal.signal(signal.SIGALRM, self._fire)

    def _fire(self, signum, frame) -> None:
        raise OutOfTime(self.reason)

    def arm(self, at: float | None, reason: str) -> None:
        self.reason = reason
        if at is None:
            self.disarm()
            return
        delay = at - time.perf_counter()
        if delay <= 0:
            raise OutOfTime(reason)
        signal.setitimer(signal.ITIMER_REAL, delay)

    @staticmethod
    def disarm() -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)


# ---------------------------------------------------------------- rows and their predicted cost

@dataclass(frozen=True)
class RowSpec:
    """One on/off pair: anchor of `p` tokens, one suffix per request (lengths drawn once, seeded)."""

    group: str                       # main | exact | auto | decode | decode_async | seed | long | long_decode | eager
    p: int
    s_label: str                     # "256" or "350-650"
    suffix_lengths: tuple[int, ...]  # one per request: N = len
    max_tokens: int
    engine: str = "default"          # default | enforce_eager | checkpoint_exact | auto_checkpoints | async_scheduling
    recompute: int = 0               # tokens each consumer recomputes before its suffix: with checkpoint_exact
                                     # P mod the scan chunk; automatic checkpoints: P if shorter than their minimum

    @property
    def n(self) -> int:
        return len(self.suffix_lengths)

    @property
    def shape(self) -> str:
        return f"P={self.p} S={self.s_label}"

    @property
    def on_only(self) -> bool:
        """A variant of checkpoints on, run alone and set against the default engine's off run."""
        return self.engine in ("checkpoint_exact", "auto_checkpoints", "async_scheduling")

    @property
    def base_group(self) -> str:
        """The default engine's rows this variant is set against: decode rows for max_tokens > 1."""
        return "decode" if self.max_tokens > 1 else "main"

    def tokens(self, on: bool) -> int:
        """Prompt tokens the engine must compute: the anchor once with checkpoints (and, with
        checkpoint_exact, the tokens from the scan-chunk boundary to the checkpoint once per
        consumer), N times without."""
        if not on:
            return self.n * self.p + sum(self.suffix_lengths)
        return self.p + sum(self.suffix_lengths) + (self.n - 1) * self.recompute

    def context_tokens(self, on: bool) -> int:
        """Sum over the prompt tokens the engine computes of the tokens before each (what causal
        attention reads): a prompt of L tokens computed whole adds L(L-1)/2, a run of R tokens after C
        cached ones R*C + R(R-1)/2. With checkpoints: the anchor whole, each consumer's recomputed
        tokens up to P, every suffix after P; without: every prompt whole."""
        def after(cached: int, run: int) -> int:
            return run * cached + run * (run - 1) // 2

        if not on:
            return sum(after(0, self.p + s) for s in self.suffix_lengths)
        recomputed = (self.n - 1) * after(self.p - self.recompute, self.recompute)
        return after(0, self.p) + recomputed + sum(after(self.p, s) for s in self.suffix_lengths)

    @property
    def ideal(self) -> float:
        return self.tokens(False) / self.tokens(True)

    def describe(self) -> dict:
        return {"group": self.group, "shape": self.shape, "P": self.p, "S": self.s_label, "N": self.n,
                "max_tokens": self.max_tokens, "engine": self.engine}


@dataclass(frozen=True)
class RowPlan:
    """The pairs of one run, each group in the order it runs: `rows` (the default engine, warmed up on
    their shapes first), then `long` (the same engine: long prompts, run after every `rows` pair so
    that a short deadline leaves those their numbers), then `eager` (the eager comparison)."""

    rows: tuple[RowSpec, ...]
    long: tuple[RowSpec, ...]
    eager: tuple[RowSpec, ...]

    def in_run_order(self) -> tuple[RowSpec, ...]:
        return self.rows + self.long + self.eager


def long_rows(args) -> list[RowSpec]:
    """Long prompts: scoring (max_tokens 1) at P in `args.long_p` by N in `args.long_n` (both P at each
    N, as the main rows), then TPOT at P in `args.long_decode_p`, N in `args.long_decode_n`; S = `args.s`."""
    suffix = str(args.s)
    rows = [RowSpec("long", p, suffix, (args.s,) * n, 1) for n in args.long_n for p in args.long_p]
    return rows + [RowSpec("long_decode", p, suffix, (args.s,) * n, args.decode_tokens)
                   for n in args.long_decode_n for p in args.long_decode_p]


def plan_rows(args) -> RowPlan:
    """Every pair of the run (`RowPlan`), from the command line's lists (an empty list: no rows)."""
    rng = np.random.default_rng(args.seed + 3)

    def fixed(n: int) -> tuple[int, ...]:
        return (args.s,) * n

    rows = [RowSpec("main", p, str(args.s), fixed(n), 1) for n in args.n for p in args.p]
    rows += [RowSpec("exact", p, str(args.s), fixed(n), 1, "checkpoint_exact", p % args.scan_chunk)
             for n in args.exact_n for p in args.p if n in args.n]
    rows += [RowSpec("auto", p, str(args.s), fixed(n), 1, "auto_checkpoints", p if p < args.auto_min_tokens else 0)
             for n in args.auto_n for p in args.p if n in args.n]
    rows += [RowSpec("decode", p, str(args.s), fixed(n), args.decode_tokens)
             for n in args.decode_n for p in args.decode_p]
    rows += [RowSpec("decode_async", p, str(args.s), fixed(n), args.decode_tokens, "async_scheduling")
             for n in args.async_n for p in args.decode_p if n in args.decode_n]
    lo, hi = args.seed_s
    rows += [RowSpec("seed", args.seed_p, f"{lo}-{hi}", tuple(int(v) for v in rng.integers(lo, hi + 1, n)), 1)
             for n in args.seed_n]
    eager = [RowSpec("eager", args.eager_p, str(args.s), fixed(n), mt, "enforce_eager")
             for mt in (1, args.decode_tokens) for n in args.eager_n]
    return RowPlan(tuple(rows), tuple(long_rows(args)), tuple(eager))


class Predictor:
    """Seconds an on/off pair will take on one engine, from the steps it has timed so far.

    prefill step = a + b * prompt tokens (at most max_num_batched_tokens per step), decode step =
    c + d * running sequences. Least squares once the engine has timed steps of spread sizes (a
    single size only moves the intercept); until then the priors of the last eager H200 run. The
    sum is multiplied by `margin`.

    Long prompts: a token at position c also reads c earlier keys in every attention layer, which
    the fit of short rows cannot see (at 131k tokens that attention outweighs the token's matmuls).
    A run's prefill therefore costs b * (tokens + attention_share * context tokens), context tokens
    as `RowSpec.context_tokens` counts them; `attention_share`: attention FLOPs per (token, earlier
    token) over the token's matmul FLOPs, from the model's shapes, so attention is assumed to run at
    the matmuls' FLOP rate (conservative where its kernels run faster). Decode steps read the cache
    at memory speed: their context is left out."""

    PRIOR_PREFILL = (0.085, 23.5e-6)
    PRIOR_DECODE = (0.093, 0.2e-3)

    def __init__(self, max_batched_tokens: int, attention_share: float = 0.0, margin: float = 1.2) -> None:
        self.max_batched_tokens = max_batched_tokens
        self.attention_share = attention_share
        self.margin = margin
        self.prefill: list[tuple[int, float]] = []
        self.decode: list[tuple[int, float]] = []

    def observe(self, row: dict) -> None:
        for step in row["steps"]:
            if step["prompt_tokens"] > 0 and row["max_tokens"] == 1:
                self.prefill.append((step["prompt_tokens"], step["s"]))
            elif step["prompt_tokens"] == 0 and step["running"] > 0:
                self.decode.append((step["running"], step["s"]))

    @staticmethod
    def _fit(points: list[tuple[int, float]], prior: tuple[float, float]) -> tuple[float, float]:
        if not points:
            return prior
        x = np.array([p[0] for p in points], dtype=np.float64)
        y = np.array([p[1] for p in points], dtype=np.float64)
        if len(points) >= 4 and x.max() >= 2 * max(x.min(), 1):
            slope, intercept = np.polyfit(x, y, 1)
            if slope > 0 and intercept >= 0:
                return float(intercept), float(slope)
        return max(float(np.median(y - prior[1] * x)), 0.0), prior[1]

    def coefficients(self) -> dict:
        (a, b), (c, d) = self._fit(self.prefill, self.PRIOR_PREFILL), self._fit(self.decode, self.PRIOR_DECODE)
        return {"prefill_fixed_s": a, "prefill_s_per_token": b, "decode_fixed_s": c, "decode_s_per_seq": d,
                "attention_share": self.attention_share}

    def run_seconds(self, tokens: int, context: int, n: int, max_tokens: int) -> float:
        """One run: `tokens` prompt tokens reading `context` earlier tokens in all, then
        max_tokens - 1 decode steps of `n` sequences (without the margin)."""
        k = self.coefficients()
        steps = max(1, math.ceil(tokens / self.max_batched_tokens))
        return (steps * k["prefill_fixed_s"] + (tokens + self.attention_share * context) * k["prefill_s_per_token"]
                + (max_tokens - 1) * (k["decode_fixed_s"] + n * k["decode_s_per_seq"]))

    def pair_seconds(self, spec: RowSpec) -> float:
        modes = (True,) if spec.on_only else (True, False)
        return self.margin * sum(self.run_seconds(spec.tokens(on), spec.context_tokens(on), spec.n, spec.max_tokens)
                                 for on in modes)
