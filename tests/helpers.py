"""Assertions shared by several test modules."""

from __future__ import annotations


def assert_same_outputs(outs, refs, tol: float = 1e-5) -> None:
    """Each RequestOutput in `outs` has its reference's prompt ids, sampled tokens and top logprobs
    (the same token ids, values within `tol`)."""
    for out, ref in zip(outs, refs):
        assert out.prompt_token_ids == ref.prompt_token_ids
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        for ours, theirs in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs):
            assert ours.keys() == theirs.keys()
            for token, value in ours.items():
                assert abs(value - theirs[token]) <= tol


def finish(engine) -> list:
    """Step `engine` until nothing is left; its integrity checked at the end. Returns every output the
    steps gave, sorted by request id."""
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    engine.check_integrity()
    return sorted(outs, key=lambda out: out.request_id)
