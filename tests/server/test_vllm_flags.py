"""vLLM's `serve` flags on `forkpoint serve`: a vLLM command line for a hybrid model runs as it is, each flag
mapped to what it means here or, where forkpoint cannot do what it asks, refused with a message naming it."""

from __future__ import annotations

import httpx
import pytest

import forkpoint
from forkpoint.server.cli import build_parser, main, server_config
from forkpoint.server.config import CorsPolicy, ServerConfig
from forkpoint.server.engine_args import engine_kwargs
from tests.server.conftest import serve

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


# vLLM's chat switches for Qwen3.5: accepted, as they name the formats forkpoint reads
VLLM_QWEN_CHAT_FLAGS = ["--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder"]
CUSTOM_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n[custom] {{ m['content'] }}<|im_end|>\n"
                   "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_vllm_chat_switches_parse_when_they_name_the_formats_forkpoint_reads():
    args = build_parser().parse_args(VLLM_QWEN_COMMAND + VLLM_QWEN_CHAT_FLAGS)
    assert (args.reasoning_parser, args.tool_call_parser, args.enable_auto_tool_choice) == ("qwen3", "qwen3_coder",
                                                                                           True)
    assert args.chat_template is None


# Qwen3-Next, Granite-4.0-H and Falcon-H1 write Hermes' JSON calls; Nemotron Nano v2 NVIDIA's <TOOLCALL> list
@pytest.mark.parametrize("parser", ["hermes", "qwen3_xml", "nemotron_json"])
def test_vllm_tool_call_parsers_of_the_other_families_parse(parser):
    args = build_parser().parse_args(["serve", "Qwen/Qwen3-Next-80B-A3B-Instruct", "--enable-auto-tool-choice",
                                      "--tool-call-parser", parser])
    assert args.tool_call_parser == parser


@pytest.mark.parametrize(("flags", "formats"), [([], ("qwen3_xml", "hermes", "nemotron_json")),
                                                (["--tool-call-parser", "qwen3_coder"], ("qwen3_xml",)),
                                                (["--tool-call-parser", "hermes"], ("hermes",))])
def test_the_tool_call_parser_names_the_formats_the_server_reads(flags, formats):
    assert server_config(build_parser().parse_args(["serve", *flags])).tool_formats == formats


@pytest.mark.parametrize("flags", [["--tool-call-parser", "llama3_json"], ["--tool-call-parser", "granite"],
                                   ["--reasoning-parser", "granite"]])
def test_a_parser_of_another_format_is_refused_listing_the_ones_read(flags, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", *flags])
    err = capsys.readouterr().err
    assert "invalid choice" in err
    assert ("'hermes'" in err and "'qwen3_coder'" in err) if flags[0] == "--tool-call-parser" else "'qwen3'" in err


def test_chat_template_is_a_file_or_the_template_itself(tmp_path, capsys):
    path = tmp_path / "template.jinja"
    path.write_text(CUSTOM_TEMPLATE, encoding="utf-8")
    assert build_parser().parse_args(["serve", "--chat-template", str(path)]).chat_template == CUSTOM_TEMPLATE
    assert build_parser().parse_args(["serve", "--chat-template", CUSTOM_TEMPLATE]).chat_template == CUSTOM_TEMPLATE
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--chat-template", str(tmp_path / "missing.jinja")])
    assert "is neither a file nor a Jinja template" in capsys.readouterr().err


def test_the_server_renders_chats_with_its_chat_template(spare_llm):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    rendered = "".join(f"<|im_start|>{m['role']}\n[custom] {m['content']}<|im_end|>\n" for m in messages)
    rendered += "<|im_start|>assistant\n"
    with serve(spare_llm, ServerConfig(chat_template=CUSTOM_TEMPLATE)) as running:
        chat = running.post("/tokenize", json={"messages": messages}).json()["tokens"]
        text = running.post("/tokenize", json={"prompt": rendered}).json()["tokens"]
        assert chat == text
        reply = running.client().chat.completions.create(model=running.model, messages=messages, max_tokens=3,
                                                         temperature=0.0)
        assert reply.usage.prompt_tokens == len(text)
        # a request's own template is a 400 here (not trusted): the server's stands for every request
        refused = running.post("/v1/chat/completions", json={
            "model": running.model, "messages": messages, "max_tokens": 1,
            "chat_template_kwargs": {"chat_template": "{{ messages[0]['content'] }}"}})
        assert refused.status_code == 400


def test_several_served_model_names_are_aliases_and_responses_carry_the_first(spare_llm):
    args = build_parser().parse_args(["serve", "--served-model-name", "qwen-local", "claude-sonnet-4-5"])
    assert args.served_model_name == ["qwen-local", "claude-sonnet-4-5"]
    config = ServerConfig(served_model_name="qwen-local", served_model_aliases=("claude-sonnet-4-5",))
    with serve(spare_llm, config) as running:
        assert [m.id for m in running.client().models.list().data] == ["qwen-local", "claude-sonnet-4-5"]
        reply = running.client().chat.completions.create(model="claude-sonnet-4-5", max_tokens=2,
                                                         messages=[{"role": "user", "content": "hi"}])
        assert reply.model == "qwen-local"
        refused = running.post("/v1/chat/completions", json={"model": "gpt-4o", "max_tokens": 1,
                                                             "messages": [{"role": "user", "content": "hi"}]})
        assert refused.status_code == 400
        assert "'claude-sonnet-4-5' or 'qwen-local'" in refused.json()["error"]["message"]
    with pytest.raises(ValueError, match="non-empty strings"):
        ServerConfig(served_model_name="qwen-local", served_model_aliases=("",))


PREFLIGHT = {"Origin": "http://chat.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def test_browsers_may_call_the_api_across_origins_as_vllm_allows_by_default(spare_llm):
    args = build_parser().parse_args(["serve", "--allowed-origins", '["http://chat.example"]', "--allow-credentials"])
    assert (args.allowed_origins, args.allowed_methods, args.allow_credentials) == (["http://chat.example"], ["*"],
                                                                                    True)
    with serve(spare_llm, ServerConfig(api_keys=("sk-test",))) as running:
        # the preflight carries no key: answered before the key check
        preflight = httpx.options(f"{running.base_url}/v1/chat/completions", headers=PREFLIGHT)
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "*"
        # a request without the key is refused, with the headers that let the page read why
        refused = httpx.post(f"{running.base_url}/v1/chat/completions", headers={"Origin": "http://chat.example"},
                             json={"model": running.model, "messages": [{"role": "user", "content": "hi"}]})
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"
        listed = httpx.get(f"{running.base_url}/v1/models", headers={"Origin": "http://chat.example",
                                                                      "Authorization": "Bearer sk-test"})
        assert listed.status_code == 200 and listed.headers["access-control-allow-origin"] == "*"
        # vLLM's open probes: /ping (GET and POST, as /health) and /version, without a key
        assert httpx.get(f"{running.base_url}/ping").json() == {"status": "ok"}
        assert httpx.post(f"{running.base_url}/ping").status_code == 200
        assert httpx.get(f"{running.base_url}/version").json() == {"version": forkpoint.__version__}
    with serve(spare_llm, ServerConfig(cors=CorsPolicy(origins=()))) as running:
        listed = httpx.get(f"{running.base_url}/v1/models", headers={"Origin": "http://chat.example"})
        assert listed.status_code == 200 and "access-control-allow-origin" not in listed.headers
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--allowed-origins", "*"])


def test_transport_flags_reach_uvicorn(monkeypatch, tmp_path, capsys):
    """vLLM's uvicorn, TLS and proxy flags become uvicorn's arguments; a key without its certificate is
    refused before anything loads."""
    import uvicorn

    import forkpoint
    import forkpoint.server.app

    seen = {}
    monkeypatch.setattr(forkpoint, "LLM", lambda **kwargs: object())
    monkeypatch.setattr(forkpoint.server.app, "build_app", lambda llm, config, load_time_s: object())
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: seen.update(kwargs))
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    assert main(["serve", "--port", "1", "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log",
                 "--disable-log-requests", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
                 "--root-path", "/llm"]) == 0
    assert (seen["port"], seen["log_level"], seen["access_log"], seen["root_path"]) == (1, "warning", False, "/llm")
    assert (seen["ssl_keyfile"], seen["ssl_certfile"], seen["ssl_ca_certs"]) == (str(key), str(cert), None)
    seen.clear()
    assert main(["serve", "--port", "1", "--ssl-keyfile", str(key)]) == 2
    assert "--ssl-keyfile and --ssl-certfile go together" in capsys.readouterr().err and not seen
