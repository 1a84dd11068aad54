"""Does pinning host memory stall the step loop? Pinning rate and kernel-launch stalls while a
background thread pins, by method (issue 32: with 64 chat sessions the server's prompt throughput fell
from ~33k to ~20k tokens/s while the host tier first filled, its arena pinning 1 GiB chunks on a
background thread, runner/host_arena.py).

Methods of pinning `--gib` GiB in `--chunk-mib` MiB pieces, each piece new memory (all kept until the
row's end, so PyTorch's pinned-memory cache never hands a piece back):
  alloc      torch.empty(pin_memory=True): PyTorch's pinned allocator (cudaHostAlloc), the arena's way
  register   pageable torch.empty, its pages touched first (no CUDA call), then cudaHostRegister

Loads, the step loop's stand-ins, timed per iteration (synchronised) on the main thread:
  launches   --launches small in-place adds (launch-bound: a forward's many small kernels)
  matmul     one bf16 matmul of ~--matmul-ms (GPU-bound)

Per method and load: the load's median and worst iteration alone, then while the background thread
pins (the loop runs until the pinning is done), and the pinning's GB/s alone and under load.

    python bench/pin_contention.py --out $OUT                       # on the GPU (needs CUDA)
Writes <out>/pin_contention.json and .png (default out: bench/results).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from host_info import code_version  # noqa: E402
from plots import write_results  # noqa: E402

METHODS = ("alloc", "register")


class Pinner:
    """Pins `pieces` pieces of `piece_bytes` each by `method`; keeps them (and unregisters at `close`)."""

    def __init__(self, method: str, pieces: int, piece_bytes: int) -> None:
        self.method, self.pieces, self.piece_bytes = method, pieces, piece_bytes
        self.kept: list[torch.Tensor] = []
        self.registered: list[torch.Tensor] = []
        self.seconds = 0.0

    def run(self) -> None:
        began = time.perf_counter()
        for _ in range(self.pieces):
            if self.method == "alloc":
                self.kept.append(torch.empty(self.piece_bytes, dtype=torch.uint8, pin_memory=True))
                continue
            piece = torch.empty(self.piece_bytes, dtype=torch.uint8)
            piece.view(-1, 4096)[:, 0].fill_(0)  # fault every page in (no CUDA call)
            err = torch.cuda.cudart().cudaHostRegister(piece.data_ptr(), self.piece_bytes, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister failed: {err}")
            self.registered.append(piece)
        self.seconds = time.perf_counter() - began

    @property
    def gbps(self) -> float:
        return self.pieces * self.piece_bytes / 1e9 / max(self.seconds, 1e-9)

    def close(self) -> None:
        for piece in self.registered:
            torch.cuda.cudart().cudaHostUnregister(piece.data_ptr())
        self.kept.clear()
        self.registered.clear()


def make_loads(device: torch.device, launches: int, matmul_ms: float) -> dict:
    small = torch.zeros(1 << 16, device=device)
    size = 2048
    warm = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    warm @ warm  # cuBLAS's first call (its set-up) is not the load
    while True:
        a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(3):
            a @ a
        torch.cuda.synchronize()
        if (time.perf_counter() - began) / 3 * 1e3 >= matmul_ms or size >= 32768:
            break
        size *= 2

    def run_launches() -> None:
        for _ in range(launches):
            small.add_(1.0)

    def run_matmul() -> None:
        a @ a

    return {"launches": run_launches, "matmul": run_matmul}


def iterations(load, until=None, count: int = 20) -> list[float]:
    """ms per iteration of `load` (synchronised): `count` of them, or until `until()` is true."""
    times = []
    while (until is None and len(times) < count) or (until is not None and not until()):
        began = time.perf_counter()
        load()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - began))
    return times


def measure(method: str, load_name: str, load, pieces: int, piece_bytes: int) -> dict:
    """One row. The solo pinning's memory is kept until the concurrent one is done: freed pinned memory
    goes to PyTorch's pinned-memory cache, which would hand it back without pinning anything."""
    iterations(load, count=5)  # warm
    alone = iterations(load)
    solo = Pinner(method, pieces, piece_bytes)
    solo.run()
    pinner = Pinner(method, pieces, piece_bytes)
    thread = threading.Thread(target=pinner.run)
    thread.start()
    during = iterations(load, until=lambda: not thread.is_alive())
    thread.join()
    solo.close()
    pinner.close()
    return {"method": method, "load": load_name, "alone_p50_ms": statistics.median(alone), "alone_max_ms": max(alone),
            "during_p50_ms": statistics.median(during) if during else float("nan"),
            "during_max_ms": max(during) if during else float("nan"), "iterations_during": len(during),
            "pin_gbps_alone": solo.gbps, "pin_gbps_under_load": pinner.gbps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=2.0, help="GiB pinned per measurement")
    parser.add_argument("--chunk-mib", type=int, nargs="+", default=[1024, 64], help="piece sizes")
    parser.add_argument("--launches", type=int, default=400)
    parser.add_argument("--matmul-ms", type=float, default=20.0)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--name", default="pin_contention")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("pin_contention needs CUDA: pinning is a CUDA driver call")
    device = torch.device("cuda")
    loads = make_loads(device, args.launches, args.matmul_ms)
    rows = []
    print(f"{'method':>8} {'piece MiB':>9} {'load':>8} | {'alone p50':>9} {'max':>7} | {'pinning p50':>11} "
          f"{'max':>8} {'iters':>5} | {'GB/s alone':>10} {'under load':>10}")
    for chunk_mib in args.chunk_mib:
        piece_bytes = chunk_mib << 20
        pieces = max(1, int(args.gib * 1024) // chunk_mib)
        for method in METHODS:
            for load_name, load in loads.items():
                row = {"piece_mib": chunk_mib, **measure(method, load_name, load, pieces, piece_bytes)}
                rows.append(row)
                print(f"{method:>8} {chunk_mib:>9} {load_name:>8} | {row['alone_p50_ms']:>9.2f} "
                      f"{row['alone_max_ms']:>7.2f} | {row['during_p50_ms']:>11.2f} {row['during_max_ms']:>8.2f} "
                      f"{row['iterations_during']:>5} | {row['pin_gbps_alone']:>10.2f} "
                      f"{row['pin_gbps_under_load']:>10.2f}", flush=True)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "code": code_version(),
           "args": vars(args), "rows": rows}
    print("results:", write_results(res, args.out, args.name, plot))


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{r['method']}\n{r['piece_mib']} MiB\n{r['load']}" for r in res["rows"]]
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], [r["alone_p50_ms"] for r in res["rows"]], width=0.4, label="alone p50")
    ax.bar([i + 0.2 for i in x], [r["during_p50_ms"] for r in res["rows"]], width=0.4, label="while pinning p50")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("ms per load iteration")
    ax.set_title(f"Step-loop stand-ins while a thread pins host memory ({res['device']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
