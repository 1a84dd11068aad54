"""Replica benchmark: 1-to-N traffic from many anchors at once against engine replicas on Ray
Serve, checkpoint-affine routing vs round-robin vs one replica.

Workload: `--anchors` anchors (random token ids, `--anchor-tokens` long), each with `--consumers`
requests = anchor + its own `--suffix-tokens` tokens, with a checkpoint at the anchor's end
(`checkpoint_positions`). All anchors * consumers requests are sent at once to the OpenAI endpoint
(/v1/completions, one prompt per request, greedy, `--max-tokens`), in-process (ASGI, no sockets).
Each configuration starts on fresh replicas (no checkpoint left from another run):

    affine       --replicas replicas, checkpoint-affine router
    round_robin  --replicas replicas, round-robin router
    single       1 replica

Reported: wall time of the burst, requests/s and prompt tokens/s (aggregate throughput), the
prompt tokens the replicas computed, the prefix recomputation factor
(computed - suffix tokens) / (anchors * anchor tokens) (1.0: every anchor computed once in the
whole cluster), routing decisions and per-replica computed tokens. Each replica is one CPU
process with `--threads` torch threads.

Usage:
    python bench/replicas.py --out bench/results          # embedded default model, CPU
    python bench/replicas.py --model DIR --anchors 16 --consumers 8 --out bench/results
Writes <out>/replicas.json and <out>/replicas.png and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import host_info

from forkpoint.server.config import ServerConfig
from forkpoint.server.replicas.cluster import aggregate_metrics
from forkpoint.server.replicas.deployment import ReplicaOptions
from forkpoint.server.replicas.launch import ReplicaCluster

CONFIGS = {"affine": ("affine", None), "round_robin": ("round_robin", None), "single": ("affine", 1)}


def workload(args: argparse.Namespace, repeat: int) -> list[dict]:
    """One burst; each repeat has its own anchors (nothing reused across bursts)."""
    rng = random.Random(args.seed * 1000 + repeat)
    bodies = []
    for _ in range(args.anchors):
        anchor = [rng.randrange(1000, host_info.VOCAB_LIMIT) for _ in range(args.anchor_tokens)]
        for _ in range(args.consumers):
            suffix = [rng.randrange(1000, host_info.VOCAB_LIMIT) for _ in range(args.suffix_tokens)]
            bodies.append({"prompt": anchor + suffix, "checkpoint_positions": [args.anchor_tokens],
                           "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True})
    rng.shuffle(bodies)  # anchors interleaved, as independent clients would send them
    return bodies


async def settle(worker, until_total: float, timeout: float = 120) -> list:
    """The replicas' snapshots once they report `until_total` prompt tokens and are idle."""
    deadline = time.monotonic() + timeout
    while True:
        snaps = await worker.refresh()
        total = aggregate_metrics(snaps)
        if total.get("prompt_tokens_total", 0) >= until_total and total.get("num_running", 0) == 0 \
                and total.get("num_waiting", 0) == 0:
            return snaps
        if time.monotonic() > deadline:
            raise RuntimeError(f"replicas did not settle: {total}")
        await asyncio.sleep(0.1)


async def drive(app, bursts: list[list[dict]], warmup: list[dict]) -> list[dict]:
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://replicas", timeout=600) as client:
        for body in warmup:  # one unrelated request per replica: first-call costs out of the way
            (await client.post("/v1/completions", json=body)).raise_for_status()
        return [await burst(app.state.cluster, client, bodies) for bodies in bursts]


async def burst(worker, client: httpx.AsyncClient, bodies: list[dict]) -> dict:
    """Send `bodies` at once; the burst's wall time and what the replicas computed for it."""
    before = await settle(worker, 0)
    base = aggregate_metrics(before)
    base_routes = {s.replica: dict(s.routes) for s in before}
    base_computed = {s.replica: s.metrics.get("prompt_tokens_computed", 0) for s in before}
    t0 = time.perf_counter()
    responses = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))
    wall = time.perf_counter() - t0
    for response in responses:
        response.raise_for_status()
    expected = base.get("prompt_tokens_total", 0) + sum(len(b["prompt"]) for b in bodies)
    after = await settle(worker, expected)
    total = aggregate_metrics(after)
    routes: dict[str, int] = {}
    for snap in after:
        for decision, count in snap.routes.items():
            routes[decision] = routes.get(decision, 0) + count - base_routes.get(snap.replica, {}).get(decision, 0)
    return {
        "wall_s": wall,
        "prompt_tokens": sum(len(b["prompt"]) for b in bodies),
        "computed": total.get("prompt_tokens_computed", 0) - base.get("prompt_tokens_computed", 0),
        "generated": sum(r.json()["usage"]["completion_tokens"] for r in responses),
        "cached": sum(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in responses),
        "routes": {k: v for k, v in routes.items() if v},
        "per_replica_computed": sorted(s.metrics.get("prompt_tokens_computed", 0) - base_computed.get(s.replica, 0)
                                       for s in after),
    }


def run_config(name: str, args: argparse.Namespace, engine: dict, bursts: list[list[dict]]) -> dict:
    router, replicas = CONFIGS[name]
    replicas = replicas or args.replicas
    options = ReplicaOptions(num_replicas=replicas, router=router, app_name=f"bench-{name}", num_cpus=args.threads,
                             num_gpus=0, stats_period_s=0.25, graceful_shutdown_timeout_s=2.0)
    rng = random.Random(args.seed + 1)
    warmup = [{"prompt": [rng.randrange(1000, host_info.VOCAB_LIMIT) for _ in range(32)], "max_tokens": 2,
               "temperature": 0} for _ in range(replicas)]
    with ReplicaCluster(engine, options) as cluster:
        app = cluster.app(ServerConfig(served_model_name="bench"))
        runs = asyncio.run(drive(app, bursts, warmup))
    suffix_tokens = args.anchors * args.consumers * args.suffix_tokens
    walls = sorted(r["wall_s"] for r in runs)
    wall = walls[len(walls) // 2]
    computed = sum(r["computed"] for r in runs) / len(runs)
    routes: dict[str, int] = {}
    for r in runs:
        for decision, count in r["routes"].items():
            routes[decision] = routes.get(decision, 0) + count
    return {"config": name, "replicas": replicas, "router": router, "wall_s": wall,
            "wall_s_all": [r["wall_s"] for r in runs],
            "requests_per_s": len(bursts[0]) / wall, "prompt_tokens_per_s": runs[0]["prompt_tokens"] / wall,
            "computed": computed, "prefix_recompute": (computed - suffix_tokens) / (args.anchors * args.anchor_tokens),
            "routes": routes, "per_replica_computed": [r["per_replica_computed"] for r in runs], "runs": runs}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = [f"{r['config']}\n({r['replicas']} repl.)" for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(names, [r["requests_per_s"] for r in rows], color="tab:blue")
    left.set_ylabel("requests / s (aggregate)")
    right.bar(names, [r["prefix_recompute"] for r in rows], color="tab:orange")
    right.axhline(1.0, color="gray", lw=0.8, ls="--")
    right.set_ylabel("prefix computations per anchor")
    w = result["workload"]
    fig.suptitle(f"1-to-{w['consumers']} from {w['anchors']} anchors at once ({w['anchor_tokens']}+"
                 f"{w['suffix_tokens']} tokens, {w['max_tokens']} out), CPU, {w['threads']} thread(s)/replica",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF model directory (default: the embedded default model)")
    parser.add_argument("--replicas", type=int, default=2, help="replicas of the affine and round-robin runs (2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (Ray CPUs) per replica (1)")
    parser.add_argument("--anchors", type=int, default=16)
    parser.add_argument("--consumers", type=int, default=8, help="requests per anchor (8)")
    parser.add_argument("--anchor-tokens", type=int, default=512)
    parser.add_argument("--suffix-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--configs", default="affine,round_robin,single")
    parser.add_argument("--repeats", type=int, default=3, help="bursts per config, fresh anchors each (3): median wall")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    names = args.configs.split(",")
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown configs {unknown}: choose from {sorted(CONFIGS)}")

    import ray

    machine = host_info.machine_info({"gflops_probe": host_info.probe_gflops()})
    ray.init(num_cpus=max(args.replicas, 1) * args.threads, include_dashboard=False, logging_level=logging.ERROR,
             log_to_driver=False)
    engine = {"model": args.model, "device": "cpu", "dtype": "float32",
              "max_model_len": args.anchor_tokens + args.suffix_tokens + args.max_tokens + 16,
              "checkpoint_pool_size": 2 * args.anchors}
    bursts = [workload(args, repeat) for repeat in range(args.repeats)]
    rows = []
    try:
        for name in names:
            rows.append(run_config(name, args, engine, bursts))
            print(f"{name}: {rows[-1]['wall_s']:.2f} s", flush=True)
    finally:
        ray.shutdown()

    result = {"workload": {k: getattr(args, k) for k in ("anchors", "consumers", "anchor_tokens", "suffix_tokens",
                                                         "max_tokens", "threads", "replicas", "repeats", "seed")},
              "model": args.model or "embedded default (Qwen3.5-MoE, 4 layers, hidden 256, random weights)",
              "command": "python " + " ".join(sys.argv), "machine": machine, "code": host_info.code_version(),
              "rows": rows}
    print(host_info.machine_line(machine))
    print(f"{'config':<12} {'repl':>4} {'wall s':>7} {'req/s':>7} {'prompt tok/s':>12} {'computed':>9} "
          f"{'prefix x':>8}  routes (all bursts) / per-replica computed (first burst)")
    for r in rows:
        print(f"{r['config']:<12} {r['replicas']:>4} {r['wall_s']:>7.2f} {r['requests_per_s']:>7.2f} "
              f"{r['prompt_tokens_per_s']:>12.0f} {r['computed']:>9.0f} {r['prefix_recompute']:>8.2f}  "
              f"{r['routes']} / {r['per_replica_computed'][0]}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "replicas.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "replicas.png")
    print(f"wrote {out / 'replicas.json'} and {out / 'replicas.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
