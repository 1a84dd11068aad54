"""Start-up time of `forkpoint serve`, cold and warm, in one call (issue 31): two consecutive starts
of the server on the same model, the first with empty kernel caches (a fresh node, or the first start
after an upgrade), the second with the caches the first one left (a restart after a crash).

Each start is a real `forkpoint serve MODEL --load-format dummy` process (bench/served.py), timed from
its launch to the first 200 from `/health` ("ready"); then one request (the first after start can still
compile a kernel) and a second one, each timed. The engine's phases come from the start-up summary
the server logs (`start-up 41.2 s: config and tokenizer 0.4 s, load weights 9.1 s, ...`,
engine/startup.py); before it, "interpreter and imports" runs from the launch to the engine's first log
line (`kernel caches: ...`, logged as `LLM` starts); the rest of "ready" is "server" (resolving the
model, the server's own start-up: grammar vocabulary, uvicorn; and /health polled every 0.5 s).

Caches: both starts get FORKPOINT_CACHE=<cache dir> with TRITON_CACHE_DIR and TRITON_CACHE_AUTOTUNING
unset, so Triton's kernels and every autotune choice go under <cache dir>/kernels
(kernels/cache_dirs.py). The cache dir is a fresh temporary directory unless --cache-dir names one (a
non-empty one makes the first start warm: the result says so). Not cleared: the OS page cache (Python
packages; with dummy weights no weight file is read) and the CUDA driver's own caches.

Targets (issue 31; H200, Qwen3.5-35B-A3B shapes): cold <= 90 s, warm <= 20 s. A miss is printed with
the phase that costs most. Prints a table; writes <out>/<name>.json and a PNG (phases stacked per start).

    python bench/startup.py --out bench/results                             # H200, 35B shapes: ~5 min
    python bench/startup.py --tiny --device cpu --out /tmp/startup         # the mechanism on a CPU
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from host_info import code_version, machine_info  # noqa: E402
from plots import stacked_bars, write_results  # noqa: E402
from served import start_server  # noqa: E402

TARGETS_S = {"cold": 90.0, "warm": 20.0}  # issue 31, H200 at 35B shapes
SERVED_NAME = "startup-bench"
IMPORTS, SERVER = "interpreter and imports", "server"
_STARTUP = re.compile(r"start-up (\d+(?:\.\d+)?) s: (.*)$")
_PHASE = re.compile(r"(.+?) (\d+(?:\.\d+)?) s(?:, |$)")
_LOADED = re.compile(r"loaded in (\d+(?:\.\d+)?) s")
# the first line `LLM.__init__` logs (logging's default asctime: local time, milliseconds)
_FIRST = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO forkpoint: kernel caches", re.MULTILINE)


def parse_startup_log(text: str) -> dict:
    """From a server's log: {"engine_s": the engine's start-up total, "phases": {name: seconds} in
    order, "loaded_in_s": the server's load time (LLM construction) or None, "llm_start": the epoch
    time of `LLM`'s first log line or None}. ValueError when the log has no start-up summary line (the
    server did not get that far, or logs below INFO)."""
    for line in text.splitlines():
        match = _STARTUP.search(line)
        if match:
            phases = {m.group(1): float(m.group(2)) for m in _PHASE.finditer(match.group(2))}
            loaded, first = _LOADED.search(text), _FIRST.search(text)
            llm_start = datetime.strptime(first.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() if first else None
            return {"engine_s": float(match.group(1)), "phases": phases,
                    "loaded_in_s": float(loaded.group(1)) if loaded else None, "llm_start": llm_start}
    raise ValueError("no 'start-up N s: ...' line in the server log (is --log-level info?)")


def directory_size(path: Path) -> tuple[int, int]:
    """(files, bytes) under `path` (0, 0 when it does not exist)."""
    files = [p for p in path.rglob("*") if p.is_file()] if path.exists() else []
    return len(files), sum(p.stat().st_size for p in files)


def timed_request(url: str, prompt: str, max_tokens: int, timeout_s: float) -> float:
    """Seconds for one completion of `max_tokens` tokens (raises on an error answer)."""
    start = time.perf_counter()
    response = httpx.post(f"{url}/v1/completions", timeout=timeout_s,
                          json={"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens,
                                "temperature": 0.0})
    response.raise_for_status()
    return time.perf_counter() - start


def stop(process: subprocess.Popen) -> None:
    """SIGINT (the server drains and stops), then kill after 60 s."""
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def one_start(run: str, model_dir: Path, options: list[str], env: dict[str, str], cache_dir: Path,
              log_path: Path, args) -> dict:
    """Start the server once, time it to ready and two requests, stop it; the row of `run`."""
    files_before, _ = directory_size(cache_dir / "kernels")
    with open(log_path, "w") as log:
        launched, start = time.time(), time.perf_counter()
        process, url = start_server(options, str(model_dir), args.timeout, output=log, env=env)
        ready_s = time.perf_counter() - start
        try:
            first_s = timed_request(url, args.prompt, args.max_tokens, args.timeout)
            second_s = timed_request(url, args.prompt + " again", args.max_tokens, args.timeout)
        finally:
            stop(process)
    parsed = parse_startup_log(log_path.read_text())
    files, size = directory_size(cache_dir / "kernels")
    imports_s = max(parsed.pop("llm_start") - launched, 0.0) if parsed["llm_start"] is not None else 0.0
    row = {"run": run, "ready_s": ready_s, **parsed, "imports_s": imports_s,
           "server_s": max(ready_s - imports_s - parsed["engine_s"], 0.0),
           "first_request_s": first_s, "second_request_s": second_s,
           "kernel_cache_files_before": files_before, "kernel_cache_files": files, "kernel_cache_bytes": size,
           "log": str(log_path)}
    print(f"{run}: ready in {ready_s:.1f} s (engine {parsed['engine_s']:.1f} s); first request {first_s:.2f} s, "
          f"second {second_s:.2f} s; kernel cache {files} files, {size / 2**20:.1f} MiB", flush=True)
    return row


def verdicts(rows: list[dict], applies: bool) -> list[str]:
    """One line per start: its ready time against the target, and on a miss the phase that costs most."""
    lines = []
    for row in rows:
        target = TARGETS_S[row["run"]]
        phases = {IMPORTS: row["imports_s"], **row["phases"], SERVER: row["server_s"]}
        worst = max(phases, key=phases.get)
        met = row["ready_s"] <= target
        line = (f"{row['run']}: {row['ready_s']:.1f} s against the target {target:.0f} s: "
                + ("met" if met else f"MISSED, the largest phase is {worst} ({phases[worst]:.1f} s)"))
        lines.append(line if applies else line + " (the targets are for an H200 at 35B shapes)")
    return lines


def plot(res: dict, path: str) -> None:
    rows = res["runs"]
    names = list(dict.fromkeys(name for row in rows for name in row["phases"]))
    parts = {IMPORTS: [row["imports_s"] for row in rows],
             **{name: [row["phases"].get(name, 0.0) for row in rows] for name in names},
             SERVER: [row["server_s"] for row in rows]}
    stacked_bars(Path(path), [row["run"] for row in rows], parts, "seconds to ready (/health 200)",
                 f"forkpoint serve start-up: {res['model']}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny Qwen3.5-MoE shapes (CPU dry run)")
    parser.add_argument("--device", default="auto", help="the server's --device (default: auto)")
    parser.add_argument("--serve-options", default="",
                        help="more `forkpoint serve` options, one shell-quoted string, e.g. '--enforce-eager' or "
                             "'--max-num-seqs 64' (default: none: the server's defaults)")
    parser.add_argument("--cache-dir", default=None,
                        help="FORKPOINT_CACHE of both starts (default: a fresh temporary directory, so the first "
                             "start is cold)")
    parser.add_argument("--workdir", default=None, help="where the model directory (config, tokenizer) is written "
                                                        "(default: a temporary directory)")
    parser.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog. " * 8,
                        help="prompt of the two timed requests")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per timed request (default: 16)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one start may take (default: 600)")
    parser.add_argument("--out", default="bench/results", help="output folder (default: bench/results)")
    parser.add_argument("--name", default=None, help="output name (default: startup_<device kind>[_tiny])")
    args = parser.parse_args(argv)

    from e2e_gpu import full_config, make_model_dir, tiny_config  # the 1-to-N benchmark's 35B shapes

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="forkpoint-startup-"))
    model_dir = make_model_dir(tiny_config() if args.tiny else full_config(), workdir / "model")
    cache_dir = Path(args.cache_dir or tempfile.mkdtemp(prefix="forkpoint-cache-"))
    cold = directory_size(cache_dir / "kernels")[0] == 0
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING")}
    env["FORKPOINT_CACHE"] = str(cache_dir)
    # the server can import forkpoint from this checkout as `python bench/startup.py` runs it
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent.parent),
                                                      env.get("PYTHONPATH")]))
    options = ["--load-format", "dummy", "--device", args.device, "--served-model-name", SERVED_NAME,
               "--log-level", "info", *shlex.split(args.serve_options)]
    print(f"model {model_dir} ({'tiny' if args.tiny else 'Qwen3.5-35B-A3B'} shapes, dummy weights); cache "
          f"{cache_dir}{'' if cold else ' (NOT empty: the first start is not cold)'}; serve options {options}",
          flush=True)
    rows = [one_start(run, model_dir, options, env, cache_dir, workdir / f"serve_{run}.log", args)
            for run in ("cold", "warm")]
    if not cold:
        rows[0]["note"] = "the kernel cache was not empty: this start was not cold"

    import torch

    device = torch.cuda.get_device_name(0) if args.device != "cpu" and torch.cuda.is_available() else "cpu"
    applies = not args.tiny and device != "cpu"
    lines = verdicts(rows, applies)
    res = {"model": "tiny Qwen3.5-MoE" if args.tiny else "Qwen3.5-35B-A3B shapes (dummy bf16 weights)",
           "device": device, "serve_options": options, "cache_dir": str(cache_dir), "targets_s": TARGETS_S,
           "runs": rows, "verdicts": lines, "code": code_version(), "machine": machine_info()}
    print(f"\n{'start':<6} {'ready s':>8} {'imports s':>10} {'engine s':>9} {'server s':>9} {'1st req s':>10} "
          f"{'2nd req s':>10} {'cache MiB':>10}")
    for row in rows:
        print(f"{row['run']:<6} {row['ready_s']:>8.1f} {row['imports_s']:>10.1f} {row['engine_s']:>9.1f} "
              f"{row['server_s']:>9.1f} "
              f"{row['first_request_s']:>10.2f} {row['second_request_s']:>10.2f} "
              f"{row['kernel_cache_bytes'] / 2**20:>10.1f}")
    for row in rows:
        print(f"{row['run']} phases: " + ", ".join(f"{name} {s:.1f} s" for name, s in row["phases"].items()))
    print("\n".join(lines))
    name = args.name or f"startup_{'cuda' if device != 'cpu' else 'cpu'}{'_tiny' if args.tiny else ''}"
    print(f"results: {write_results(res, args.out, name, plot)}")
    return res


if __name__ == "__main__":
    main()
