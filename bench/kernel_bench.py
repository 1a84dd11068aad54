"""The frame every GPU kernel benchmark shares (bench/moe_kernel.py, dense_kernel.py, conv_kernel.py):
its common options, and the header of its results (device, versions, command, code version)."""

from __future__ import annotations

import argparse
import sys

import host_info
import torch


def parser(doc: str, name: str, rep: float) -> argparse.ArgumentParser:
    """--out (results folder), --name (file stem, default `name`), --rep (timing repetition, ms,
    default `rep`); the description is the first line of the benchmark's docstring `doc`."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--name", default=name)
    ap.add_argument("--rep", type=float, default=rep, help="timing repetition time per measurement, ms")
    return ap


def add_sweep_options(ap: argparse.ArgumentParser, shapes, no_sweep_help: str) -> None:
    """--shapes (a subset of `shapes`' keys), --no-sweep (args.sweep False: `no_sweep_help`), --seed."""
    ap.add_argument("--shapes", nargs="+", default=list(shapes), choices=list(shapes))
    ap.add_argument("--no-sweep", dest="sweep", action="store_false", help=no_sweep_help)
    ap.add_argument("--seed", type=int, default=0)


def results_header(args: argparse.Namespace, **fields) -> dict:
    """The results dict's common fields, then `fields`, args and an empty `rows`; exits when there is
    no CUDA device (these benchmarks time GPU kernels only)."""
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    import triton

    return {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
            "command": " ".join(sys.argv), **host_info.code_version(), **fields, "args": dict(vars(args)),
            "rows": []}
