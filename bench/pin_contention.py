"""Does pinning host memory stall the step loop, and does pinning on several threads go faster? Pinning
rate and kernel-launch stalls while background threads pin, by method and by thread count (issue 32:
with 64 chat sessions the server's prompt throughput fell from ~33k to ~20k tokens/s while the host tier
first filled; issue 31: pinning a 31.6 GiB tier ahead on one thread took 13.5-18.0 s of the start-up).

Part 1, by method, one background thread pinning `--gib` GiB in `--chunk-mib` MiB pieces, each piece new
memory (all kept until the row's end, so PyTorch's pinned-memory cache never hands a piece back, and
that cache is emptied between rows):
  alloc      torch.empty(pin_memory=True): PyTorch's pinned allocator (cudaHostAlloc), the arena's way
  register   pageable torch.empty, its pages touched first (no CUDA call), then cudaHostRegister

Part 2, by thread count (`--threads`, default 1 2 4 8): the arena's own pinner (runner/host_pinning.py
`ChunkPinner`, what `HostArena(ahead=True, pin_threads=N)` runs) pinning `--parallel-gib` GiB in
`--parallel-chunk-mib` MiB chunks with the alloc method: total GB/s alone, then under the launches load
with that load's stalls. These rows decide host_arena.py's PIN_THREADS.

Loads, the step loop's stand-ins, timed per iteration (synchronised) on the main thread:
  launches   --launches small in-place adds (launch-bound: a forward's many small kernels)
  matmul     one bf16 matmul of ~--matmul-ms (GPU-bound; part 1 only)

Per row: the load's median and worst iteration alone, then while the background threads pin (the loop
runs until the pinning is done), and the pinning's GB/s alone and under load.

    python bench/pin_contention.py --out $OUT        # on the GPU (needs CUDA)
    python bench/pin_contention.py --dry-run         # anywhere: the same code on small plain memory
Writes <out>/pin_contention.json and .png (default out: bench/results).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from host_info import code_version  # noqa: E402
from plots import write_results  # noqa: E402

from forkpoint.runner.host_pinning import ChunkPinner  # noqa: E402

METHODS = ("alloc", "register")


class Machine:
    """CUDA, or with `dry` the CPU: plain (unpinned) memory and a CPU load, to check the script runs."""

    def __init__(self, dry: bool) -> None:
        self.dry = dry
        self.device = torch.device("cpu" if dry else "cuda")

    def synchronize(self) -> None:
        if not self.dry:
            torch.cuda.synchronize()

    def empty_host_cache(self) -> str:
        """Give PyTorch's cached pinned memory back, so that the next row pins anew; returns how."""
        if self.dry:
            return "dry run"
        accelerator = getattr(torch, "accelerator", None)
        if accelerator is not None and hasattr(accelerator, "empty_host_cache"):
            accelerator.empty_host_cache()
            return "torch.accelerator.empty_host_cache"
        if hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()
            return "torch._C._host_emptyCache"
        return "none (rows after the first may reuse cached pinned memory: see each row's GB/s)"

    def allocator(self, method: str, registered: list[torch.Tensor]) -> Callable[[int], torch.Tensor]:
        """`allocate(num_bytes)` by `method`; registered pieces are appended to `registered` (to unregister)."""
        if method == "alloc":
            return lambda num_bytes: torch.empty(num_bytes, dtype=torch.uint8, pin_memory=not self.dry)

        def register(num_bytes: int) -> torch.Tensor:
            piece = torch.empty(num_bytes, dtype=torch.uint8)
            piece.view(-1, 4096)[:, 0].fill_(0)  # fault every page in (no CUDA call)
            if not self.dry:
                err = torch.cuda.cudart().cudaHostRegister(piece.data_ptr(), num_bytes, 0)
                if int(err) != 0:
                    raise RuntimeError(f"cudaHostRegister failed: {err}")
                registered.append(piece)
            return piece

        return register


class Pinning:
    """`pieces` pieces of `piece_bytes` pinned by `method` on `threads` threads (the arena's ChunkPinner);
    keeps them until `close` (which unregisters registered ones)."""

    def __init__(self, machine: Machine, method: str, pieces: int, piece_bytes: int, threads: int) -> None:
        self.machine, self.method, self.pieces, self.piece_bytes, self.threads = (machine, method, pieces,
                                                                                  piece_bytes, threads)
        self.registered: list[torch.Tensor] = []
        self.pinner: ChunkPinner | None = None

    def start(self) -> None:
        self.pinner = ChunkPinner([self.piece_bytes] * self.pieces, self.machine.allocator(self.method,
                                                                                           self.registered),
                                  self.threads)

    def run(self) -> None:
        self.start()
        self.pinner.wait()

    @property
    def gbps(self) -> float:
        if self.pinner.error is not None:
            raise RuntimeError(f"pinning failed: {self.pinner.error}")
        return self.pieces * self.piece_bytes / 1e9 / max(self.pinner.seconds, 1e-9)

    def close(self) -> None:
        if not self.machine.dry:
            for piece in self.registered:
                torch.cuda.cudart().cudaHostUnregister(piece.data_ptr())
        self.registered.clear()
        self.pinner = None


def make_loads(machine: Machine, launches: int, matmul_ms: float) -> dict:
    small = torch.zeros(1 << 16, device=machine.device)
    dtype = torch.float32 if machine.dry else torch.bfloat16
    size = 256 if machine.dry else 2048
    while True:
        a = torch.randn(size, size, device=machine.device, dtype=dtype)
        a @ a  # (untimed: cuBLAS's set-up and its choice for this shape are not the load)
        machine.synchronize()
        began = time.perf_counter()
        for _ in range(3):
            a @ a
        machine.synchronize()
        if (time.perf_counter() - began) / 3 * 1e3 >= matmul_ms or size >= (1024 if machine.dry else 32768):
            break
        size *= 2

    def run_launches() -> None:
        for _ in range(launches):
            small.add_(1.0)

    def run_matmul() -> None:
        a @ a

    return {"launches": run_launches, "matmul": run_matmul}


def iterations(machine: Machine, load, until=None, count: int = 20) -> list[float]:
    """ms per iteration of `load` (synchronised): `count` of them, or until `until()` is true."""
    times = []
    while (until is None and len(times) < count) or (until is not None and not until()):
        began = time.perf_counter()
        load()
        machine.synchronize()
        times.append(1e3 * (time.perf_counter() - began))
    return times


def measure(machine: Machine, method: str, load_name: str, load, pieces: int, piece_bytes: int,
            threads: int) -> dict:
    """One row. The solo pinning's memory is kept until the concurrent one is done, and PyTorch's
    pinned cache is emptied before each: freed pinned memory goes to that cache, which would hand it
    back without pinning anything."""
    emptied = machine.empty_host_cache()
    iterations(machine, load, count=5)  # warm
    alone = iterations(machine, load)
    solo = Pinning(machine, method, pieces, piece_bytes, threads)
    solo.run()
    concurrent = Pinning(machine, method, pieces, piece_bytes, threads)
    concurrent.start()
    during = iterations(machine, load, until=lambda: concurrent.pinner.done)
    concurrent.pinner.wait()
    row = {"method": method, "threads": threads, "piece_mib": piece_bytes >> 20, "gib": pieces * piece_bytes / 2**30,
           "load": load_name, "alone_p50_ms": statistics.median(alone), "alone_max_ms": max(alone),
           "during_p50_ms": statistics.median(during) if during else float("nan"),
           "during_max_ms": max(during) if during else float("nan"), "iterations_during": len(during),
           "pin_gbps_alone": solo.gbps, "pin_gbps_under_load": concurrent.gbps, "host_cache_emptied_by": emptied}
    solo.close()
    concurrent.close()
    return row


def print_row(row: dict) -> None:
    print(f"{row['method']:>8} {row['threads']:>7} {row['piece_mib']:>9} {row['load']:>8} | "
          f"{row['alone_p50_ms']:>9.2f} {row['alone_max_ms']:>7.2f} | {row['during_p50_ms']:>11.2f} "
          f"{row['during_max_ms']:>8.2f} {row['iterations_during']:>5} | {row['pin_gbps_alone']:>10.2f} "
          f"{row['pin_gbps_under_load']:>10.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=2.0, help="GiB pinned per measurement (part 1)")
    parser.add_argument("--chunk-mib", type=int, nargs="+", default=[1024, 64], help="piece sizes (part 1)")
    parser.add_argument("--threads", type=int, nargs="*", default=[1, 2, 4, 8],
                        help="thread counts (part 2; none: skip part 2)")
    parser.add_argument("--parallel-gib", type=float, default=8.0, help="GiB pinned per measurement (part 2)")
    parser.add_argument("--parallel-chunk-mib", type=int, default=1024, help="chunk size (part 2: the arena's)")
    parser.add_argument("--skip-methods", action="store_true", help="part 2 only")
    parser.add_argument("--launches", type=int, default=400)
    parser.add_argument("--matmul-ms", type=float, default=20.0)
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, plain memory, small sizes: checks the script, measures nothing about pinning")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--name", default="pin_contention")
    args = parser.parse_args()
    if args.dry_run:
        args.gib, args.chunk_mib, args.parallel_gib, args.parallel_chunk_mib = 0.0625, [16], 0.125, 16
        args.launches, args.matmul_ms, args.name = 50, 1.0, f"{args.name}_dry"
    elif not torch.cuda.is_available():
        raise SystemExit("pin_contention needs CUDA: pinning is a CUDA driver call (--dry-run checks the script)")
    machine = Machine(args.dry_run)
    loads = make_loads(machine, args.launches, args.matmul_ms)
    rows = []
    print(f"{'method':>8} {'threads':>7} {'piece MiB':>9} {'load':>8} | {'alone p50':>9} {'max':>7} | "
          f"{'pinning p50':>11} {'max':>8} {'iters':>5} | {'GB/s alone':>10} {'under load':>10}")
    for chunk_mib in [] if args.skip_methods else args.chunk_mib:
        pieces = max(1, int(args.gib * 1024) // chunk_mib)
        for method in METHODS:
            for load_name, load in loads.items():
                rows.append(measure(machine, method, load_name, load, pieces, chunk_mib << 20, threads=1))
                print_row(rows[-1])
    for threads in args.threads:
        pieces = max(1, int(args.parallel_gib * 1024) // args.parallel_chunk_mib)
        rows.append(measure(machine, "alloc", "launches", loads["launches"], pieces, args.parallel_chunk_mib << 20,
                            threads))
        print_row(rows[-1])
    device = "CPU (dry run: plain memory)" if args.dry_run else torch.cuda.get_device_name()
    res = {"device": device, "torch": torch.__version__, "code": code_version(), "args": vars(args), "rows": rows}
    print("results:", write_results(res, args.out, args.name, plot))


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    fig, (stalls, rates) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    labels = [f"{r['method']} x{r['threads']}\n{r['piece_mib']} MiB\n{r['load']}" for r in rows]
    x = range(len(labels))
    stalls.bar([i - 0.27 for i in x], [r["alone_p50_ms"] for r in rows], width=0.27, label="alone p50")
    stalls.bar(list(x), [r["during_p50_ms"] for r in rows], width=0.27, label="while pinning p50")
    stalls.bar([i + 0.27 for i in x], [r["during_max_ms"] for r in rows], width=0.27, label="while pinning max")
    stalls.set_xticks(list(x), labels, fontsize=6)
    stalls.set_ylabel("ms per load iteration")
    stalls.set_title("Step-loop stand-ins while threads pin host memory", fontsize=9)
    stalls.legend(fontsize=7)
    parallel = [r for r in rows if r["method"] == "alloc" and r["piece_mib"] == res["args"]["parallel_chunk_mib"]
                and r["load"] == "launches" and r["gib"] == rows[-1]["gib"]]
    threads = [r["threads"] for r in parallel]
    rates.plot(threads, [r["pin_gbps_alone"] for r in parallel], "o-", label="alone")
    rates.plot(threads, [r["pin_gbps_under_load"] for r in parallel], "s--", label="beside the launches")
    rates.set_xscale("log", base=2)
    rates.set_xlabel("pinning threads")
    rates.set_ylabel("GB/s pinned (all threads)")
    rates.set_title(f"PyTorch pinned allocation, {res['args']['parallel_chunk_mib']} MiB chunks", fontsize=9)
    rates.legend(fontsize=7)
    fig.suptitle(res["device"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
