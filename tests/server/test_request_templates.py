"""A chat template supplied by the request (`chat_template_kwargs.chat_template`) is a 400 unless the
operator passes --trust-request-chat-template; then it renders in the sandbox, a breach of its limits
is a 400 within the time limit, and a bystander's request is not held up."""

from __future__ import annotations

import threading
import time

import pytest

from forkpoint.server.config import ServerConfig
from tests.server.conftest import serve
from tests.server.test_errors import _assert_error_body

TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")
NESTED = "{% for i in range(9999) %}{% for j in range(9999) %}{% endfor %}{% endfor %}"
MESSAGES = [{"role": "user", "content": "hello there"}]


def _chat(template: str, **extra) -> dict:
    return {"messages": MESSAGES, "max_tokens": 1, "chat_template_kwargs": {"chat_template": template}, **extra}


def test_refused_unless_the_operator_trusts_request_templates(server):
    error = _assert_error_body(server.post("/v1/chat/completions", json={"model": server.model, **_chat(TEMPLATE)}))
    assert error["param"] == "chat_template_kwargs" and "--trust-request-chat-template" in error["message"]
    error = _assert_error_body(server.post("/tokenize", json={"messages": MESSAGES,
                                                              "chat_template_kwargs": {"chat_template": TEMPLATE}}))
    assert error["param"] == "chat_template_kwargs"


@pytest.fixture(scope="module")
def trusting(spare_llm):
    with serve(spare_llm, ServerConfig(served_model_name="trusting", trust_request_chat_template=True)) as running:
        yield running


def test_trusted_template_renders_in_the_sandbox(trusting):
    tokens = trusting.post("/tokenize", json={"messages": MESSAGES,
                                              "chat_template_kwargs": {"chat_template": TEMPLATE}}).json()["tokens"]
    expected = trusting.post("/tokenize", json={"prompt": "[user] hello there\n[assistant]"}).json()["tokens"]
    assert tokens == expected
    response = trusting.post("/v1/chat/completions", json={"model": trusting.model, **_chat(TEMPLATE)})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == len(expected)


@pytest.mark.parametrize("template, breach", [
    (NESTED, "past its 2 s limit"),
    ("{{ 'a' * 3000000000 }}", "over the sandbox's limit"),
    ("{% for i in range(100000) %}{% endfor %}", "range of 100000 items"),
])
def test_a_breach_is_a_400_and_bystanders_keep_going(trusting, template, breach):
    bystander: dict = {}

    def one_token():
        start = time.monotonic()
        response = trusting.post("/v1/completions", json={"model": trusting.model, "prompt": "x", "max_tokens": 1})
        bystander.update(status=response.status_code, seconds=time.monotonic() - start)

    start = time.monotonic()
    hostile = threading.Thread(target=lambda: bystander.update(
        hostile=trusting.post("/v1/chat/completions", json={"model": trusting.model, **_chat(template)})))
    hostile.start()
    time.sleep(0.1)  # the template is rendering
    one_token()
    hostile.join()
    error = _assert_error_body(bystander["hostile"])
    assert breach in error["message"], error
    assert time.monotonic() - start < 2.0 + 3.0  # the limit, the kill and the server's own work
    assert bystander["status"] == 200 and bystander["seconds"] < 2.0 + 3.0
    trusting.engine_call(lambda engine: engine.check_integrity())
