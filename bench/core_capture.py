"""A reused chat turn's step with the recurrent core graph captured before the step's first core
(`PiecewiseForward.capture_core_first`, the default) against the earlier order (first core eager, then
the capture), on one engine, the two orders alternating step by step (GPU).

The step is issue 26's reused turn: --streams greedy streams decode while one request, an anchor of
--anchor tokens (its checkpoint computed before the timed steps) plus --new fresh tokens, arrives and
prefills in the same step. Each timed step: `torch.cuda.synchronize()`, then `engine.step()` (which
waits for the step's sampled tokens), wall time; the host time of the forward alone (until it returns,
no sync) is timed by wrapping the runner's forward. Outputs are compared: the same request run under
both orders must give the same greedy tokens. Qwen3.5-35B-A3B widths with --layers layers (3 of
every 4 Gated DeltaNet), dummy weights.

Usage (one H200 or H100):
    python3 bench/core_capture.py --layers 12 --steps 12 --out $OUT --name core_capture_h200
    python3 bench/core_capture.py --tiny --steps 4          # the tiny model: a CPU-free smoke run on a GPU
Prints a table; writes <out>/<name>.json and .png.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from e2e_gpu import full_config, make_model_dir, tiny_config  # noqa: E402
from host_info import code_version, machine_info  # noqa: E402
from plots import write_results  # noqa: E402

from forkpoint import LLM, SamplingParams  # noqa: E402

ORDERS = ("capture_first", "eager_first")


def model_config(args) -> dict:
    cfg = tiny_config() if args.tiny else full_config()
    if not args.tiny:
        layers = args.layers
        cfg.update(num_hidden_layers=layers,
                   layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)])
    return cfg


def random_ids(generator: torch.Generator, n: int, vocab: int) -> list[int]:
    return torch.randint(1000, vocab - 1000, (n,), generator=generator).tolist()


class ForwardTimer:
    """Wraps the runner's forward: host seconds until each call returns (no sync), by order."""

    def __init__(self, runner) -> None:
        self.runner, self.forward = runner, runner.forward
        self.order = ORDERS[0]
        self.host_s: dict[str, list[float]] = {order: [] for order in ORDERS}
        runner.forward = self

    def __call__(self, batch):
        start = time.perf_counter()
        out = self.forward(batch)
        self.host_s[self.order].append(time.perf_counter() - start)
        return out


def run(args) -> dict:
    scratch = Path(tempfile.mkdtemp(prefix="core_capture_"))
    cfg = model_config(args)
    model_dir = make_model_dir(cfg, scratch / "model")
    llm = LLM(str(model_dir), load_format="dummy", dtype="bfloat16", device="cuda", seed=0,
              max_num_batched_tokens=8192, checkpoint_host_bytes=0)
    engine = llm.engine
    piecewise = engine.runner.piecewise
    if piecewise is None:
        raise SystemExit("no piecewise CUDA graphs on this engine: nothing to compare")
    vocab = cfg["vocab_size"]
    generator = torch.Generator().manual_seed(0)
    anchor = random_ids(generator, args.anchor, vocab)
    marker = llm.checkpoint_token_id
    greedy = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": anchor + [marker] + random_ids(generator, 4, vocab)}], greedy, use_tqdm=False)
    streams = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
    for i in range(args.streams):
        engine.add_request(f"stream-{i}", {"prompt_token_ids": random_ids(generator, 64, vocab)}, streams)
    for _ in range(3):
        engine.step()
    timer = ForwardTimer(engine.runner)
    wall: dict[str, list[float]] = {order: [] for order in ORDERS}
    firsts: dict[str, list[int]] = {order: [] for order in ORDERS}
    failures_before = piecewise.core_capture_failures
    for step in range(2 * args.steps + 2):
        order = ORDERS[step % 2]
        piecewise.capture_core_first = order == "capture_first"
        timer.order = order
        suffix = random_ids(torch.Generator().manual_seed(1000 + step // 2), args.new, vocab)
        request_id = f"turn-{step}"
        engine.add_request(request_id, {"prompt_token_ids": anchor + [marker] + suffix}, greedy)
        torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = engine.step()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        token = next((o.outputs[0].token_ids[0] for o in outputs if o.request_id == request_id), None)
        if step >= 2:  # the first pair warms up
            wall[order].append(elapsed)
            firsts[order].append(token)
        else:
            timer.host_s[order].clear()
    for i in range(args.streams):
        engine.abort_request(f"stream-{i}")
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()
    rows = {order: {"step_ms_p50": 1e3 * statistics.median(wall[order]),
                    "step_ms_min": 1e3 * min(wall[order]),
                    "forward_host_ms_p50": 1e3 * statistics.median(timer.host_s[order]),
                    "steps": len(wall[order])} for order in ORDERS}
    return {
        "config": {"layers": cfg["num_hidden_layers"], "tiny": args.tiny, "streams": args.streams,
                   "anchor": args.anchor, "new": args.new, "steps_per_order": args.steps},
        "machine": machine_info({"gpu": torch.cuda.get_device_name()}),
        "code": code_version(),
        "rows": rows,
        "same_first_tokens": firsts["capture_first"] == firsts["eager_first"],
        "core_capture_failures": piecewise.core_capture_failures - failures_before,
        "core_capture_failure_cause": piecewise.core_capture_failure_cause,
    }


def table(res: dict) -> str:
    c = res["config"]
    lines = [f"core_capture: {c['layers']} layers, {c['streams']} streams decoding + {c['new']} new tokens after a "
             f"{c['anchor']}-token checkpoint, {c['steps_per_order']} steps per order ({res['machine'].get('gpu')})",
             f"{'order':<14} {'step p50 ms':>12} {'step min ms':>12} {'forward host p50 ms':>20}"]
    for order, row in res["rows"].items():
        lines.append(f"{order:<14} {row['step_ms_p50']:>12.2f} {row['step_ms_min']:>12.2f} "
                     f"{row['forward_host_ms_p50']:>20.2f}")
    lines.append(f"same greedy tokens both orders: {res['same_first_tokens']}; core capture failures: "
                 f"{res['core_capture_failures']} ({res['core_capture_failure_cause']})")
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    orders = list(res["rows"])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([o + "\nstep" for o in orders], [res["rows"][o]["step_ms_p50"] for o in orders])
    ax.bar([o + "\nforward host" for o in orders], [res["rows"][o]["forward_host_ms_p50"] for o in orders])
    ax.set_ylabel("ms (p50)")
    ax.set_title("reused-turn step: core graph captured first vs after an eager core")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12, help="decoder layers at 35B widths (40 in the model)")
    parser.add_argument("--tiny", action="store_true", help="the tiny Qwen3.5-MoE instead of 35B widths")
    parser.add_argument("--streams", type=int, default=31)
    parser.add_argument("--anchor", type=int, default=3800)
    parser.add_argument("--new", type=int, default=272)
    parser.add_argument("--steps", type=int, default=12, help="timed steps per order")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--name", default="core_capture")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/core_capture.py needs a CUDA device")
    res = run(args)
    print(table(res))
    print("wrote", write_results(res, args.out, args.name, plot))
    return res


if __name__ == "__main__":
    main()
