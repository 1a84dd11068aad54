"""Packages import downward only: config and value types, then kernels and cache, then models and
inputs, then runner, then engine and distributed, then llm.py, then the server. Imports under
`if TYPE_CHECKING:` (annotations only, never run) are not counted."""

from __future__ import annotations

import ast
from pathlib import Path

import forkpoint

RANK = {"config": 0, "mamba2_config": 0, "vision_config": 0, "quantization_config": 0, "speculative_config": 0,
        "structured_outputs_config": 0, "sampling_params": 0, "outputs": 0, "step": 1, "kernels": 1, "cache": 1,
        "models": 2, "inputs": 2, "structured": 2, "runner": 3, "engine": 4, "distributed": 4, "llm": 5, "server": 6,
        "demo": 6,
        "__init__": 7}
ROOT = Path(forkpoint.__file__).parent


def runtime_imports(tree: ast.AST):
    """(line, module) of every import not inside an `if TYPE_CHECKING:` block."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            skipped.update(id(child) for child in ast.walk(node))
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name


def test_every_module_has_a_rank():
    unranked = {p.relative_to(ROOT).with_suffix("").parts[0] for p in ROOT.rglob("*.py")} - set(RANK)
    assert not unranked, f"give these a place in the layering: {sorted(unranked)}"


def test_no_import_runs_upward():
    upward = []
    for path in sorted(ROOT.rglob("*.py")):
        source = RANK[path.relative_to(ROOT).with_suffix("").parts[0]]
        for line, module in runtime_imports(ast.parse(path.read_text())):
            parts = module.split(".")
            if parts[0] == "forkpoint" and len(parts) > 1 and RANK[parts[1]] > source:
                upward.append(f"{path.relative_to(ROOT.parent)}:{line} imports {module}")
    assert not upward, "imports that run upward:\n" + "\n".join(upward)


def test_the_engine_touches_no_tensor():
    """The runner samples and scores (runner/step_sampler.py): the engine imports neither torch nor
    the sampler nor the prompt scorer. The builder, the composition root, is the one exception for
    torch (it seeds it and names the device and dtype)."""
    found = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        for line, module in runtime_imports(ast.parse(path.read_text())):
            if module in ("forkpoint.runner.sampler", "forkpoint.runner.prompt_logprobs"):
                found.append(f"{path.relative_to(ROOT.parent)}:{line} imports {module}")
            if module.split(".")[0] in ("torch", "numpy") and path.name != "builder.py":
                found.append(f"{path.relative_to(ROOT.parent)}:{line} imports {module}")
    assert not found, "tensor work above the runner:\n" + "\n".join(found)


def test_cache_imports_no_torch():
    """cache/ is bookkeeping (ids, counts, the checkpoint life cycle): the tensors are the runner's."""
    found = [f"{path.relative_to(ROOT.parent)}:{line} imports {module}"
             for path in sorted((ROOT / "cache").rglob("*.py"))
             for line, module in runtime_imports(ast.parse(path.read_text()))
             if module.split(".")[0] == "torch"]
    assert not found, "cache/ imports torch:\n" + "\n".join(found)


# the packages that own device tensors; every other package writes device memory only through the
# step plan (step/plan.py), which the runner applies
TENSOR_OWNERS = {"runner", "models", "kernels", "distributed"}
# structured/bitmask.py masks a step's logits rows for the runner's sampler: no cache memory
IN_PLACE_ALLOWED = {"structured/bitmask.py"}
POOL_TENSORS = {"k", "v", "conv", "ssm", "conv_stack", "ssm_stack"}


def test_only_the_tensor_owners_write_device_memory():
    """Outside runner/, models/, kernels/ and distributed/, no module calls a tensor's in-place copy
    (`copy_`, `index_copy_`) or indexes a device pool's tensors (`.k[...]`, `.conv_stack[...]`, ...)."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        if name.split("/")[0] in TENSOR_OWNERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("copy_", "index_copy_") and name not in IN_PLACE_ALLOWED):
                found.append(f"{name}:{node.lineno} calls {node.func.attr}")
            if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute)
                    and node.value.attr in POOL_TENSORS):
                found.append(f"{name}:{node.lineno} indexes .{node.value.attr}")
    assert not found, "device writes outside the tensor owners (put them in the step plan):\n" + "\n".join(found)
