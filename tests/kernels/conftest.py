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
