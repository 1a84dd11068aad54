"""The `forkpoint` command: documented options, `serve` as a real process, `generate`, `bench`."""

from __future__ import annotations

import argparse
import gc
import json
import signal
import socket
import time

import httpx
import pytest

from forkpoint.server.cli import _model_name, build_parser, main
from forkpoint.server.engine_args import engine_kwargs, server_engine_kwargs
from tests.server.conftest import serve_process

ENGINE_OPTIONS = ["--dtype", "--device", "--seed", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
                  "--block-size", "--checkpoint-token", "--no-checkpoints", "--max-checkpoints-per-request",
                  "--load-format", "--enforce-eager", "--tensor-parallel-size", "--async-scheduling", "--revision",
                  "--tokenizer-revision", "--download-dir", "--structured-outputs-config", "--checkpoint-dir",
                  "--checkpoint-dir-bytes", "--speculative-config"]
SERVE_OPTIONS = ["--host", "--port", "--served-model-name", "--max-waiting-requests", "--marker-in-user-content"]
BENCH_OPTIONS = ["--url", "--anchor-tokens", "--suffix-tokens", "--n", "--max-tokens", "--concurrency", "--out"]


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("command,options", [
    ("serve", ENGINE_OPTIONS + SERVE_OPTIONS),
    ("generate", ENGINE_OPTIONS + ["--model", "--max-tokens", "--temperature"]),
    ("bench", ENGINE_OPTIONS + BENCH_OPTIONS),
])
def test_help_documents_every_option(command, options):
    parser = _subcommands()[command]
    text = parser.format_help()
    assert all(option in text for option in options), [o for o in options if o not in text]
    undocumented = [a.dest for a in parser._actions if not a.help]
    assert not undocumented


def test_hub_names_are_served_as_given_with_their_revision(tmp_path):
    args = build_parser().parse_args(["serve", "Qwen/Qwen3.5-35B-A3B", "--revision", "v1", "--download-dir",
                                      str(tmp_path), "--structured-outputs-config",
                                      '{"disable_additional_properties": false}'])
    kwargs = engine_kwargs(args)
    assert (kwargs["model"], kwargs["revision"]) == ("Qwen/Qwen3.5-35B-A3B", "v1")
    assert kwargs["checkpoint_dir"] is None
    args = build_parser().parse_args(["serve", "--checkpoint-dir", str(tmp_path), "--checkpoint-dir-bytes", "4096"])
    assert (engine_kwargs(args)["checkpoint_dir"], engine_kwargs(args)["checkpoint_dir_bytes"]) == (str(tmp_path), 4096)
    assert kwargs["download_dir"] == str(tmp_path)
    assert kwargs["structured_outputs_config"] == {"disable_additional_properties": False}
    assert kwargs["speculative_config"] is None
    spec = engine_kwargs(build_parser().parse_args(["serve", "--speculative-config",
                                                    '{"method": "mtp", "num_speculative_tokens": 2}']))
    assert spec["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 2}
    assert _model_name("Qwen/Qwen3.5-35B-A3B") == "Qwen/Qwen3.5-35B-A3B"
    limits = engine_kwargs(build_parser().parse_args(["serve", "--prompt-score-bytes", "1048576",
                                                      "--long-prefill-token-threshold", "512"]))
    assert (limits["prompt_score_bytes"], limits["long_prefill_token_threshold"]) == (1 << 20, 512)
    assert _model_name(str(tmp_path)) == tmp_path.name


def test_serve_process_answers_and_stops_on_sigint(tmp_path, tiny_model_factory):
    # the tiny word-level model (tests/tiny_models.py): what is under test is the process, and it starts
    # in a fraction of the embedded model's time
    directory, _ = tiny_model_factory("qwen3_5_text")
    args = [str(directory), "--max-model-len", "2048", "--served-model-name", "cli-test",
            "--marker-in-user-content", "reject", "--log-level", "warning"]
    with serve_process(args, tmp_path / "serve.log") as running:
        base, process = running.base_url, running.process
        assert httpx.get(f"{base}/v1/models").json()["data"][0]["max_model_len"] == 2048
        response = httpx.post(f"{base}/v1/completions", timeout=60,
                              json={"model": "cli-test", "prompt": "hi", "max_tokens": 1})
        assert response.json()["usage"]["completion_tokens"] == 1
        rejected = httpx.post(f"{base}/v1/completions", json={"model": "cli-test", "prompt": "a<|mamba_checkpoint|>b"})
        assert rejected.status_code == 400
        assert kept_alive_past(base, seconds=5.5)  # clients keep an idle connection 5 s: the server keeps it longer
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0


def kept_alive_past(base_url: str, seconds: float) -> bool:
    """Whether one HTTP/1.1 connection answers GET /health, stays idle `seconds`, and answers again."""
    host, port = base_url.removeprefix("http://").split(":")
    request = f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request)
        if not read_response(sock).startswith(b"HTTP/1.1 200"):
            return False
        time.sleep(seconds)
        try:
            sock.sendall(request)
            return read_response(sock).startswith(b"HTTP/1.1 200")
        except OSError:  # the server closed it (a reset, or the send after its close)
            return False


def read_response(sock: socket.socket) -> bytes:
    """One whole response (head and its Content-Length body); what came before the peer closed, if it did."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            return data
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = sock.recv(4096)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def test_generate_prints_outputs_and_timings(capsys):
    assert main(["generate", "--max-model-len", "2048", "--max-tokens", "2",
                 "Hello<|mamba_checkpoint|> there", "Hello<|mamba_checkpoint|> again"]) == 0
    out = capsys.readouterr().out
    assert out.count("prompt (") == 2 and "output (2 tokens, length)" in out
    assert "load " in out and "tokens/s" in out
    assert "1 reused" in out  # the second prompt reuses the one-token prefix "Hello"


def test_bench_against_server(server, tmp_path, capsys):
    assert main(["bench", "--url", server.base_url, "--anchor-tokens", "48", "--suffix-tokens", "4",
                 "--n", "1,4", "--groups", "1", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "bench_1toN.json").read_text())
    rows = {(r["n"], r["checkpoints"]): r for r in record["results"]}
    assert rows[(4, True)]["tokens_reused"] == 3 * 48
    assert rows[(4, False)]["tokens_reused"] == 0 and rows[(1, True)]["tokens_reused"] == 0
    assert rows[(4, True)]["tokens_computed"] == 48 + 4 * 4
    assert (tmp_path / "bench_1toN.png").stat().st_size > 0
    assert "speedup" in capsys.readouterr().out


def test_serve_freezes_the_startup_heap(monkeypatch):
    """`serve` hands uvicorn an app whose start-up objects the garbage collector no longer traverses."""
    import uvicorn

    import forkpoint
    import forkpoint.server.app

    seen = {}
    monkeypatch.setattr(forkpoint, "LLM", lambda **kwargs: object())
    monkeypatch.setattr(forkpoint.server.app, "build_app", lambda llm, config, load_time_s: [object()])
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: seen.setdefault("frozen", gc.get_freeze_count()))
    gc.unfreeze()
    try:
        assert main(["serve", "--port", "1"]) == 0
    finally:
        gc.unfreeze()
    assert seen["frozen"] > 0


def test_serve_sizes_the_default_host_tier_on_a_gpu_so_it_is_pinned_ahead(monkeypatch):
    """On a GPU `serve` passes the default tier's size to its engine (which pins a given size at start-up);
    on the CPU, with a size given, or without checkpoints it passes what the user gave."""
    parse = build_parser().parse_args
    assert server_engine_kwargs(parse(["serve"]))["checkpoint_host_bytes"] is None  # this machine: CPU
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("forkpoint.cache.sizing.physical_memory_bytes", lambda: 128 << 30)
    assert server_engine_kwargs(parse(["serve"]))["checkpoint_host_bytes"] == 32 << 30
    assert server_engine_kwargs(parse(["serve", "--tensor-parallel-size", "2"]))["checkpoint_host_bytes"] == 16 << 30
    assert server_engine_kwargs(parse(["serve", "--checkpoint-host-bytes", "0"]))["checkpoint_host_bytes"] == 0
    assert server_engine_kwargs(parse(["serve", "--no-checkpoints"]))["checkpoint_host_bytes"] is None
    assert server_engine_kwargs(parse(["serve", "--device", "cpu"]))["checkpoint_host_bytes"] is None
    assert engine_kwargs(parse(["serve"]))["checkpoint_host_bytes"] is None  # replicas split it themselves


@pytest.mark.parametrize("flag,expected", [([], 64 << 20), (["--token-cache-mib", "1.5"], 3 << 19),
                                           (["--token-cache-mib", "0"], 0)])
def test_token_cache_size_reaches_the_server_config(monkeypatch, flag, expected):
    import uvicorn

    import forkpoint
    import forkpoint.server.app

    seen = {}
    monkeypatch.setattr(forkpoint, "LLM", lambda **kwargs: object())
    monkeypatch.setattr(forkpoint.server.app, "build_app",
                        lambda llm, config, load_time_s: seen.setdefault("config", config))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: None)
    try:
        assert main(["serve", "--port", "1", *flag]) == 0
    finally:
        gc.unfreeze()
    assert seen["config"].token_cache_bytes == expected
