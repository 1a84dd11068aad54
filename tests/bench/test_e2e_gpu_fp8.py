"""bench/e2e_gpu.py's FP8 shapes (issue 28) and bench/e2e_gpu_compare.py: the configs carry the FP8
releases' quantization_config and Qwen3-Next-80B-A3B's published architecture, a tiny FP8 dry run writes
its rows with FP8 weights and no peer, and the comparison's ratios and target verdicts come out right."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

import pytest

from forkpoint.config import ModelConfig

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import e2e_gpu  # noqa: E402
import e2e_gpu_compare  # noqa: E402
from e2e_gpu_shapes import qwen3_next_80b_config  # noqa: E402

from tests.bench.e2e_gpu_runs import run_e2e_gpu  # noqa: E402


def _config(shape: str, tiny: bool) -> dict:
    return e2e_gpu.model_config(argparse.Namespace(shape=shape), tiny)


@pytest.mark.parametrize("shape", e2e_gpu.FP8_SHAPES)
def test_fp8_shapes_carry_the_releases_block_fp8_config(shape):
    for tiny, block in ((False, (128, 128)), (True, e2e_gpu.TINY_FP8_BLOCK)):
        raw = _config(shape, tiny)
        assert raw["quantization_config"]["activation_scheme"] == "dynamic"
        config = ModelConfig.from_dict(raw)
        assert config.quantization is not None and config.quantization.block == block
        assert {"mlp.gate", "shared_expert_gate", "in_proj_a", "in_proj_b"} <= set(
            config.quantization.modules_to_not_convert)
    bf16 = _config("qwen3.5-35b-a3b", False)
    if shape == "qwen3.5-35b-a3b-fp8":  # the same model as the bf16 baseline, only quantised
        assert {k: v for k, v in _config(shape, False).items() if k != "quantization_config"} == bf16


def test_qwen3_next_80b_numbers_are_transformers_qwen3next_defaults():
    transformers = pytest.importorskip("transformers")
    defaults = transformers.Qwen3NextConfig().to_dict()
    ours = qwen3_next_80b_config()
    # from the published config.json (e2e_gpu_shapes.py says where); the interval is read back through
    # `layer_types` (compared)
    published = {"max_position_embeddings": 262144, "intermediate_size": 5120,
                 "rope_parameters": {**defaults["rope_parameters"], "rope_theta": 5000000.0}}
    for key, value in ours.items():
        if key in ("architectures", "full_attention_interval"):
            continue
        assert published.get(key, defaults[key]) == value, key
    counts = e2e_gpu.count_params(ours)
    assert 79e9 < counts["total_matmul"] < 81e9  # "80B" total
    assert 2.9e9 < counts["per_token"] < 3.5e9   # "A3B": about 3B active (without embedding and lm_head)


def _dry_run(tmp_path, monkeypatch, shape: str, device: str) -> dict:
    """A tiny run of `shape` on `device` (two main pairs, one decode pair); its result JSON."""
    return run_e2e_gpu(monkeypatch, tmp_path, "dry", "--tiny", "--device", device, "--shape", shape, "--p", "40",
                       "--s", "8", "--n", "1,2", "--decode-p", "16", "--decode-n", "2", "--decode-tokens", "3",
                       "--exact-n=", "--auto-n=", "--async-n=", "--seed-n=", "--eager-n=", "--long-p=",
                       "--long-decode-p=", "--max-num-batched-tokens", "64", "--max-num-seqs", "4")


def _check_dry_run(results: dict) -> None:
    assert not results.get("error"), results.get("error")
    assert results["quantization"]["weight_block_size"] == list(e2e_gpu.TINY_FP8_BLOCK)
    assert results["engine"]["fp8_weights_gb"] > 0
    assert "load weights" in results["engine"]["start_up_phases_s"]
    assert results["peer_note"] and "peer" not in results
    planned = {(p["group"], p["N"]) for p in results["plan"]}
    assert planned == {("main", 1), ("main", 2), ("decode", 2)}
    ran = {(r["group"], r["N"], r["checkpoints"]) for r in results["runs"]}
    assert ran == {(g, n, c) for g, n in planned for c in ("on", "off")}
    assert all(r["prompt_tokens_computed"] == r["prompt_tokens_expected"] for r in results["runs"])


def test_tiny_fp8_dry_run_writes_rows_with_fp8_weights_and_no_peer(tmp_path, monkeypatch):
    _check_dry_run(_dry_run(tmp_path, monkeypatch, "qwen3-next-80b-a3b-fp8", "cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", e2e_gpu.FP8_SHAPES)
def test_gpu_tiny_fp8_dry_run(tmp_path, monkeypatch, shape):
    """The same on CUDA (bf16, CUDA graphs, the FP8 Triton kernels with 64 x 64 blocks), with memory recorded."""
    results = _dry_run(tmp_path, monkeypatch, shape, "cuda")
    _check_dry_run(results)
    assert results["engine"]["gpu_mem_peak_allocated_gb"] > 0 and results["gpu_mem_peak_allocated_gb"] > 0


def _run(group: str, n: int, max_tokens: int, ckpt: str, rps: float, tpot: float | None = None) -> dict:
    return {"group": group, "shape": "P=4096 S=256", "N": n, "max_tokens": max_tokens, "engine": "default",
            "checkpoints": ckpt, "requests_per_s": rps, "ttft_p50_ms": 100.0, "tpot_ms": tpot}


def _results(model: str, config: dict, runs: list[dict], full_off: float) -> dict:
    return {"model": model, "config": config, "runs": runs, "engine": {"init_s": 30.0, "weights_gb": 70.0},
            "full_steps": {"off": {"tokens_per_s_median": full_off}}}


def test_compare_gives_ratios_and_judges_issue_28_targets():
    cfg = {"model_type": "qwen3_5_moe_text", "hidden_size": 2048}
    base = _results("bf16", cfg, [_run("main", 16, 1, "off", 2.0), _run("decode", 64, 32, "off", 1.0, 20.0)], 60e3)
    fast = _results("fp8", {**cfg, "quantization_config": {"quant_method": "fp8"}},
                    [_run("main", 16, 1, "off", 3.0), _run("decode", 64, 32, "off", 1.2, 13.0)], 90e3)
    slow = _results("fp8 slow", {**cfg, "quantization_config": {"quant_method": "fp8"}},
                    [_run("decode", 64, 32, "off", 1.0, 16.0), _run("main", 256, 1, "off", 1.0)], 70e3)
    other = _results("80b", {**cfg, "num_experts": 512}, [_run("main", 16, 1, "off", 1.5)], 50e3)
    report = e2e_gpu_compare.compare(base, [fast, slow, other])
    assert "| main P=4096 S=256 | 16 | 1 | off | req/s | 2.00 | 3.00 | 1.50x | - | - | 1.50 | 0.75x |" in report
    assert "| decode P=4096 S=256 | 64 | 32 | off | TPOT p50 ms | 20.00 | 13.00 | 0.65x | 16.00 | 0.80x | - | - |" \
        in report
    assert "| main P=4096 S=256 | 256 | 1 | off | req/s | - | - | - | 1.00 | - | - | - |" in report  # others' rows too
    assert "#1 decode TPOT at batch 64 (P=4096 S=256, checkpoints off): 0.65x the baseline (target <= 0.7x): met" \
        in report
    assert "#2 decode TPOT at batch 64 (P=4096 S=256, checkpoints off): 0.80x the baseline (target <= 0.7x): MISSED" \
        in report
    assert "#1 full-step prefill tokens/s: 1.50x the baseline (target >= 1.3x): met" in report
    assert "#2 full-step prefill tokens/s: 1.17x the baseline (target >= 1.3x): MISSED" in report
    assert "#3: 80b (another architecture" in report and "#3 decode" not in report


def test_compare_names_a_missing_file_and_still_prints_the_others(tmp_path, capsys):
    result = _results("fp8", {}, [_run("main", 1, 1, "on", 5.0)], 1.0)
    (tmp_path / "fp8.json").write_text(json.dumps(result))
    assert e2e_gpu_compare.main([str(tmp_path / "bf16.json"), str(tmp_path / "fp8.json")]) == 0
    out = capsys.readouterr().out
    assert "not compared:" in out and "bf16.json" in out
    assert "| main P=4096 S=256 | 1 | 1 | on | req/s | - | 5.00 | - |" in out
    assert e2e_gpu_compare.main([str(tmp_path / "bf16.json"), str(tmp_path / "none.json")]) == 1


def test_the_gpu_script_runs_shapes_the_benchmark_has():
    script = (BENCH / "run_gpu_fp8.sh").read_text()
    shapes = re.search(r"declare -A SHAPE=\((.*)\)", script).group(1)
    named = dict(re.findall(r"\[(\w+)\]=([\w.-]+)", shapes))
    assert named == {"bf16": "qwen3.5-35b-a3b", "fp8": "qwen3.5-35b-a3b-fp8", "next": "qwen3-next-80b-a3b-fp8"}
    assert set(named.values()) <= set(e2e_gpu.SHAPES)
    assert os.access(BENCH / "run_gpu_fp8.sh", os.X_OK)
