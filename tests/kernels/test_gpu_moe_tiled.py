"""The routed experts as Triton tiles (`forkpoint.kernels.moe.tiled`) against the reference (CUDA only).

Every entry of the shipped tile table (`tiled.TILES`), forced on steps of every size (so each configuration is
checked, not only the one its route range would pick), on fresh random bf16 inputs: a few hit
experts and many empty ones, fewer routes than experts, K not a multiple of BLOCK_K (the masked
loop), the Nemotron-3-Nano hidden size. Outputs are NaN-poisoned (`poison`, tests/kernels/conftest.py).
The reference is `reference.fused_moe*`'s per-expert math in fp32 on the CPU.
"""

import math

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = "cuda"
TOL = 1e-2  # relative RMS for bf16 operands, as in test_gpu_kernels.py


def rel_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    return ((out - ref).norm() / ref.norm()).item()


def make_case(t, e, top_k, hidden, inter, gated, seed, hit=None):
    """x [t, hidden], w1, w2 (bf16, CUDA) and routes (top-k of random logits, only the first `hit`
    experts reachable when given)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(t, hidden, generator=gen, device=DEV).bfloat16()
    w1 = (torch.randn(e, (2 if gated else 1) * inter, hidden, generator=gen, device=DEV) / math.sqrt(hidden))
    w2 = torch.randn(e, hidden, inter, generator=gen, device=DEV) / math.sqrt(inter)
    logits = torch.randn(t, e, generator=gen, device=DEV)
    if hit is not None:
        logits[:, hit:] -= 100.0
    weights, ids = logits.softmax(-1).topk(top_k)
    return x, w1.bfloat16(), w2.bfloat16(), weights, ids


def expected_rows(x, w1, w2, ids, gated):
    """ys [T*k, Hd] fp32 on the CPU in the sorted-route order (stable sort of the flat expert ids)."""
    x, w1, w2, ids = (v.cpu() for v in (x, w1, w2, ids))
    top_k = ids.shape[1]
    experts, order = torch.sort(ids.flatten(), stable=True)
    rows = []
    for e, route in zip(experts.tolist(), order.tolist()):
        h = w1[e].float() @ x[route // top_k].float()
        if gated:
            gate, up = h.chunk(2)
            a = torch.nn.functional.silu(gate) * up
        else:
            a = torch.relu(h).square()
        rows.append(w2[e].float() @ a)
    return torch.stack(rows)


CASES = [
    # t, e, top_k, hidden, inter, gated, hit
    (1, 256, 8, 256, 128, True, None),     # decode: fewer routes than experts
    (5, 64, 8, 512, 64, True, 12),         # a few experts hit, many rows each
    (300, 32, 4, 256, 96, True, None),     # several BLOCK_M chunks per expert; I not a multiple of 64
    (3, 16, 6, 2688, 232, False, None),    # Nemotron's hidden size (K = 2688: masked for BLOCK_K 128 / 256)
    (700, 16, 2, 128, 64, False, 4),       # 1,400 routes on 4 experts: long M loops
]


@pytest.mark.parametrize("entry", range(5))
@pytest.mark.parametrize("t,e,top_k,hidden,inter,gated,hit", CASES)
def test_every_table_entry_matches_the_reference(poison, entry, t, e, top_k, hidden, inter, gated, hit):
    grouped = pytest.importorskip("forkpoint.kernels.moe.grouped")
    from forkpoint.kernels.moe import tiled

    x, w1, w2, _, ids = make_case(t, e, top_k, hidden, inter, gated, seed=t * e + entry, hit=hit)
    forced = tiled.TILES[entry]._replace(max_routes_per_expert=math.inf)
    routes = grouped._sorted_routes(ids, e)
    ys = tiled.expert_mlp(x, w1, w2, routes.tokens, routes.rows, gated=gated, table=(forced,))
    assert not torch.isnan(ys).any(), "an output row was never written"
    err = rel_rms(ys, expected_rows(x, w1, w2, ids, gated))
    print(f"REL_RMS moe_tiled entry {entry} T={t} E={e} k={top_k} Hd={hidden} I={inter} gated={gated} = {err:.3e}")
    assert err < TOL


def test_a_rows_result_does_not_depend_on_the_other_rows_of_its_step():
    """Within one tile configuration, token 0's expert rows are the same bits in a step of 1 token
    and in a step of 64 (one fp32 dot per element over the whole K, in order; no split-K)."""
    grouped = pytest.importorskip("forkpoint.kernels.moe.grouped")
    from forkpoint.kernels.moe import tiled

    x, w1, w2, _, ids = make_case(64, 128, 8, 512, 128, True, seed=3)
    for entry in tiled.TILES:
        table = (entry._replace(max_routes_per_expert=math.inf),)
        alone = grouped._sorted_routes(ids[:1], 128)
        many = grouped._sorted_routes(ids, 128)
        one = tiled.expert_mlp(x[:1], w1, w2, alone.tokens, alone.rows, gated=True, table=table)
        all_rows = tiled.expert_mlp(x, w1, w2, many.tokens, many.rows, gated=True, table=table)
        assert torch.equal(one[alone.pos], all_rows[many.pos[:8]]), entry


def test_tiled_experts_capture_in_a_cuda_graph_and_replay_new_routes():
    """The tile path has no host sync: captured once, replayed with other routes in the same buffers,
    it gives what an eager call on those routes gives."""
    grouped = pytest.importorskip("forkpoint.kernels.moe.grouped")

    x, w1, w2, weights, ids = make_case(16, 64, 8, 256, 128, True, seed=5)
    grouped.fused_moe(x, w1, w2, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = grouped.fused_moe(x, w1, w2, weights, ids)
    _, _, _, new_weights, new_ids = make_case(16, 64, 8, 256, 128, True, seed=6)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, grouped.fused_moe(x, w1, w2, weights, ids))


def test_steps_take_the_tiles_while_the_table_covers_their_routes_per_expert(monkeypatch):
    grouped = pytest.importorskip("forkpoint.kernels.moe.grouped")
    from forkpoint.kernels.moe import tiled

    calls = []
    real = tiled.expert_mlp
    monkeypatch.setattr(tiled, "expert_mlp", lambda *a, **k: calls.append(a[3].shape[0]) or real(*a, **k))
    x, w1, w2, weights, ids = make_case(64, 16, 2, 128, 64, True, seed=7)
    monkeypatch.setattr(tiled, "TILES", (tiled.TILES[0]._replace(max_routes_per_expert=8),))
    grouped.fused_moe(x, w1, w2, weights, ids)          # 128 routes over 16 experts: 8 per expert, tiles
    grouped.fused_moe(x[:8], w1, w2, weights[:8], ids[:8])
    monkeypatch.setattr(tiled, "TILES", (tiled.TILES[0]._replace(max_routes_per_expert=7.9),))
    grouped.fused_moe(x, w1, w2, weights, ids)          # grouped GEMMs
    assert calls == [128, 16]
