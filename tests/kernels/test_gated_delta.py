"""Gated delta rule kernels against the token-by-token recurrence (float64) and transformers."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from forkpoint.kernels import select_variant
from forkpoint.kernels.gated_delta import (
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
    recurrent_gated_delta_rule_inplace,
    reference,
)

FP32_REL_RMS = 1e-5  # float32 kernel vs float64 recurrence


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def offsets(lens: list[int]) -> list[int]:
    return list(itertools.accumulate(lens, initial=0))


def make_inputs(lens, *, heads=2, v_heads=4, head_k=16, head_v=8, seed=0):
    """Random packed inputs with Qwen-like ranges: g = -softplus(.) spans strong and weak decay."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    return dict(
        q=torch.randn(t, heads, head_k, generator=gen),
        k=torch.randn(t, heads, head_k, generator=gen),
        v=torch.randn(t, v_heads, head_v, generator=gen),
        g=-F.softplus(2 * torch.randn(t, v_heads, generator=gen)),
        beta=torch.sigmoid(torch.randn(t, v_heads, generator=gen)),
        initial_state=0.5 * torch.randn(len(lens), v_heads, head_k, head_v, generator=gen),
    )


def naive_gated_delta(q, k, v, g, beta, state, *, scale=None, use_qk_l2norm=True):
    """The recurrence of one segment, one token at a time, in float64.

    q, k: [L, H, K]; v: [L, HV, V]; g, beta: [L, HV]; state: [HV, K, V]. Returns (o [L, HV, V], state).
    """
    q, k, v, g, beta, s = (x.double() for x in (q, k, v, g, beta, state))
    if use_qk_l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    outs = []
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        delta = beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], s))
        s = s + k[t][:, :, None] * delta[:, None, :]
        outs.append(scale * torch.einsum("hk,hkv->hv", q[t], s))
    o = torch.stack(outs) if outs else v.new_empty(v.shape)
    return o, s


def run_chunk(inputs, lens, **kwargs):
    cu = offsets(lens)
    return chunk_gated_delta_rule(**inputs, cu_seqlens=torch.tensor(cu), cu_seqlens_host=cu, **kwargs)


def assert_matches_naive(inputs, lens, o, final_state, tol=FP32_REL_RMS, **kwargs):
    assert not o.isnan().any() and not final_state.isnan().any()
    cu = offsets(lens)
    for n, (a, b) in enumerate(zip(cu, cu[1:])):
        seg = {name: x[a:b] for name, x in inputs.items() if name != "initial_state"}
        o_ref, s_ref = naive_gated_delta(**seg, state=inputs["initial_state"][n], **kwargs)
        if b > a:
            assert rel_rms(o[a:b], o_ref) <= tol, f"segment {n} (length {b - a}) output"
        assert rel_rms(final_state[n], s_ref) <= tol, f"segment {n} (length {b - a}) final state"


LENS = [1, 0, 64, 65, 130, 3, 200]  # single token, empty, exact chunk, chunk + 1, > 2 chunks, short


def test_chunk_matches_token_recurrence_on_packed_batch():
    inputs = make_inputs(LENS)
    o, final_state = run_chunk(inputs, LENS)
    assert o.shape == inputs["v"].shape and o.dtype == torch.float32
    assert final_state.shape == inputs["initial_state"].shape and final_state.dtype == torch.float32
    assert_matches_naive(inputs, LENS, o, final_state)


def test_chunk_matches_transformers_single_sequence():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    lens = [150]
    inputs = make_inputs(lens, seed=1)
    o, final_state = run_chunk(inputs, lens)
    o_hf, s_hf = torch_chunk_gated_delta_rule(
        *(inputs[name][None] for name in ("q", "k", "v", "g", "beta")),
        initial_state=inputs["initial_state"],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    assert rel_rms(o, o_hf[0]) <= 1e-6
    assert rel_rms(final_state, s_hf) <= 1e-6


def test_packed_batch_equals_each_segment_alone():
    inputs = make_inputs(LENS, seed=2)
    o, final_state = run_chunk(inputs, LENS)
    cu = offsets(LENS)
    for n, (a, b) in enumerate(zip(cu, cu[1:])):
        alone = {name: x[a:b] for name, x in inputs.items() if name != "initial_state"}
        o_n, s_n = run_chunk({**alone, "initial_state": inputs["initial_state"][n : n + 1]}, [b - a])
        assert rel_rms(o[a:b], o_n) <= 1e-6 if b > a else o_n.numel() == 0
        assert rel_rms(final_state[n], s_n[0]) <= 1e-6


def test_empty_segments_return_initial_state_unchanged():
    lens = [0, 5, 0]
    inputs = make_inputs(lens, seed=3)
    _, final_state = run_chunk(inputs, lens)
    assert torch.equal(final_state[0], inputs["initial_state"][0])
    assert torch.equal(final_state[2], inputs["initial_state"][2])
    assert not torch.equal(final_state[1], inputs["initial_state"][1])

    empty = make_inputs([0, 0], seed=4)
    o, final_state = run_chunk(empty, [0, 0])
    assert o.shape == (0, 4, 8) and torch.equal(final_state, empty["initial_state"])


def test_recurrent_matches_token_recurrence_and_transformers():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    inputs = make_inputs([1] * 6, seed=5)
    o, final_state = recurrent_gated_delta_rule(**inputs)
    assert_matches_naive(inputs, [1] * 6, o, final_state)

    o_hf, s_hf = torch_recurrent_gated_delta_rule(
        *(inputs[name][:, None] for name in ("q", "k", "v", "g", "beta")),
        initial_state=inputs["initial_state"],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    assert rel_rms(o, o_hf[:, 0]) <= 1e-6 and rel_rms(final_state, s_hf) <= 1e-6


def test_chunk_of_single_tokens_equals_recurrent():
    lens = [1] * 7
    inputs = make_inputs(lens, seed=6)
    o_chunk, s_chunk = run_chunk(inputs, lens)
    o_rec, s_rec = recurrent_gated_delta_rule(**inputs)
    assert rel_rms(o_chunk, o_rec) <= 1e-6 and rel_rms(s_chunk, s_rec) <= 1e-6


def test_prefill_then_decode_equals_one_longer_prefill():
    lens = [70, 33]
    inputs = make_inputs([71, 34], seed=7)
    cu_long = offsets([71, 34])
    last = [cu_long[1] - 1, cu_long[2] - 1]
    keep = [i for i in range(cu_long[-1]) if i not in last]
    prefix = {name: x[keep] for name, x in inputs.items() if name != "initial_state"}
    o_pre, s_pre = run_chunk({**prefix, "initial_state": inputs["initial_state"]}, lens)
    step = {name: x[last] for name, x in inputs.items() if name != "initial_state"}
    o_dec, s_dec = recurrent_gated_delta_rule(**step, initial_state=s_pre)
    o_all, s_all = run_chunk(inputs, [71, 34])
    assert rel_rms(o_dec, o_all[last]) <= 1e-5 and rel_rms(s_dec, s_all) <= 1e-5
    assert rel_rms(o_pre, o_all[keep]) <= 1e-6


def test_explicit_scale_without_l2norm_and_small_chunks():
    lens = [40, 17, 1]
    inputs = make_inputs(lens, seed=8)
    # Without normalisation the delta rule is stable only for beta * |k|^2 < 2: keep |k| near 1.
    inputs["k"] = inputs["k"] / inputs["k"].shape[-1] ** 0.5
    kwargs = dict(scale=0.3, use_qk_l2norm=False)
    o, final_state = run_chunk(inputs, lens, chunk_size=16, **kwargs)
    assert_matches_naive(inputs, lens, o, final_state, **kwargs)


def test_low_precision_inputs_keep_fp32_state():
    lens = [30, 9]
    inputs = make_inputs(lens, seed=9)
    low = {name: x.bfloat16() if name in ("q", "k", "v", "beta") else x for name, x in inputs.items()}
    o, final_state = run_chunk(low, lens)
    assert o.dtype == torch.bfloat16 and final_state.dtype == torch.float32
    o_ref, s_ref = run_chunk({name: x.float() for name, x in low.items()}, lens)
    assert rel_rms(o, o_ref) <= 1e-2 and rel_rms(final_state, s_ref) <= 1e-6


@settings(max_examples=20, deadline=None)
@given(
    lens=st.lists(st.integers(min_value=0, max_value=140), min_size=1, max_size=4),
    chunk_size=st.sampled_from([16, 64]),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_chunk_matches_recurrence_for_random_lengths(lens, chunk_size, seed):
    inputs = make_inputs(lens, seed=seed)
    o, final_state = run_chunk(inputs, lens, chunk_size=chunk_size)
    assert_matches_naive(inputs, lens, o, final_state)


@pytest.mark.parametrize(
    "cu_host, match",
    [([0, 5], "from 0 to"), ([1, 10], "from 0 to"), ([0, 6, 4, 10], "non-decreasing")],
)
def test_rejects_bad_offsets(cu_host, match):
    inputs = make_inputs([10], seed=10)
    inputs["initial_state"] = inputs["initial_state"].expand(len(cu_host) - 1, -1, -1, -1)
    with pytest.raises(ValueError, match=match):
        chunk_gated_delta_rule(**inputs, cu_seqlens=torch.tensor(cu_host), cu_seqlens_host=cu_host)


def test_rejects_heads_that_do_not_group():
    inputs = make_inputs([4], heads=3, v_heads=4)
    with pytest.raises(ValueError, match="multiple of H"):
        run_chunk(inputs, [4])


def test_cpu_tensors_dispatch_to_reference():
    assert select_variant("gated_delta", "fla", on_cuda=False) is reference
    assert select_variant("gated_delta", "triton", on_cuda=False) is reference


def _pool_case(n, *, pool_rows, seed, **heads):
    """Decode inputs for n sequences plus a pool with a zero row 0 and distinct target rows (gaps, shuffled)."""
    inputs = make_inputs([1] * n, seed=seed, **heads)
    gen = torch.Generator().manual_seed(seed + 1)
    pool = 0.5 * torch.randn(pool_rows, *inputs.pop("initial_state").shape[1:], generator=gen)
    pool[0] = 0
    slots = torch.randperm(pool_rows - 1, generator=gen)[:n] + 1
    return inputs, pool, slots


@pytest.mark.parametrize("n,heads,v_heads", [(1, 2, 2), (5, 2, 4), (9, 1, 4)])
def test_inplace_step_equals_gather_step_scatter(n, heads, v_heads):
    inputs, pool, slots = _pool_case(n, pool_rows=2 * n + 3, seed=20 + n, heads=heads, v_heads=v_heads)
    o_old, new_state = recurrent_gated_delta_rule(**inputs, initial_state=pool.index_select(0, slots))
    expected = pool.clone().index_copy_(0, slots, new_state)
    untouched = torch.ones(len(pool), dtype=torch.bool)
    untouched[slots] = False
    before = pool.clone()

    o = recurrent_gated_delta_rule_inplace(**inputs, state_pool=pool, slots=slots)
    assert torch.equal(o, o_old) and torch.equal(pool, expected)
    assert torch.equal(pool[untouched], before[untouched]) and not torch.equal(pool[slots], before[slots])
    assert_matches_naive({**inputs, "initial_state": before[slots]}, [1] * n, o, pool[slots])


def test_inplace_step_keeps_options_and_dtype():
    inputs, pool, slots = _pool_case(3, pool_rows=6, seed=30)
    inputs["k"] = inputs["k"] / inputs["k"].shape[-1] ** 0.5
    low = {name: x.bfloat16() if name in ("q", "k", "v", "beta") else x for name, x in inputs.items()}
    kwargs = dict(scale=0.3, use_qk_l2norm=False)
    o_old, new_state = recurrent_gated_delta_rule(**low, initial_state=pool[slots], **kwargs)
    o = recurrent_gated_delta_rule_inplace(**low, state_pool=pool, slots=slots, **kwargs)
    assert o.dtype == torch.bfloat16 and torch.equal(o, o_old) and torch.equal(pool[slots], new_state)


def test_inplace_step_writes_into_out():
    inputs, pool, slots = _pool_case(3, pool_rows=6, seed=32)
    expected = recurrent_gated_delta_rule_inplace(**inputs, state_pool=pool.clone(), slots=slots)
    buffer = torch.full((5, *expected.shape[1:]), float("nan"))
    o = recurrent_gated_delta_rule_inplace(**inputs, state_pool=pool, slots=slots, out=buffer[1:4])
    assert o.data_ptr() == buffer[1:4].data_ptr() and torch.equal(buffer[1:4], expected)
    assert buffer[0].isnan().all() and buffer[4].isnan().all()
    with pytest.raises(ValueError, match="contiguous"):
        recurrent_gated_delta_rule_inplace(**inputs, state_pool=pool, slots=slots, out=buffer[:3].transpose(1, 2))


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda pool, slots: (pool.double(), slots), "float32"),
        (lambda pool, slots: (pool[:, :, :, :4], slots), r"\[S, HV, K, V\]"),
        (lambda pool, slots: (pool, slots.int()), "LongTensor"),
        (lambda pool, slots: (pool, slots[:2]), "LongTensor"),
    ],
)
def test_inplace_step_rejects_bad_pool_or_slots(change, match):
    inputs, pool, slots = _pool_case(3, pool_rows=6, seed=31)
    pool, slots = change(pool, slots)
    with pytest.raises(ValueError, match=match):
        recurrent_gated_delta_rule_inplace(**inputs, state_pool=pool, slots=slots)
