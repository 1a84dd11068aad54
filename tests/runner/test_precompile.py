"""Start-up compile workers (runner/precompile.py, runner/precompile_worker.py) on the CPU: the reduced
model keeps every layer kind, the shares split the work exactly, and real worker processes run their
share (there is no compiler on the CPU: the same steps run, and a failing worker is reported)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import subprocess
import sys

import pytest
import torch

from forkpoint.config import EngineConfig, ModelConfig
from forkpoint.kernels.cache_dirs import autotune_choices_kept
from forkpoint.models.loader import build_model
from forkpoint.runner.precompile import (
    WHOLE,
    WORKER_OVERHEAD_BYTES,
    CompilePlan,
    CompileShare,
    default_workers,
    marker_path,
    precompile,
    reduced_depth,
    reduced_model_bytes,
)
from forkpoint.server.engine_args import add_engine_args, engine_kwargs
from tests.tiny_models import MAMBA2_MODEL_TYPES


def plan_of(directory, device: str = "cpu", **changes) -> CompilePlan:
    config = ModelConfig.from_hf_dir(directory)
    plan = CompilePlan(config, "float32", (8, 16, 48), num_request_slots=8, block_size=8, max_context=20,
                       device=device)
    return dataclasses.replace(plan, **changes)


@pytest.mark.parametrize("model_type", ["qwen3_5_moe_text", *MAMBA2_MODEL_TYPES])
def test_reduced_depth_keeps_one_layer_of_each_kind(tiny_model_factory, model_type):
    config = ModelConfig.from_hf_dir(tiny_model_factory(model_type)[0])
    reduced = reduced_depth(config)
    kinds = set(zip(config.layer_types, config.moe_layers))
    assert set(zip(reduced.layer_types, reduced.moe_layers)) == kinds
    assert reduced.num_layers == len(kinds) <= config.num_layers
    reduced.validate()
    model = build_model(reduced, None, "dummy", torch.device("cpu"), torch.float32, seed=0)
    assert len(model.config.layer_types) == reduced.num_layers


def test_shares_split_the_work_exactly_once():
    items = list(range(11))
    taken = [CompileShare(i, 3).take(items) for i in range(3)]
    assert sorted(x for part in taken for x in part) == items
    assert WHOLE.take(items) == items
    for index, count in ((3, 3), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match="index < count"):
            CompileShare(index, count)


def test_workers_run_their_shares_and_leave_a_marker(moe_model, tmp_path):
    plan = plan_of(moe_model[0])
    report = precompile(plan, 2, tmp_path)
    assert (report.workers, report.failed) == (2, 0)
    assert marker_path(plan, tmp_path).exists()
    assert "2 processes" in report.summary()
    # another plan is another marker: a warm cache is per model and step sizes
    assert not marker_path(dataclasses.replace(plan, graph_sizes=(8, 48)), tmp_path).exists()


def test_a_failing_worker_is_reported_and_leaves_no_marker(moe_model, tmp_path, caplog):
    plan = plan_of(moe_model[0], device="cuda:99")  # no such device, here or on a GPU machine
    with caplog.at_level(logging.WARNING, logger="forkpoint.runner.precompile"):
        report = precompile(plan, 2, tmp_path)
    assert (report.workers, report.failed) == (2, 2)
    assert not marker_path(plan, tmp_path).exists()
    assert "failed (exit" in caplog.text and "the engine compiles its share" in caplog.text
    assert "2 failed" in report.summary()


def test_no_worker_outlives_a_start_up_that_fails_half_way(moe_model, tmp_path, monkeypatch):
    """The second worker cannot start (here: Popen raises): the first, already running, is killed and
    reaped, and the error reaches the caller; no marker is written."""
    started = []
    real_popen = subprocess.Popen

    def popen(args, **kwargs):
        if started:
            raise OSError("no more processes")
        process = real_popen([sys.executable, "-c", "import time; time.sleep(600)"], **kwargs)
        started.append(process)
        return process

    monkeypatch.setattr(subprocess, "Popen", popen)
    plan = plan_of(moe_model[0])
    with pytest.raises(OSError, match="no more processes"):
        precompile(plan, 2, tmp_path)
    assert len(started) == 1 and started[0].returncode is not None  # killed and reaped
    assert not marker_path(plan, tmp_path).exists()


def test_default_workers_follow_cpus_and_memory(moe_model):
    plan = plan_of(moe_model[0])
    per_worker = reduced_model_bytes(plan) + WORKER_OVERHEAD_BYTES
    plenty = 100 * per_worker
    assert default_workers(plan, plenty, cpus=16) == 8
    assert default_workers(plan, plenty, cpus=6) == 3
    assert default_workers(plan, 4 * per_worker, cpus=16) == 3  # three quarters of the free memory
    assert default_workers(plan, per_worker, cpus=16) == 0


def test_plan_key_is_stable_and_covers_the_plan(moe_model):
    plan = plan_of(moe_model[0])
    assert plan.key == plan_of(moe_model[0]).key
    assert plan.key != dataclasses.replace(plan, num_request_slots=9).key
    assert plan.key != dataclasses.replace(plan, dtype="bfloat16").key
    assert plan.key == dataclasses.replace(plan, device="cuda:1").key  # replicas share the compiled kernels


def test_the_config_and_the_flag():
    assert EngineConfig().startup_compile_workers == 0  # LLM: the engine compiles alone unless asked
    with pytest.raises(ValueError, match="startup_compile_workers must be >= 0"):
        EngineConfig(startup_compile_workers=-1)
    parser = argparse.ArgumentParser()
    add_engine_args(parser, positional_model=False)
    assert engine_kwargs(parser.parse_args([]))["startup_compile_workers"] is None  # forkpoint serve: as many as pay
    assert engine_kwargs(parser.parse_args(["--startup-compile-workers", "3"]))["startup_compile_workers"] == 3


def test_workers_keep_no_autotune_choice():
    assert autotune_choices_kept({}) and autotune_choices_kept({"TRITON_CACHE_AUTOTUNING": "1"})
    for value in ("0", "false", "OFF "):
        assert not autotune_choices_kept({"TRITON_CACHE_AUTOTUNING": value})
