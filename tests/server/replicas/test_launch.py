"""`forkpoint serve --data-parallel-size N --ray-address ADDR`: documented, and bad values are clear
errors before anything starts."""

from __future__ import annotations

import pytest

from forkpoint.server.cli import build_parser, main


def test_serve_help_documents_the_replica_flags():
    serve_help = next(a for a in build_parser()._actions if a.dest == "command").choices["serve"].format_help()
    assert "--data-parallel-size" in serve_help and "--ray-address" in serve_help


@pytest.mark.parametrize("argv,message", [
    (["serve", "--data-parallel-size", "0"], "--data-parallel-size must be >= 1"),
    (["serve", "--data-parallel-size", "2", "--device", "cuda:1"], "each replica gets its own GPU"),
])
def test_bad_replica_options_are_clear_errors(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_gpu_replicas_split_the_default_host_tier_and_keep_a_given_one(monkeypatch):
    from forkpoint.cache.sizing import default_host_tier_bytes
    from forkpoint.server.replicas.launch import host_tier_share

    monkeypatch.setattr("forkpoint.server.replicas.launch.physical_memory_bytes", lambda: 128 << 30)
    whole = default_host_tier_bytes(128 << 30, True)
    assert whole == 32 << 30
    shared = host_tier_share({"model": "m"}, num_replicas=4, num_gpus=1)
    assert shared == {"model": "m", "checkpoint_host_bytes": whole // 4}  # 4 x 8 GiB, not 4 x 32 GiB
    assert host_tier_share({"tensor_parallel_size": 2}, 2, 1)["checkpoint_host_bytes"] == whole // 2 // 2
    given = {"checkpoint_host_bytes": 0}
    assert host_tier_share(given, 4, 1) is given  # the user's choice stands
    assert "checkpoint_host_bytes" not in host_tier_share({"device": "cpu"}, 4, 0)  # CPU replicas: no tier
