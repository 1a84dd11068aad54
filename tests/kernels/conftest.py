"""Fixtures shared by the kernel tests."""

import pytest
import torch


@pytest.fixture
def poison(monkeypatch):
    """While active, every torch.empty / empty_like / Tensor.new_empty returns a float tensor
    filled with NaN (ints untouched): any output element a kernel forgets to write stays NaN."""

    def nan_filled(factory):
        def make(*args, **kwargs):
            t = factory(*args, **kwargs)
            if t.is_floating_point():
                t.fill_(float("nan"))
            return t

        return make

    monkeypatch.setattr(torch, "empty", nan_filled(torch.empty))
    monkeypatch.setattr(torch, "empty_like", nan_filled(torch.empty_like))
    monkeypatch.setattr(torch.Tensor, "new_empty", nan_filled(torch.Tensor.new_empty))
    assert torch.isnan(torch.empty(8, dtype=torch.bfloat16)).all()


@pytest.fixture
def force_moe_path(monkeypatch):
    """force_moe_path("tiled" | "grouped_mm"): the routed experts of every step take that path
    (the tile table extended to any routes per expert, or emptied) while the test runs."""
    import math

    tiled = pytest.importorskip("forkpoint.kernels.moe.tiled")

    def force(path: str) -> None:
        if path == "tiled":
            last = tiled.TILES[-1]._replace(max_routes_per_expert=math.inf)
            monkeypatch.setattr(tiled, "TILES", tiled.TILES[:-1] + (last,))
        else:
            monkeypatch.setattr(tiled, "TILES", ())

    return force
