"""One start-up compile worker (runner/precompile.py): its share of the buckets and warm-up layouts.

    python -m forkpoint.runner.precompile_worker PLAN_PICKLE INDEX COUNT

Builds the plan's model cut to one layer per kind (`reduced_depth`) with dummy weights on the
plan's device (CUDA; the CPU runs the same steps, for tests), pools of one KV block (synthetic steps
read and write only the scratch rows; block tables are as wide as each step's contexts, whatever the
pool holds) and the plan's request rows, then runs the pieces of its share of the buckets eagerly and
every warm-up layout: the kernels they launch compile into the Triton cache named by the environment.

How the work splits: the autotuners (fla-core's chunked kernels, the paged attention's prefill tiles)
compile every candidate config of every key, the part of a cold start that divides; each worker's
autotuners (all of this process's, `share_autotuned_configs`) compile and time only the worker's
share of each key's candidates; the union over the workers is every candidate, each compiled once.
Every worker runs every layout, so every key is met in every worker; kernels without an autotuner
compile in each (splitting the layouts instead duplicated nearly all of the work: on the H200 at 35B
shapes, 8 workers took 121 s; the engine alone spent 169 s in its graphs, decode graphs and warm-up;
how the autotuners' share of the compiling compares is not measured yet). Exits 0 when done.
"""

from __future__ import annotations

import pickle
import sys
import time
from pathlib import Path

import torch

from forkpoint.cache.sizing import PoolSizes
from forkpoint.models.loader import build_model
from forkpoint.runner.model_runner import ModelRunner
from forkpoint.runner.piecewise import PiecewiseForward
from forkpoint.runner.precompile import CompilePlan, CompileShare, reduced_depth
from forkpoint.runner.storage import DeviceStorage
from forkpoint.runner.warmup import warm_up


def share_autotuned_configs(share: CompileShare) -> None:
    """Make every Triton autotuner of this process (a worker's own: nothing else runs here) compile
    and time only `share` of each key's candidate configs after its own pruning (at least one), so the
    workers together compile each candidate once. Its choice from that share is never kept (the
    workers run with TRITON_CACHE_AUTOTUNING=0); the engine times every candidate itself."""
    from triton.runtime.autotuner import Autotuner

    prune = Autotuner.prune_configs

    def pruned_share(self, kwargs):
        configs = prune(self, kwargs)
        return share.take(configs) or [configs[share.index % len(configs)]]

    Autotuner.prune_configs = pruned_share


def run_share(plan: CompilePlan, share: CompileShare) -> None:
    device = torch.device(plan.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        share_autotuned_configs(share)
    dtype = getattr(torch, plan.dtype)
    model = build_model(reduced_depth(plan.model_config), None, "dummy", device, dtype, seed=0)
    piecewise = PiecewiseForward(model, plan.graph_sizes, device, capture=False)
    storage = DeviceStorage(PoolSizes(num_kv_blocks=1, num_request_slots=plan.num_request_slots,
                                      num_checkpoint_slots=1), plan.block_size, model.pool_shapes(dtype), device)
    runner = ModelRunner(model, storage, device, piecewise=piecewise)
    for rows in share.take(sorted(plan.graph_sizes, reverse=True)):
        piecewise.run_pieces(rows)
    warm_up(runner, max_tokens=plan.graph_sizes[-1], max_seqs=plan.num_request_slots, max_context=plan.max_context)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str]) -> int:
    plan_file, index, count = argv
    plan = pickle.loads(Path(plan_file).read_bytes())
    start = time.perf_counter()
    share = CompileShare(int(index), int(count))
    run_share(plan, share)
    print(f"share {share.index} of {share.count} compiled in {time.perf_counter() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
