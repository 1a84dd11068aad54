"""Request-supplied chat templates run in a child process with limits: a breach is a ValueError
within about the time limit, the child is replaced, and ordinary templates render as transformers
renders them."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from forkpoint.inputs.chat import render_chat
from forkpoint.inputs.template_sandbox import SandboxedTemplate, TemplateLimits, TemplateSandbox
from forkpoint.inputs.tokenizer import load_tokenizer

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if tools %}{{ tools | tojson }}{% endif %}{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% endif %}{{ eos_token }}{{ flag }}")
CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi <|mamba_checkpoint|>"}]


@pytest.fixture(scope="module")
def sandbox():
    sandbox = TemplateSandbox(TemplateLimits(timeout_s=1.0, max_output_chars=100_000, max_range=1000,
                                             max_memory_bytes=512 << 20))
    yield sandbox
    sandbox.close()


def test_renders_as_transformers(sandbox, tiny_tokenizer_dir):
    tokenizer = load_tokenizer(tiny_tokenizer_dir, checkpoint_token=None).tokenizer
    tokenizer.add_special_tokens({"eos_token": "<|im_end|>"})
    kwargs = dict(add_generation_prompt=True, tools=[{"type": "function", "function": {"name": "f"}}], flag="!")
    expected = render_chat(tokenizer, CONVERSATION, chat_template=TEMPLATE, **kwargs)
    assert render_chat(tokenizer, CONVERSATION, chat_template=SandboxedTemplate(TEMPLATE, sandbox), **kwargs) \
        == expected


@pytest.mark.parametrize("template, breach", [
    ("{% for i in range(100000) %}x{% endfor %}", "range of 100000 items"),
    ("{% for i in range(1000) %}{% for j in range(1000) %}{% for k in range(1000) %}{% endfor %}{% endfor %}"
     "{% endfor %}", "past its 1 s limit"),
    ("{{ 'a' * 3000000000 }}", "over the sandbox's limit"),
    ("{% for i in range(1000) %}{{ 'a' * 99999 }}{% endfor %}", "rendered prompt is over"),
    ("{{ 10 ** 100000 }}", "exponent"),
    ("{{ raise_exception('no such role') }}", "no such role"),
    ("{{ messages.__class__.__mro__ }}", "unsafe"),
    ("{% set x = messages.append(1) %}", "SecurityError"),
])
def test_a_breach_is_a_value_error_within_the_limit(sandbox, template, breach):
    start = time.monotonic()
    with pytest.raises(ValueError, match=breach):
        SandboxedTemplate(template, sandbox).render(_Tokenizer(), CONVERSATION, add_generation_prompt=True)
    assert time.monotonic() - start < 1.0 + 1.5  # the limit plus the grace before the kill


def test_a_child_that_does_not_answer_is_killed_and_replaced(sandbox):
    """A child stuck past the deadline (stopped here with SIGSTOP, as one long C-level operation would
    be): the caller gets a 400-worthy ValueError in time, and the next render runs in a new child."""
    assert sandbox.render("{{ x }}", {"x": "up"}) == "up"
    killed = sandbox.num_killed
    os.kill(sandbox.child_pid, signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(ValueError, match="past its 1 s limit and was stopped"):
        sandbox.render("{{ x }}", {"x": "stuck"})
    assert time.monotonic() - start < 1.0 + 1.5
    assert sandbox.num_killed == killed + 1 and sandbox.child_pid is None
    assert sandbox.render("{{ x }}", {"x": "still serving"}) == "still serving"


def test_close_stops_a_render_at_once():
    """Shutdown does not wait for a template: close() mid-render kills the child, the render raises
    at once (not at its 5 s limit), and no later render starts a child."""
    sandbox = TemplateSandbox(TemplateLimits(timeout_s=5.0, max_range=10_000))
    loop = "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}"
    outcome: dict = {}

    def render() -> None:
        try:
            sandbox.render(loop, {})
        except ValueError as err:
            outcome["error"] = str(err)
        outcome["ended"] = time.monotonic()

    thread = threading.Thread(target=render, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while sandbox.child_pid is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.5)  # the child is inside the loop
    closed = time.monotonic()
    sandbox.close()
    assert time.monotonic() - closed < 1.0
    thread.join(5)
    assert outcome["ended"] - closed < 1.0 and "shutting down" in outcome["error"]
    with pytest.raises(ValueError, match="shutting down"):
        sandbox.render("{{ x }}", {"x": "late"})
    assert sandbox.child_pid is None


class _Tokenizer:
    special_tokens_map: dict = {}
