"""bench/e2e_gpu.py's long-context rows (issue 30): planned by default after the other rows and off with
an empty list; the time predictor charges a long prompt its attention; a tiny CPU run produces the long
scoring and long-context TPOT pairs with their keys, skips a prompt beyond max_model_len with the reason,
and lists both under the JSON's `long`; the transformers peer records an out-of-memory warm-up and goes on."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import e2e_gpu  # noqa: E402
import e2e_gpu_peer  # noqa: E402
from e2e_gpu_plan import Predictor, RowSpec, plan_rows  # noqa: E402

from tests.bench.e2e_gpu_runs import run_e2e_gpu  # noqa: E402


def _plan(*argv: str):
    args = e2e_gpu.build_parser().parse_args(list(argv))
    args.scan_chunk, args.auto_min_tokens = 64, 256  # what main() derives from the engine's config
    return plan_rows(args)


def test_long_rows_are_planned_by_default_after_the_others_and_an_empty_list_turns_them_off():
    plan = _plan()
    assert [(s.group, s.p, s.n, s.max_tokens) for s in plan.long] == [
        ("long", 32768, 1, 1), ("long", 131072, 1, 1), ("long", 32768, 4, 1), ("long", 131072, 4, 1),
        ("long", 32768, 16, 1), ("long", 131072, 16, 1), ("long_decode", 32768, 1, 32), ("long_decode", 32768, 16, 32)]
    assert all(s.suffix_lengths == (256,) * s.n for s in plan.long)
    assert not {s.group for s in plan.rows + plan.eager} & set(e2e_gpu.LONG_GROUPS)
    assert e2e_gpu.build_parser().parse_args([]).peer_p == [624, 4096, 32768]
    assert {s.group for s in _plan("--long-p", "").long} == {"long_decode"}
    assert _plan("--long-p", "", "--long-decode-p", "").long == ()
    assert _plan("--long-p", "", "--long-decode-p", "").rows == plan.rows  # the other rows do not move


def test_context_tokens_count_what_causal_attention_reads():
    spec = RowSpec("long", 1000, "10", (10, 10, 10), 1)
    assert spec.context_tokens(False) == 3 * sum(range(1010))
    assert spec.context_tokens(True) == sum(range(1000)) + 3 * sum(range(1000, 1010))
    exact = RowSpec("exact", 1000, "10", (10, 10, 10), 1, "checkpoint_exact", 40)  # consumers recompute 960..999
    assert exact.context_tokens(True) == sum(range(1000)) + 2 * sum(range(960, 1000)) + 3 * sum(range(1000, 1010))


def test_the_predictor_charges_long_prompts_their_attention():
    cfg = e2e_gpu.full_config()
    share = e2e_gpu.attention_share(cfg)
    assert share == pytest.approx(4 * 16 * 256 * 10 / (2 * e2e_gpu.count_params(cfg)["per_token"]))
    assert e2e_gpu.attention_share(e2e_gpu.model_config(SimpleNamespace(shape="nemotron3-nano"), False)) > 0
    plain, attending = Predictor(8192), Predictor(8192, share)
    long = RowSpec("long", 131072, "256", (256,) * 16, 1)
    short = RowSpec("main", 624, "256", (256,) * 16, 1)
    assert attending.pair_seconds(long) > 2 * plain.pair_seconds(long)  # attention outweighs the matmuls at 131k
    assert attending.pair_seconds(short) < 1.05 * plain.pair_seconds(short)


def _tiny_run(tmp_path, monkeypatch, capsys) -> tuple[dict, str]:
    """A tiny CPU run: one main pair, then long rows at P = 200 and 40,000 (beyond the tiny model's
    max_model_len of 32,768) by N = 1, 2, and a long TPOT pair at P = 200; its JSON and output."""
    results = run_e2e_gpu(monkeypatch, tmp_path, "long", "--tiny", "--device", "cpu", "--p", "40", "--s", "8",
                          "--n", "1", "--decode-n=", "--exact-n=", "--auto-n=", "--async-n=", "--seed-n=", "--eager-n=",
                          "--long-p", "200,40000", "--long-n", "1,2", "--long-decode-p", "200", "--long-decode-n", "2",
                          "--decode-tokens", "3", "--no-peer", "--max-num-batched-tokens", "64", "--max-num-seqs", "4")
    return results, capsys.readouterr().out


def test_tiny_run_produces_the_long_rows_and_skips_a_prompt_beyond_max_model_len(tmp_path, monkeypatch, capsys):
    results, out = _tiny_run(tmp_path, monkeypatch, capsys)
    e2e_gpu.check_smoke(results)  # no error, token counts add up, every planned pair ran or was skipped
    long_runs = {(r["group"], r["P"], r["N"], r["max_tokens"], r["checkpoints"]) for r in results["runs"]
                 if r["group"] in e2e_gpu.LONG_GROUPS}
    assert long_runs == {(g, 200, n, mt, c) for g, n, mt in (("long", 1, 1), ("long", 2, 1), ("long_decode", 2, 3))
                         for c in ("on", "off")}
    decode = [r for r in results["runs"] if r["group"] == "long_decode"]
    assert all(r["tpot_ms"] > 0 and r["prompt_tokens_total"] == 2 * 208 for r in decode)
    assert [r["group"] for r in results["runs"]][:2] == ["main", "main"]  # the long rows come after
    skipped = [s for s in results["skipped"] if s["group"] == "long"]
    assert [(s["P"], s["N"]) for s in skipped] == [(40000, 1), (40000, 2)]
    assert all("max_model_len 32768" in s["reason"] for s in skipped)
    summary = {(e["group"], e["P"], e["N"]): e for e in results["long"]}
    assert list(summary) == [("long", 200, 1), ("long", 40000, 1), ("long", 200, 2), ("long", 40000, 2),
                             ("long_decode", 200, 2)]
    for ran in (summary[("long", 200, 2)], summary[("long_decode", 200, 2)]):
        assert ran["on_requests_per_s"] > 0 and ran["off_requests_per_s"] > 0 and ran["ideal"] > 1
        assert "skipped" not in ran
    assert summary[("long_decode", 200, 2)]["on_tpot_ms"] > 0
    assert "max_model_len" in summary[("long", 40000, 1)]["skipped"]
    assert "| long | P=200 S=8 | 2 | 1 | default | on |" in out
    assert "| long_decode | P=200 S=8 | 2 | 3 | default | off |" in out
    assert "attention_share" in results["predictor"]


def test_the_peer_records_an_out_of_memory_warm_up_and_goes_on(monkeypatch):
    class Peer(torch.nn.Module):
        """transformers' model as run_peer sees it, out of memory for sequences over 100 tokens."""

        def __init__(self) -> None:
            super().__init__()
            self.model = SimpleNamespace(layers=[0, 1])
            self.config = SimpleNamespace(layer_types=["linear_attention", "full_attention"])

        def forward(self, input_ids: torch.Tensor, use_cache: bool, logits_to_keep: int) -> None:
            if input_ids.shape[1] > 100:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(e2e_gpu_peer, "build_peer", lambda cfg, model, device: (Peer(), {}))
    args = SimpleNamespace(device="cpu", seed=0, peer_p=[16, 500, 32], peer_n=[1, 3], peer_batch=2, peer_layers=0,
                           s=8, vocab_limit=1000)
    results: dict = {}
    e2e_gpu_peer.run_peer(args, {}, None, results, lambda: None)
    runs = results["peer"]["runs"]
    assert [(r["P"], r["N"], "error" in r) for r in runs] == [
        (16, 1, False), (16, 3, False), (500, 1, True), (500, 3, True), (32, 1, False), (32, 3, False)]
    assert runs[2]["error"].startswith("OOM in the warm-up at batch 2")
    assert set(results["peer"]["warmup_s"]) == {"16", "32"}
