"""Summary of one GPU check (bench/run_gpu_check.sh): a table of model family x test kind with passed /
failed / skipped counts, then the measured values the tests printed (GPU_* lines), then every failure's
first lines. Reads the JUnit XML that pytest wrote with `-o junit_logging=system-out`.

    python3 bench/gpu_check_summary.py gpu_check.xml [--markdown]
"""

from __future__ import annotations

import argparse
import re
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass

FAMILIES = ("qwen3_5_moe_text", "qwen3_5_text", "qwen3_next", "nemotron_h", "granitemoehybrid", "falcon_h1")
# files whose tests run one tiny model without a family parameter: the model they build
FILE_FAMILY = {
    "test_gpu_cuda_graphs": "qwen3_5_moe_text",
    "test_gpu_decode_graphs": "qwen3_5_moe_text",
    "test_gpu_verify_graphs": "qwen3_5_moe_text",
    "test_gpu_async_scheduling": "qwen3_5_moe_text",
    "test_gpu_gated_attention": "qwen3_5_moe_text",
}
VISION_FAMILY = "qwen3_5_moe (vision)"


@dataclass(frozen=True)
class Outcome:
    family: str
    kind: str
    name: str
    status: str  # passed, failed, skipped
    output: str  # captured stdout
    message: str  # failure or skip message


def classify(classname: str, name: str) -> tuple[str, str]:
    """(family, kind) of one test case: the family from its parameter, its name or its file; the kind
    from its file (`tests.models.test_gpu_mamba2` -> `models/mamba2`)."""
    parts = classname.split(".")
    module = next((p for p in parts if p.startswith("test_")), parts[-1])
    package = parts[parts.index(module) - 1] if module in parts and parts.index(module) > 0 else ""
    kind = f"{package}/{module.removeprefix('test_gpu_').removeprefix('test_')}"
    params = re.search(r"\[(.*)\]", name)
    for family in FAMILIES:
        if params and family in params.group(1):
            return family, kind
    if "image" in name:
        return VISION_FAMILY, kind
    if package == "kernels" or module not in FILE_FAMILY:
        return "kernels and ops", kind
    return FILE_FAMILY[module], kind


def read(path: str) -> list[Outcome]:
    outcomes = []
    for case in ET.parse(path).getroot().iter("testcase"):
        family, kind = classify(case.get("classname", ""), case.get("name", ""))
        status, message = "passed", ""
        for tag in ("failure", "error"):
            node = case.find(tag)
            if node is not None:
                status, message = "failed", (node.get("message") or node.text or "").strip()
        skipped = case.find("skipped")
        if skipped is not None:
            status, message = "skipped", (skipped.get("message") or "").strip()
        out = case.find("system-out")
        outcomes.append(Outcome(family, kind, case.get("name", ""), status, out.text or "" if out is not None else "",
                                message))
    return outcomes


def table(outcomes: list[Outcome]) -> list[str]:
    counts: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for o in outcomes:
        counts[(o.family, o.kind)][o.status] += 1
    lines = ["| family | test kind | passed | failed | skipped |", "|---|---|---|---|---|"]
    for (family, kind), c in sorted(counts.items()):
        flag = " **FAILED**" if c["failed"] else ""
        lines.append(f"| {family} | {kind} | {c['passed']} | {c['failed']}{flag} | {c['skipped']} |")
    total = defaultdict(int)
    for o in outcomes:
        total[o.status] += 1
    lines.append(f"| all | | {total['passed']} | {total['failed']} | {total['skipped']} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("xml", help="pytest's JUnit XML")
    args = parser.parse_args(argv)
    outcomes = read(args.xml)
    print("\n".join(table(outcomes)))
    print("\nMeasured (lines the tests printed):")
    for o in outcomes:
        for line in o.output.splitlines():
            if line.startswith("GPU_") or "REL_RMS" in line:
                print(f"  {line.strip()[:300]}")
    failed = [o for o in outcomes if o.status == "failed"]
    if failed:
        print("\nFailures:")
        for o in failed:
            print(f"  {o.family} {o.kind} {o.name}: {' '.join(o.message.split())[:400]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
