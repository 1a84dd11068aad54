"""vLLM's `serve` flags on `forkpoint serve`: a vLLM command line for a hybrid model runs as it is, each flag
mapped to what it means here or, where forkpoint cannot do what it asks, refused with a message naming it."""

from __future__ import annotations

import pytest

from forkpoint.server.cli import build_parser, main
from forkpoint.server.engine_args import engine_kwargs

# vLLM's Qwen3.5 recipe, as its users run it (the model positional, then its flags)
VLLM_QWEN_COMMAND = ["serve", "Qwen/Qwen3.5-35B-A3B", "--port", "8000", "--tensor-parallel-size", "1",
                     "--max-model-len", "262144", "--gpu-memory-utilization", "0.9", "--enable-prefix-caching",
                     "--trust-remote-code", "--mamba-ssm-cache-dtype", "float32"]


def test_a_vllm_command_line_parses_and_maps_to_the_engine():
    kwargs = engine_kwargs(build_parser().parse_args(VLLM_QWEN_COMMAND))
    assert kwargs["model"] == "Qwen/Qwen3.5-35B-A3B"
    assert (kwargs["gpu_memory_utilization"], kwargs["max_model_len"]) == (0.9, 262144)
    assert kwargs["auto_checkpoints"] is True
    assert (kwargs["quantization"], kwargs["kv_cache_dtype"]) == (None, "auto")


@pytest.mark.parametrize("flags,expected", [
    ([], True),
    (["--no-enable-prefix-caching"], False),
    (["--no-auto-checkpoints"], False),
    (["--no-enable-prefix-caching", "--auto-checkpoints"], True),  # the last flag wins
    (["--auto-checkpoints", "--no-enable-prefix-caching"], False),
])
def test_prefix_caching_is_the_automatic_checkpoints_switch(flags, expected):
    assert engine_kwargs(build_parser().parse_args(["serve", *flags]))["auto_checkpoints"] is expected


def test_quantization_and_kv_cache_dtype_reach_the_engine():
    kwargs = engine_kwargs(build_parser().parse_args(["serve", "--quantization", "fp8", "--kv-cache-dtype", "auto"]))
    assert (kwargs["quantization"], kwargs["kv_cache_dtype"]) == ("fp8", "auto")


@pytest.mark.parametrize("flags,named", [
    (["--kv-cache-dtype", "fp8"], "kv_cache_dtype 'fp8' is not supported"),
    (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization must be in (0, 1], got 1.5"),
    (["--gpu-memory-utilization", "0"], "gpu_memory_utilization must be in (0, 1], got 0.0"),
])
def test_what_forkpoint_cannot_do_is_refused_before_anything_loads(flags, named, capsys):
    assert main(["serve", "--device", "cpu", *flags]) == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--quantization", "awq"], ["--mamba-ssm-cache-dtype", "bfloat16"]])
def test_values_outside_the_choices_are_usage_errors_that_list_them(flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", *flags])
    assert exit_info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
