"""lm-eval-harness' `local-completions` model computes loglikelihoods against a running server
(echo + logprobs), on a small multiple-choice task written into a temporary directory (no
download); its numbers equal the offline prompt logprobs of the same token ids."""

from __future__ import annotations

import json
import math

import pytest

from forkpoint import SamplingParams

DOCS = [
    {"question": "Listing: steel kettle, 1.7 l, 2200 W. Same product as 'kettle 1.7 litre'? Answer:",
     "choices": ["yes", "no"], "answer": 0},
    {"question": "Listing: steel kettle, 1.7 l, 2200 W. Same product as 'glass teapot'? Answer:",
     "choices": ["yes", "no", "maybe"], "answer": 1},
]
TASK = """task: forkpoint_match
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], int]:
    """lm-eval's split of (context, continuation) into token ids: trailing spaces of the context
    move to the continuation; the continuation's ids are those of the whole past the context's."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    return whole, len(tokenizer.encode(context, add_special_tokens=False))


def test_local_completions_loglikelihood(server, spare_llm, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (tmp_path / "forkpoint_match.yaml").write_text(TASK.format(data=data))
    model_args = (f"model={server.model},base_url={server.base_url}/v1/completions,"
                  f"tokenizer={server.llm.engine.model_path},tokenizer_backend=huggingface,"
                  "tokenized_requests=True,max_retries=1,num_concurrent=1")
    # this directory's task only: indexing lm-eval's ~14k built-in task files as well took ~5 s
    task_manager = TaskManager(include_path=str(tmp_path), include_defaults=False)
    results = lm_eval.simple_evaluate(model="local-completions", model_args=model_args, tasks=["forkpoint_match"],
                                      task_manager=task_manager, num_fewshot=0, log_samples=True, batch_size=1)
    samples = results["samples"]["forkpoint_match"]
    assert len(samples) == len(DOCS)
    tokenizer = spare_llm.get_tokenizer()
    for sample in samples:
        for (context, continuation), response in zip(sample["arguments"], sample["resps"]):
            ids, ctxlen = encode_pair(tokenizer, context, continuation)
            out = spare_llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=1),
                                     use_tqdm=False)[0]
            expected = sum(float(out.prompt_logprobs[i][ids[i]]) for i in range(ctxlen, len(ids)))
            loglikelihood = response[0][0]
            assert math.isclose(loglikelihood, expected, abs_tol=1e-4), (context, continuation)
    assert 0.0 <= results["results"]["forkpoint_match"]["acc,none"] <= 1.0
