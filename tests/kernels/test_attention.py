"""Paged KV writes and attention against dense float64 causal attention.

Caches start filled with NaN, so reading any slot that was not written (a wrong block, an offset
past seq_len) shows up as NaN in the output.
"""

import itertools

import pytest
import torch

from forkpoint.kernels.attention import copy_kv_slots, paged_attention, write_kv

FP32_REL_RMS = 1e-6


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def make_scenario(prefix_lens, q_lens, *, q_heads=4, kv_heads=2, head_dim=8, block_size=4, seed=0):
    """Random KV for every segment, paged into a NaN-poisoned cache through shuffled block tables.

    The prefixes are written first (an earlier step), then this step's tokens, as the runner does.
    Unused block-table entries point at a spare block that is never written.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + q for p, q in zip(prefix_lens, q_lens)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()
    spare = free.pop()
    block_tables = torch.full((len(seq_lens), max(blocks_per_seq)), spare, dtype=torch.int32)
    for n, count in enumerate(blocks_per_seq):
        block_tables[n, :count] = torch.tensor([free.pop() for _ in range(count)], dtype=torch.int32)

    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    keys = [torch.randn(n, kv_heads, head_dim, generator=gen) for n in seq_lens]
    values = [torch.randn(n, kv_heads, head_dim, generator=gen) for n in seq_lens]

    def slots(n, positions):
        positions = torch.as_tensor(positions, dtype=torch.long)
        return block_tables[n, positions // block_size].long() * block_size + positions % block_size

    for part in ("prefix", "new"):
        ranges = [range(p) if part == "prefix" else range(p, s) for p, s in zip(prefix_lens, seq_lens)]
        write_kv(
            k_cache,
            v_cache,
            torch.cat([keys[n][list(r)] for n, r in enumerate(ranges)]),
            torch.cat([values[n][list(r)] for n, r in enumerate(ranges)]),
            torch.cat([slots(n, list(r)) for n, r in enumerate(ranges)]),
        )
    cu_q = list(itertools.accumulate(q_lens, initial=0))
    return dict(
        q=torch.randn(cu_q[-1], q_heads, head_dim, generator=gen),
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        cu_seqlens_q=torch.tensor(cu_q),
        cu_seqlens_q_host=cu_q,
        seq_lens=torch.tensor(seq_lens),
        seq_lens_host=seq_lens,
    ), (keys, values, slots)


def dense_attention(q, keys, values, cu_q, seq_lens, scale):
    """Causal attention per segment in float64; q: [T, HQ, Dh], keys/values: per segment [L, HKV, Dh]."""
    outs = []
    for n, (a, b) in enumerate(zip(cu_q, cu_q[1:])):
        group = q.shape[1] // keys[n].shape[1]
        k = keys[n].double().repeat_interleave(group, dim=1)
        v = values[n].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[a:b].double(), k) * scale
        q_pos = torch.arange(seq_lens[n] - (b - a), seq_lens[n])
        scores = scores.masked_fill(torch.arange(seq_lens[n]) > q_pos[:, None], float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs)


PREFIX_LENS = [0, 17, 30, 7, 0, 12, 5]
Q_LENS = [5, 9, 1, 1, 1, 4, 0]  # prefill, prefill after a cached prefix, decodes, an idle segment


def test_write_kv_puts_each_token_at_its_slot():
    args, (keys, values, slots) = make_scenario(PREFIX_LENS, Q_LENS)
    flat_k = args["k_cache"].view(-1, *args["k_cache"].shape[2:])
    flat_v = args["v_cache"].view(-1, *args["v_cache"].shape[2:])
    for n, length in enumerate(args["seq_lens_host"]):
        s = slots(n, range(length))
        assert torch.equal(flat_k[s], keys[n]) and torch.equal(flat_v[s], values[n])
    assert flat_k.isnan().any(dim=(1, 2)).sum() == flat_k.shape[0] - sum(args["seq_lens_host"])


def test_paged_attention_matches_dense_for_prefix_prefill_and_decode():
    args, (keys, values, _) = make_scenario(PREFIX_LENS, Q_LENS, seed=1)
    scale = 8**-0.5
    o = paged_attention(**args, scale=scale)
    assert o.shape == args["q"].shape and o.dtype == args["q"].dtype and not o.isnan().any()
    ref = dense_attention(args["q"], keys, values, args["cu_seqlens_q_host"], args["seq_lens_host"], scale)
    assert rel_rms(o, ref) <= FP32_REL_RMS


def test_decode_equals_last_row_of_prefill_over_the_same_cache():
    args, _ = make_scenario([0], [9], seed=2)
    o_prefill = paged_attention(**args, scale=0.5)
    decode = args | {"q": args["q"][8:], "cu_seqlens_q": torch.tensor([0, 1]), "cu_seqlens_q_host": [0, 1]}
    o_decode = paged_attention(**decode, scale=0.5)
    assert rel_rms(o_decode, o_prefill[8:]) <= FP32_REL_RMS


def test_copy_kv_slots_makes_a_private_copy_of_a_partial_block():
    args, (keys, values, slots) = make_scenario([0], [6], seed=3)  # blocks of 4: one full, one partial
    table = args["block_tables"]
    fresh = next(b for b in range(args["k_cache"].shape[0]) if b not in table[0].tolist())
    src, dst = slots(0, [4, 5]), torch.tensor([fresh * 4, fresh * 4 + 1])
    copy_kv_slots(args["k_cache"], args["v_cache"], src, dst)
    flat_k = args["k_cache"].view(-1, *args["k_cache"].shape[2:])
    flat_v = args["v_cache"].view(-1, *args["v_cache"].shape[2:])
    assert torch.equal(flat_k[dst], keys[0][4:6]) and torch.equal(flat_v[dst], values[0][4:6])
    assert flat_k[fresh * 4 + 2 : fresh * 4 + 4].isnan().all()  # only the listed slots move
    o_shared = paged_attention(**args, scale=0.3)
    table[0, 1] = fresh
    assert torch.equal(paged_attention(**args, scale=0.3), o_shared)


def test_low_precision_cache_returns_query_dtype():
    args, (keys, values, _) = make_scenario([3, 10], [2, 1], seed=4)
    low = args | {name: args[name].bfloat16() for name in ("q", "k_cache", "v_cache")}
    o = paged_attention(**low, scale=0.4)
    assert o.dtype == torch.bfloat16
    keys, values = [k.bfloat16() for k in keys], [v.bfloat16() for v in values]
    ref = dense_attention(low["q"], keys, values, args["cu_seqlens_q_host"], args["seq_lens_host"], 0.4)
    assert rel_rms(o, ref) <= 1e-2


def test_rejects_seq_len_shorter_than_queries():
    args, _ = make_scenario([0], [3], seed=5)
    args["seq_lens_host"] = [2]
    with pytest.raises(ValueError, match="must be >= its 3 queries"):
        paged_attention(**args, scale=1.0)


def test_long_prefill_runs_its_queries_in_chunks_with_the_same_result(monkeypatch):
    """Scores are materialised per query chunk (reference.SCORE_BYTES), so a long prompt's prefill
    stays within a budget; the chunks give the one-pass result."""
    from forkpoint.kernels.attention import reference

    args, (keys, values, _) = make_scenario([6, 0], [37, 21], seed=3)
    whole = paged_attention(**args, scale=0.3)
    passes = []
    einsum = torch.einsum

    def counting(equation, *operands):
        if equation == "qhgd,khd->hgqk":
            passes.append(operands[0].shape[0])
        return einsum(equation, *operands)

    monkeypatch.setattr(reference, "SCORE_BYTES", 4 * 4 * 43 * 5)  # 5 queries over 43 keys, 10 over 21
    monkeypatch.setattr(reference.torch, "einsum", counting)
    chunked = paged_attention(**args, scale=0.3)
    assert passes == [5] * 7 + [2] + [10, 10, 1]
    assert rel_rms(chunked, whole) <= FP32_REL_RMS
    ref = dense_attention(args["q"], keys, values, args["cu_seqlens_q_host"], args["seq_lens_host"], 0.3)
    assert rel_rms(chunked, ref) <= FP32_REL_RMS
