"""Shared fixtures: tiny transformers-built checkpoints, the session's engines on the embedded default model, and
what keeps the suite fast on 2 cores (one intra-op thread per process, one grammar vocabulary per tokenizer, one
default TLS context per process)."""

from __future__ import annotations

import hashlib
import os
import threading

import pytest

# One intra-op thread per test process, and per child process (`forkpoint serve` children, Ray replicas: set
# before torch is imported, inherited by them). The tests' ops are small, and a second OpenMP thread
# spin-waits at every op's barrier whenever anything else wants a core (an in-process server's threads, a
# child server, Ray replicas, another job on the machine): tests/engine/test_{speculative,faults,memory_retry,
# decode_share}.py took 489 s with two threads beside one other busy process, 49 s with one (54 s and 56 s
# on an idle 2-core machine). OMP_NUM_THREADS set by the caller wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from tests.tiny_models import build_tiny_model  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

pytest.register_assert_rewrite("tests.helpers")  # detailed failures from its asserts (before the tests import it)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """build(model_type, fused_experts=False) -> (directory, transformers model); cached per session."""
    cache = {}

    def build(model_type: str, fused_experts: bool = False):
        key = (model_type, fused_experts)
        if key not in cache:
            directory = tmp_path_factory.mktemp(f"{model_type}{'_fused' if fused_experts else ''}")
            cache[key] = (directory, build_tiny_model(directory, model_type, fused_experts=fused_experts))
        return cache[key]

    return build


@pytest.fixture(scope="session")
def moe_model(tiny_model_factory):
    return tiny_model_factory("qwen3_5_moe_text")


@pytest.fixture(scope="session", autouse=True)
def one_grammar_vocabulary_per_tokenizer():
    """llguidance's view of a vocabulary (`llguidance.hf.from_tokenizer`: ~4 s for the 248k-entry Qwen3.5
    vocabulary of the embedded default model) built once per distinct tokenizer and arguments, and handed to
    every later engine of the session that asks for the same one (structured outputs, and every server's
    start-up, which prepares it). The key is the serialised tokenizer itself (vocabulary, merges, added
    tokens), so a tokenizer that differs in anything gets its own build; forkpoint's code around the call
    (structured/compiler.py) runs unchanged. Child processes build their own."""
    import llguidance.hf

    build = llguidance.hf.from_tokenizer
    built: dict[tuple, object] = {}
    lock = threading.Lock()

    def from_tokenizer(hf_tokenizer, n_vocab=None, eos_token=None, slices=None):
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if backend is None:  # not a fast tokenizer: the real function's error
            return build(hf_tokenizer, n_vocab=n_vocab, eos_token=eos_token, slices=slices)
        key = (hashlib.sha256(backend.to_str().encode()).hexdigest(), n_vocab,
               tuple(eos_token) if isinstance(eos_token, list) else eos_token,
               None if eos_token is not None else hf_tokenizer.eos_token_id,
               None if slices is None else tuple(slices))
        with lock:
            if key not in built:
                built[key] = build(hf_tokenizer, n_vocab=n_vocab, eos_token=eos_token, slices=slices)
            return built[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llguidance.hf, "from_tokenizer", from_tokenizer)
        yield


@pytest.fixture(scope="session", autouse=True)
def one_tls_context_per_process():
    """httpx builds a TLS context for every client it makes, loading the whole CA bundle each time (~40 ms on 2
    cores, more on a busy machine), and `httpx.get`/`httpx.post` and every OpenAI client make one: ~45 s of the
    suite's CPU went there, for tests that speak plain HTTP to loopback servers. The default context (verify on,
    no client certificate, the environment's CA settings) is built once per setting and shared, as one client
    shares it between its connections; any other `verify` or `cert` goes to httpx's own function. The
    OpenAI client's copy of httpx (`httpx2`, where installed) gets the same."""
    import importlib

    patches = []
    for name in ("httpx._transports.default", "httpx2._transports.default"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        patches.append((module, _shared_default_tls_context(module.create_ssl_context)))
    with pytest.MonkeyPatch.context() as patch:
        for module, create in patches:
            patch.setattr(module, "create_ssl_context", create)
        yield


def _shared_default_tls_context(create_ssl_context):
    built: dict[tuple, object] = {}
    lock = threading.Lock()

    def create(verify=True, cert=None, trust_env=True):
        if verify is not True or cert:
            return create_ssl_context(verify=verify, cert=cert, trust_env=trust_env)
        key = (trust_env, os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
        with lock:
            if key not in built:
                built[key] = create_ssl_context(verify=True, cert=None, trust_env=trust_env)
            return built[key]

    return create


@pytest.fixture(scope="session")
def auto_checkpoints_engine():
    """One engine on the embedded default model with automatic checkpoints on (as `forkpoint serve` runs)
    and the server tests' small pools (tests/server/conftest.py's TEST_LLM_KWARGS), for the tests that
    serve or drive such an engine: building one costs ~8 s on 2 cores (the Qwen3.5 tokenizer, the weights,
    the grammar vocabulary). Use `auto_llm`, which clears its prefix cache first, or clear it yourself
    (`reset_prefix_cache()`) in a module-scoped fixture. Its counters (`metrics()`) run on from test to
    test: compare a reading before with one after."""
    from forkpoint import LLM
    from tests.server.conftest import TEST_LLM_KWARGS

    return LLM(**{**TEST_LLM_KWARGS, "auto_checkpoints": True})


@pytest.fixture(scope="session")
def plain_default_llm():
    """An engine on the embedded default model without checkpoints (the server tests' pools, TEST_LLM_KWARGS):
    the reference that computes every prompt from scratch, for outputs served with reuse."""
    from forkpoint import LLM
    from tests.server.conftest import TEST_LLM_KWARGS

    return LLM(**{**TEST_LLM_KWARGS, "enable_checkpoints": False})


@pytest.fixture
def auto_llm(auto_checkpoints_engine):
    """`auto_checkpoints_engine` with no checkpoint and no indexed prompt: the test's first prompt computes
    from scratch, as on a new engine."""
    assert auto_checkpoints_engine.reset_prefix_cache(), "a request of an earlier test is still unfinished"
    return auto_checkpoints_engine
