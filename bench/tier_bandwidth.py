"""Host-tier spill and restore of one checkpoint (its state row and prefix KV blocks) at full model
shapes: the plain path (new pinned tensors per spill, copies on the compute stream) against the
arena path (pinned pages allocated once, a copy stream and events; runner/host_copies.py).

Per prefix length (KV blocks of block_size tokens) and path, medians over --repeats of:
  host ms    how long `DeviceStorage.apply` holds the calling thread (the engine's step loop)
  total ms   from the call to the copies' completion (torch.cuda.synchronize)
  GB/s       entry bytes / total
"filling" spills max(2, --repeats) new entries back to back without restoring any: the tier filling
up, where the plain path allocates new pinned memory per spill and the arena takes new chunks (the
next one pinned in the background; back to back, a spill may wait for it: the worst case).
"load+spill" enqueues a spill and then a fixed compute load (bf16 matmuls, ~--overlap-ms) that writes
neither the row nor the blocks: ms of both against the load alone (the plain path serialises them);
"row reused": the load stands for a forward that writes the spilled row (a full state pool gives
the freed row to the next checkpoint), so the arena path waits for the row's copy before it.

Shapes: --shape as bench/e2e_gpu.py (qwen3.5-35b-a3b: 30 GDN layers, state row 61 MiB; 10 attention
layers, KV 320 KiB per 16-token block), no weights. On the CPU (--tiny for a quick dry run) both
paths are synchronous copies.

    python bench/tier_bandwidth.py --shape qwen3.5-35b-a3b --name tier_bandwidth_h200     # on the GPU
    python bench/tier_bandwidth.py --tiny --device cpu --name tier_bandwidth_cpu_dry_run
Writes bench/results/<name>.json and .png (--out to change).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from e2e_gpu import SHAPES, full_config, tiny_config  # noqa: E402
from e2e_gpu_shapes import nemotron3_nano_config, nemotron3_nano_tiny_config  # noqa: E402
from host_info import code_version  # noqa: E402
from plots import write_results  # noqa: E402

from forkpoint.cache.sizing import PoolShapes, PoolSizes  # noqa: E402
from forkpoint.config import ModelConfig  # noqa: E402
from forkpoint.models.mamba2 import Mamba2Mixer  # noqa: E402
from forkpoint.models.qwen3_5 import GatedDeltaNet  # noqa: E402
from forkpoint.runner.storage import DeviceStorage  # noqa: E402
from forkpoint.step.plan import HostDrop, Restore, Segment, SegmentKind, Spill, StepPlan  # noqa: E402

PATHS = ("plain", "arena")


def pool_shapes(shape: str, tiny: bool, dtype: torch.dtype) -> PoolShapes:
    """The pools' declarations of the --shape (models' `pool_shapes`, without building a model)."""
    if shape == "nemotron3-nano":
        config = ModelConfig.from_dict(nemotron3_nano_tiny_config() if tiny else nemotron3_nano_config())
        return PoolShapes(len(config.attention_layer_ids), config.num_key_value_heads, config.head_dim, dtype,
                          len(config.recurrent_layer_ids), Mamba2Mixer.state_spec(config, dtype))
    config = ModelConfig.from_dict(tiny_config() if tiny else full_config())
    return PoolShapes(len(config.attention_layer_ids), config.num_key_value_heads, config.head_dim, dtype,
                      len(config.gdn_layer_ids), GatedDeltaNet.state_spec(config, dtype))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Bench:
    """One storage per path, holding `rows` checkpoint rows and room for two prefixes' blocks."""

    def __init__(self, shapes: PoolShapes, block_size: int, max_blocks: int, rows: int, device: torch.device,
                 host_bytes: int) -> None:
        self.device, self.block_size = device, block_size
        sizes = PoolSizes(num_kv_blocks=2 * max_blocks + 1, num_request_slots=1, num_checkpoint_slots=rows)
        self.storages = {path: DeviceStorage(sizes, block_size, shapes, device,
                                             host_arena_bytes=host_bytes if path == "arena" else 0)
                         for path in PATHS}
        for storage in self.storages.values():
            for tensor in [storage.conv_stack, storage.ssm_stack, *storage.k, *storage.v]:
                tensor.normal_()
            storage.conv_stack[:, 0].zero_()
            storage.ssm_stack[:, 0].zero_()
        self.first_row = 2
        self.rows = rows
        self.entries = {path: 0 for path in PATHS}
        self.numbers = {path: 0 for path in PATHS}

    def apply(self, path: str, writes: list) -> tuple[float, float]:
        """(host s, total s) of one apply of `writes` (no forward writes the rows)."""
        storage = self.storages[path]
        sync(self.device)
        start = time.perf_counter()
        storage.apply(writes, first=self.numbers[path], forward=StepPlan())
        host = time.perf_counter() - start
        sync(self.device)
        self.numbers[path] += len(writes)
        return host, time.perf_counter() - start

    def spill(self, path: str, row: int, blocks: tuple[int, ...]) -> tuple[int, float, float]:
        entry = self.entries[path]
        self.entries[path] += 1
        return (entry, *self.apply(path, [Spill(entry, row, blocks)]))

    def round_trip(self, path: str, num_blocks: int, repeats: int) -> dict:
        """Spill row/blocks, restore into other ones, `repeats` times (warm: pages / pinned blocks reused)."""
        spill, restore = [], []
        a, b = tuple(range(num_blocks)), tuple(range(num_blocks, 2 * num_blocks))
        for i in range(repeats + 1):
            entry, host, total = self.spill(path, self.first_row + i % 2, a)
            r_host, r_total = self.apply(path, [Restore(entry, self.first_row + (i + 1) % 2, b)])
            if i:  # the first is a warm-up
                spill.append((host, total))
                restore.append((r_host, r_total))
        return {"spill": spill, "restore": restore}

    def filling(self, path: str, num_blocks: int, count: int) -> list[tuple[float, float]]:
        """`count` spills of new entries (the tier filling up), then all dropped."""
        times, entries = [], []
        for i in range(count):
            entry, host, total = self.spill(path, self.first_row + i % self.rows, tuple(range(num_blocks)))
            entries.append(entry)
            times.append((host, total))
        self.apply(path, [HostDrop(e) for e in entries])
        return times

    def overlap(self, path: str, num_blocks: int, load: list[torch.Tensor], repeats: int,
                reuse: bool) -> list[float]:
        """Seconds of a spill enqueued before the compute `load` (matmuls), both to completion. With
        `reuse`, the load stands for a forward that writes the spilled state row (a full state pool
        hands it to the next checkpoint), so the arena path waits for the row's copy first."""
        out = []
        row = self.first_row
        forward = StepPlan(segments=(Segment("r", 0, 1, [1], (), 0, (row,), SegmentKind.PREFILL, 0, True),)) \
            if reuse else StepPlan()
        for _ in range(repeats):
            entry = self.entries[path]
            self.entries[path] += 1
            sync(self.device)
            start = time.perf_counter()
            self.storages[path].apply([Spill(entry, row, tuple(range(num_blocks)))], first=self.numbers[path],
                                      forward=forward)
            run_load(load)
            sync(self.device)
            out.append(time.perf_counter() - start)
            self.numbers[path] += 1
            self.apply(path, [HostDrop(entry)])
        return out


def run_load(load: list[torch.Tensor]) -> None:
    a, b = load
    for _ in range(8):
        a = torch.tanh(a @ b)


def calibrated_load(device: torch.device, target_ms: float) -> tuple[list[torch.Tensor], float]:
    """Square bf16 (CUDA) / fp32 (CPU) matmuls whose 8-step chain takes about `target_ms`."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    size = 512
    while True:
        load = [torch.randn(size, size, device=device, dtype=dtype) / size ** 0.5 for _ in range(2)]
        run_load(load)
        sync(device)
        start = time.perf_counter()
        run_load(load)
        sync(device)
        ms = 1e3 * (time.perf_counter() - start)
        if ms >= target_ms or size >= 16384:
            return load, ms
        size = int(size * min(2.0, max(1.1, (target_ms / max(ms, 1e-3)) ** (1 / 3))))


def med(pairs: list[tuple[float, float]], which: int) -> float:
    return 1e3 * statistics.median(p[which] for p in pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, default=SHAPES[0])
    parser.add_argument("--tiny", action="store_true", help="the shape's tiny config (dry run)")
    parser.add_argument("--device", default="auto", help="auto: cuda when available, else cpu")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prefix-tokens", type=lambda s: [int(x) for x in s.split(",")],
                        default=[0, 1024, 4096, 16384, 65536], help="comma-separated; 0: the state row alone")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--overlap-ms", type=float, default=20.0)
    parser.add_argument("--name", default="tier_bandwidth")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args()
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = pool_shapes(args.shape, args.tiny, dtype)
    block_bytes = shapes.block_bytes(args.block_size)
    max_blocks = max(-(-p // args.block_size) for p in args.prefix_tokens)
    rows = max(2, args.repeats)
    host_bytes = (rows + 2) * (shapes.slot_bytes + max_blocks * block_bytes)
    started = time.perf_counter()
    bench = Bench(shapes, args.block_size, max_blocks, rows, device, host_bytes)
    setup_s = time.perf_counter() - started
    load, load_ms = calibrated_load(device, args.overlap_ms)
    print(f"{args.shape}{' (tiny)' if args.tiny else ''} on {device}: state row {shapes.slot_bytes / 2**20:.2f} MiB, "
          f"KV {block_bytes / 2**10:.0f} KiB per {args.block_size}-token block; compute load {load_ms:.1f} ms")
    print("ms: medians; host: the call, spill / restore: to completion; filling: new entries, none restored; "
          "load+spill: a spill then the compute load, to completion (row reused: the load writes the row)")
    print(HEADER)
    rows_out = []
    for tokens in args.prefix_tokens:
        n = -(-tokens // args.block_size)
        entry_bytes = shapes.slot_bytes + n * block_bytes
        for path in PATHS:
            trip = bench.round_trip(path, n, args.repeats)
            fill = bench.filling(path, n, rows)
            over = bench.overlap(path, n, load, max(3, args.repeats // 2), reuse=False)
            reused = bench.overlap(path, n, load, max(3, args.repeats // 2), reuse=True)
            row = {"prefix_tokens": tokens, "blocks": n, "entry_mib": entry_bytes / 2**20, "path": path,
                   "spill_host_ms": med(trip["spill"], 0), "spill_ms": med(trip["spill"], 1),
                   "restore_host_ms": med(trip["restore"], 0), "restore_ms": med(trip["restore"], 1),
                   "filling_spill_host_ms": med(fill, 0), "filling_spill_ms": med(fill, 1),
                   "overlap_ms": 1e3 * statistics.median(over),
                   "overlap_row_reused_ms": 1e3 * statistics.median(reused), "load_ms": load_ms}
            row["spill_gbs"] = entry_bytes / row["spill_ms"] / 1e6
            row["restore_gbs"] = entry_bytes / row["restore_ms"] / 1e6
            rows_out.append(row)
            print_row(row)
    arena = bench.storages["arena"].host.arena
    res = {"shape": args.shape, "tiny": args.tiny, "device": torch.cuda.get_device_name(device)
           if device.type == "cuda" else "cpu", "torch": torch.__version__, "block_size": args.block_size,
           "slot_bytes": shapes.slot_bytes, "block_bytes": block_bytes, "repeats": args.repeats,
           "setup_s": setup_s, "arena_pinned_bytes": arena.allocated_bytes, "code": code_version(), "rows": rows_out}
    path = write_results(res, args.out, args.name, plot)
    print(f"arena: {arena.num_pages} pages of {arena.page_bytes / 2**10:.0f} KiB, {arena.allocated_bytes / 2**30:.2f} "
          f"GiB pinned; results: {path}")


HEADER = (f"{'prefix':>7} {'MiB':>7} {'path':>6} | {'spill host':>10} {'spill':>8} {'GB/s':>6} | "
          f"{'restore host':>12} {'restore':>8} {'GB/s':>6} | {'filling host':>12} {'filling':>8} | "
          f"{'load+spill':>10} {'row reused':>10} {'load':>6}")


def print_row(row: dict) -> None:
    print(f"{row['prefix_tokens']:>7} {row['entry_mib']:>7.1f} {row['path']:>6} | {row['spill_host_ms']:>10.2f} "
          f"{row['spill_ms']:>8.2f} {row['spill_gbs']:>6.1f} | {row['restore_host_ms']:>12.2f} "
          f"{row['restore_ms']:>8.2f} {row['restore_gbs']:>6.1f} | {row['filling_spill_host_ms']:>12.2f} "
          f"{row['filling_spill_ms']:>8.2f} | "
          f"{row['overlap_ms']:>10.2f} {row['overlap_row_reused_ms']:>10.2f} {row['load_ms']:>6.1f}", flush=True)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name in PATHS:
        rows = [r for r in res["rows"] if r["path"] == name]
        mib = [r["entry_mib"] for r in rows]
        left.plot(mib, [r["spill_gbs"] for r in rows], "o-", label=f"spill, {name}")
        left.plot(mib, [r["restore_gbs"] for r in rows], "s--", label=f"restore, {name}")
        right.plot(mib, [r["spill_host_ms"] for r in rows], "o-", label=f"spill, {name}")
        right.plot(mib, [r["filling_spill_host_ms"] for r in rows], "^:", label=f"spill while filling, {name}")
    left.set(xscale="log", xlabel="checkpoint MiB (state row + prefix KV)", ylabel="GB/s (to completion)",
             title="bandwidth")
    right.set(xscale="log", yscale="log", xlabel="checkpoint MiB", ylabel="ms the step loop is held",
              title="host time per spill")
    for ax in (left, right):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"host tier, {res['shape']}{' (tiny)' if res['tiny'] else ''}, {res['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
