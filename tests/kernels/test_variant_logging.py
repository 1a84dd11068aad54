"""The kernel dispatch says which variant runs, and warns when CUDA would run a reference op."""

from __future__ import annotations

import importlib
import logging
import sys

import pytest

from forkpoint import kernels


def test_off_cuda_every_op_is_the_reference():
    variants = kernels.kernel_variants(on_cuda=False)
    assert set(variants) >= {"attention", "conv1d", "moe/grouped", "moe/router", "gated_delta/fla",
                             "gated_delta/triton", "ssd/fla", "ssd/triton"}
    assert set(variants.values()) == {"reference"}


def test_a_missing_gpu_dependency_is_a_warning_naming_it(monkeypatch, caplog):
    real_import = importlib.import_module

    def without_fla(name, *args):
        if name == "forkpoint.kernels.gated_delta.fla":
            raise ModuleNotFoundError("No module named 'fla'", name="fla")
        return real_import(name, *args)

    monkeypatch.setattr(kernels.importlib, "import_module", without_fla)
    monkeypatch.delitem(sys.modules, "forkpoint.kernels.gated_delta.fla", raising=False)
    kernels.select_variant.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="forkpoint.kernels"):
            module = kernels.select_variant("gated_delta", "fla", True)
    finally:
        kernels.select_variant.cache_clear()
    assert module.__name__ == "forkpoint.kernels.gated_delta.reference"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "'fla' is not installed" in warnings[0].getMessage()
    assert "gated_delta" in warnings[0].getMessage()


@pytest.mark.gpu
def test_on_cuda_the_choice_is_logged(caplog):
    kernels.select_variant.cache_clear()
    with caplog.at_level(logging.INFO, logger="forkpoint.kernels"):
        variants = kernels.kernel_variants(on_cuda=True)
    logged = " ".join(r.getMessage() for r in caplog.records)
    for name in variants:
        assert f"kernel {name.split('/')[0]}:" in logged
