"""Causal depthwise conv kernels against a per-token float64 definition and transformers."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from forkpoint.kernels.conv1d import causal_conv1d_step, causal_conv1d_step_inplace, causal_conv1d_varlen

FP32_REL_RMS = 1e-6


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def offsets(lens: list[int]) -> list[int]:
    return list(itertools.accumulate(lens, initial=0))


def make_inputs(lens, *, dim=12, width=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return dict(
        x=torch.randn(sum(lens), dim, generator=gen),
        weight=torch.randn(dim, width, generator=gen),
        bias=torch.randn(dim, generator=gen),
        initial_state=torch.randn(len(lens), dim, width - 1, generator=gen),
    )


def naive_conv(x, weight, bias, state, activation="silu"):
    """One segment, token by token, float64. x: [L, D]; state: [D, W-1]. Returns (y [L, D], state)."""
    inputs = [c for c in state.double().T] + list(x.double())  # oldest first
    hist = weight.shape[1] - 1
    ys = []
    for t in range(x.shape[0]):
        window = torch.stack(inputs[t : t + hist + 1], dim=1)  # [D, W]
        y = (window * weight.double()).sum(1) + (0 if bias is None else bias.double())
        ys.append(F.silu(y) if activation == "silu" else y)
    y = torch.stack(ys) if ys else x.double()
    return y, torch.stack(inputs[-hist:], dim=1)


def run_varlen(inputs, lens, **kwargs):
    cu = offsets(lens)
    return causal_conv1d_varlen(**inputs, cu_seqlens=torch.tensor(cu), cu_seqlens_host=cu, **kwargs)


def assert_matches_naive(inputs, lens, y, final_state, activation="silu"):
    assert not y.isnan().any() and not final_state.isnan().any()
    cu = offsets(lens)
    for n, (a, b) in enumerate(zip(cu, cu[1:])):
        y_ref, s_ref = naive_conv(
            inputs["x"][a:b], inputs["weight"], inputs["bias"], inputs["initial_state"][n], activation
        )
        if b > a:
            assert rel_rms(y[a:b], y_ref) <= FP32_REL_RMS, f"segment {n} (length {b - a}) output"
        # The final state is a copy of inputs: exact.
        assert torch.equal(final_state[n].double(), s_ref), f"segment {n} (length {b - a}) final state"


LENS = [1, 0, 2, 3, 5, 17, 70]  # shorter than W-1, empty, exactly W-1, longer


def test_varlen_matches_definition():
    inputs = make_inputs(LENS)
    y, final_state = run_varlen(inputs, LENS)
    assert y.shape == inputs["x"].shape and final_state.shape == inputs["initial_state"].shape
    assert_matches_naive(inputs, LENS, y, final_state)


def test_varlen_split_returns_the_channel_groups_contiguous():
    inputs = make_inputs(LENS, seed=2)
    y, final_state = run_varlen(inputs, LENS)
    dim = y.shape[1]
    split = (dim // 4, dim // 4, dim - 2 * (dim // 4))
    parts, split_state = run_varlen(inputs, LENS, split=split)
    assert [tuple(p.shape) for p in parts] == [(y.shape[0], n) for n in split]
    assert all(p.is_contiguous() for p in parts)
    assert torch.equal(torch.cat(parts, dim=1), y) and torch.equal(split_state, final_state)
    for bad in ((dim,) * 2, (dim - 1,), (1, 1, 1, dim - 3), (0, dim)):
        with pytest.raises(ValueError, match="split"):
            run_varlen(inputs, LENS, split=bad)


def test_varlen_without_activation_or_bias():
    inputs = make_inputs(LENS, seed=1) | {"bias": None}
    y, final_state = run_varlen(inputs, LENS, activation=None)
    assert_matches_naive(inputs, LENS, y, final_state, activation=None)


def test_varlen_matches_transformers_update():
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_update

    inputs = make_inputs([9, 2], seed=2)
    y, final_state = run_varlen(inputs, [9, 2])
    for n, (a, b) in enumerate([(0, 9), (9, 11)]):
        state = inputs["initial_state"][n : n + 1].clone()  # updated in place by transformers
        y_hf = causal_conv1d_update(
            inputs["x"][a:b].T[None].contiguous(), state, inputs["weight"], inputs["bias"], activation="silu"
        )
        assert rel_rms(y[a:b], y_hf[0].T) <= FP32_REL_RMS
        assert torch.equal(final_state[n], state[0])


def test_step_matches_definition_and_varlen_of_single_tokens():
    lens = [1] * 5
    inputs = make_inputs(lens, seed=3)
    y, state = causal_conv1d_step(inputs["x"], inputs["weight"], inputs["bias"], inputs["initial_state"])
    assert_matches_naive(inputs, lens, y, state)
    y_var, state_var = run_varlen(inputs, lens)
    assert rel_rms(y, y_var) <= FP32_REL_RMS and torch.equal(state, state_var)


def test_inplace_step_on_pool_rows_equals_gather_step_scatter():
    """Rows `slots` of the pool get the step's new state, every other row stays bit-identical; x may
    be a column view of a wider projection (row-strided)."""
    inputs = make_inputs([1] * 4, seed=11)
    gen = torch.Generator().manual_seed(12)
    pool = torch.randn(9, 12, 3, generator=gen)
    slots = torch.tensor([7, 2, 5, 0])
    wide = torch.cat([inputs["x"], torch.randn(4, 5, generator=gen)], dim=1)
    x = wide[:, :12]
    y_ref, state_ref = causal_conv1d_step(x.contiguous(), inputs["weight"], inputs["bias"], pool[slots])
    expected = pool.clone().index_copy_(0, slots, state_ref)
    y = causal_conv1d_step_inplace(x, inputs["weight"], inputs["bias"], pool, slots)
    assert torch.equal(y, y_ref) and torch.equal(pool, expected)
    with pytest.raises(ValueError, match="slots"):
        causal_conv1d_step_inplace(x, inputs["weight"], inputs["bias"], pool, slots[:2])


def test_prefill_then_steps_equals_one_prefill():
    inputs = make_inputs([10], seed=4)
    y_all, s_all = run_varlen(inputs, [10])
    y_pre, state = run_varlen({**inputs, "x": inputs["x"][:7]}, [7])
    ys = [y_pre]
    for t in range(7, 10):
        y_t, state = causal_conv1d_step(inputs["x"][t : t + 1], inputs["weight"], inputs["bias"], state)
        ys.append(y_t)
    assert rel_rms(torch.cat(ys), y_all) <= FP32_REL_RMS and torch.equal(state, s_all)


def test_low_precision_input_keeps_dtypes():
    inputs = make_inputs([6, 3], seed=5)
    low = inputs | {"x": inputs["x"].bfloat16()}
    y, final_state = run_varlen(low, [6, 3])
    assert y.dtype == torch.bfloat16 and final_state.dtype == torch.float32
    y_ref, _ = run_varlen(low | {"x": low["x"].float()}, [6, 3])
    assert rel_rms(y, y_ref) <= 1e-2


@settings(max_examples=20, deadline=None)
@given(
    lens=st.lists(st.integers(min_value=0, max_value=12), min_size=1, max_size=5),
    width=st.integers(min_value=2, max_value=5),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_varlen_matches_definition_for_random_lengths(lens, width, seed):
    inputs = make_inputs(lens, width=width, seed=seed)
    y, final_state = run_varlen(inputs, lens)
    assert_matches_naive(inputs, lens, y, final_state)


def test_rejects_state_of_wrong_width():
    inputs = make_inputs([4], seed=6)
    inputs["initial_state"] = inputs["initial_state"][..., :2]
    with pytest.raises(ValueError, match=r"\[N, D, W-1\]"):
        run_varlen(inputs, [4])
