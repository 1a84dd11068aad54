"""The piecewise forward (runner/piecewise.py) without CUDA graphs: the static buffers, padding and
piece/core plumbing that the graphs replay must give the plain forward's logits and pool writes, for
text steps and steps that compute image tokens alike."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from forkpoint import LLM, SamplingParams
from forkpoint.config import EngineConfig
from forkpoint.runner.piecewise import PiecewiseForward, default_cuda_graph_sizes
from tests.helpers import assert_same_outputs
from tests.tiny_models import IMAGE, MAMBA2_MODEL_TYPES, random_image

MARK = "<|mamba_checkpoint|>"
SIZES = (1, 2, 4, 8, 16, 32, 64)  # every step below fits; most are padded
ENGINE = dict(num_kv_blocks=64, block_size=8, max_num_seqs=8, max_num_batched_tokens=48)
TOL = dict(rtol=1e-5, atol=1e-5)  # float32: only the padded matmul shapes differ


def pool_tensors(caches) -> list[torch.Tensor]:
    return [*caches.conv, *caches.ssm, *caches.k, *caches.v]


class BothPaths:
    """Stands in for `ModelRunner.forward`: runs each step through the plain forward, restores the
    pools, runs it again through the piecewise forward, and checks logits and pools agree."""

    def __init__(self, runner, piecewise: PiecewiseForward) -> None:
        self.runner, self.piecewise = runner, piecewise
        self.kinds: set[str] = set()
        self.padded = 0
        self.image_steps = 0

    def __call__(self, batch):
        caches = self.runner.caches
        assert self.piecewise.accepts(batch)
        before = [t.clone() for t in pool_tensors(caches)]
        plain = self.runner.model(batch, caches)
        after = [t.clone() for t in pool_tensors(caches)]
        for tensor, saved in zip(pool_tensors(caches), before):
            tensor.copy_(saved)
        piecewise = self.piecewise(batch, caches)
        torch.testing.assert_close(piecewise, plain, **TOL)
        for tensor, expected in zip(pool_tensors(caches), after):
            torch.testing.assert_close(tensor, expected, **TOL)  # incl. rows no real token touches
        rows = self.piecewise.bucket(batch.num_tokens)
        assert torch.isfinite(self.piecewise.residual[:rows]).all()  # padding rows included
        # the recurrent cores ran through the stacked states: the offset selects the last one's rows
        assert self.piecewise.recurrent_row_offset.item() == (len(caches.conv) - 1) * caches.conv_stack.shape[1]
        has_decode = batch.decode is not None
        self.kinds.add("decode only" if has_decode and not batch.phases else
                       "prefill only" if not has_decode else "mixed")
        if len(batch.phases) >= 2:
            self.kinds.add("two phases")
        self.padded += rows > batch.num_tokens
        self.image_steps += batch.embedding_overrides is not None and batch.mrope_positions is not None
        return plain


def words(start: int, count: int) -> str:
    return " ".join(f"w{i}" for i in range(start, start + count))


# Mamba2: Nemotron-H (core-less MLP / MoE blocks, ReLU^2 experts) and Falcon-H1 (parallel layers);
# Granite-4.0-H's layers are of kinds these cover (its stacked core: test_piecewise)
@pytest.mark.parametrize("model_type", ["qwen3_5_moe_text", "qwen3_5_text", "nemotron_h", "falcon_h1"])
def test_piecewise_steps_match_plain_forward(tiny_model_factory, model_type):
    directory, _ = tiny_model_factory(model_type)
    llm = LLM(str(directory), **ENGINE)
    runner = llm.engine.runner
    both = BothPaths(runner, PiecewiseForward(runner.model, SIZES, runner.device, capture=False))
    runner.forward = both
    anchor = words(0, 13)  # 13 tokens: the shared last block is partial
    prompts = [f"{anchor} {MARK} w20 w21", f"{anchor} {MARK} w22", f"{anchor} w23 w24 w25",
               words(30, 70),  # chunked under the 48-token budget, next to the others' decodes
               "w5"]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)

    assert both.kinds == {"prefill only", "two phases", "mixed", "decode only"}
    assert both.padded > 0
    assert outs[1].num_cached_tokens == 13
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    llm.engine.check_integrity()


@pytest.mark.parametrize("model_type", ["qwen3_5_moe", "qwen3_5"])
def test_image_steps_through_piecewise_path_match_plain_forward(tiny_model_factory, model_type):
    """Steps that compute image tokens (embedding overrides, [3, T] rotary positions) take the
    piecewise path: images split across chunks, next to decodes and text prefills, one-to-N."""
    directory, _ = tiny_model_factory(model_type)
    llm = LLM(str(directory), **ENGINE)
    runner = llm.engine.runner
    both = BothPaths(runner, PiecewiseForward(runner.model, SIZES, runner.device, capture=False))
    runner.forward = both
    anchor = f"{words(0, 9)} {IMAGE} {words(9, 3)}"  # 9 + 1 + 15 + 1 + 3 = 29 tokens
    images = [random_image(40 + i, 16 + 8 * i, 16) for i in range(3)]
    prompts = [{"prompt": f"{anchor}{MARK} {words(20 + i, 2)} {IMAGE} {words(30, 2)}",
                "multi_modal_data": {"image": [random_image(1, 40, 24), images[i]]}} for i in range(3)]
    prompts += [{"prompt": words(50, 30)}, {"prompt": f"{IMAGE} w7", "multi_modal_data": {"image": [images[0]]}}]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)

    assert both.image_steps >= 2 and both.padded > 0
    assert "mixed" in both.kinds  # an image prefill next to decodes
    assert [o.num_cached_tokens for o in outs][:3] == [0, 29, 29]
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    llm.engine.check_integrity()


class StackedCoreCheck:
    """Stands in for `ModelRunner.forward`: before each step runs, checks that every recurrent layer's
    core through the stacked states (`recurrent_core`: flattened pools, row offset j * S, the layer's
    core parameters in separate buffers, the one function the piecewise forward replays; then a
    parallel layer's `attention_core`) equals the layer's own `core`, output and both whole stacks
    bit-identical, on the step's metadata and pools."""

    def __init__(self, runner) -> None:
        self.runner, self.steps, self.phases = runner, 0, 0

    def __call__(self, batch):
        model, caches = self.runner.model, self.runner.caches
        conv, ssm = caches.conv_stack, caches.ssm_stack
        rows_per_layer = conv.shape[1]
        generator = torch.Generator().manual_seed(self.steps)
        hidden, cos_sin = model.embed(batch.input_ids, batch.positions)
        hidden = hidden + torch.randn(hidden.shape, generator=generator)  # layers see distinct inputs
        saved = conv.clone(), ssm.clone()
        for j, layer_id in enumerate(model.config.recurrent_layer_ids):
            p = model.project(layer_id, hidden, cos_sin)
            plain = model.core(layer_id, p, batch, caches)
            expected = conv.clone(), ssm.clone()
            conv.copy_(saved[0])
            ssm.copy_(saved[1])
            out = torch.full_like(plain, float("nan"))
            offset = torch.tensor(j * rows_per_layer)
            params = model.recurrent_core_params(layer_id)
            params = type(params)(*(None if t is None else t.clone() for t in params))
            model.recurrent_core(p, batch, conv.flatten(0, 1), ssm.flatten(0, 1), params, offset, out)
            if model.core_kind(layer_id) == "parallel":
                model.attention_core(layer_id, p, batch, caches, out)
            assert torch.equal(out, plain)
            assert torch.equal(conv, expected[0]) and torch.equal(ssm, expected[1])
            conv.copy_(saved[0])
            ssm.copy_(saved[1])
        self.steps += 1
        self.phases = max(self.phases, len(batch.phases) + (batch.decode is not None))
        return model(batch, caches)


@pytest.mark.parametrize("model_type", ["qwen3_5_moe_text", *MAMBA2_MODEL_TYPES])
def test_stacked_state_core_equals_each_layers_core(tiny_model_factory, model_type):
    llm = LLM(str(tiny_model_factory(model_type)[0]), **ENGINE)
    runner = llm.engine.runner
    check = StackedCoreCheck(runner)
    runner.forward = check
    anchor = words(0, 13)
    prompts = [f"{anchor} {MARK} w20 w21", f"{anchor} {MARK} w22", words(30, 20)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(llm.engine.model_config.recurrent_layer_ids) >= 2 and check.phases >= 2 and check.steps >= 3
    assert llm.engine.runner.storage.ssm_stack[:, 1:].abs().sum() > 0  # the checks ran on non-trivial states
    llm.engine.check_integrity()


def test_piecewise_without_stacked_states_runs_cores_per_layer(moe_model):
    llm = LLM(str(moe_model[0]), **ENGINE)
    engine = llm.engine
    piecewise = PiecewiseForward(engine.runner.model, (32,), engine.device, capture=False)
    engine.add_request("r", words(0, 20), SamplingParams(max_tokens=1))
    step = engine.scheduler.schedule()
    plan = step.plan
    batch, _ = engine.runner.prepare(plan)
    caches = engine.runner.caches
    before = [t.clone() for t in pool_tensors(caches)]
    stacked = piecewise(batch, caches)
    for tensor, saved in zip(pool_tensors(caches), before):
        tensor.copy_(saved)
    per_layer = piecewise(batch, dataclasses.replace(caches, conv_stack=None, ssm_stack=None))
    torch.testing.assert_close(per_layer, stacked, rtol=0, atol=0)
    foreign = dataclasses.replace(caches, conv=[t.clone() for t in caches.conv])
    with pytest.raises(ValueError, match="not views of conv_stack"):
        piecewise(batch, foreign)
    engine.scheduler.commit(step)
    engine.abort_request("r")
    engine.check_integrity()


class CountingPiecewise(PiecewiseForward):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[int] = []

    def forward(self, batch, caches):
        self.calls.append(batch.num_tokens)
        return super().forward(batch, caches)


def test_generation_through_piecewise_path_equals_plain(moe_model):
    plain = LLM(str(moe_model[0]), **ENGINE)
    llm = LLM(str(moe_model[0]), **ENGINE)
    runner = llm.engine.runner
    runner.piecewise = CountingPiecewise(runner.model, (2, 8, 32), runner.device, capture=False)
    anchor = words(40, 21)
    prompts = [f"{anchor} {MARK} {words(70, n)}" for n in (1, 5, 12)] + [words(90, 40), "w7 w8"]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    refs = plain.generate(prompts, params, use_tqdm=False)
    outs = llm.generate(prompts, params, use_tqdm=False)

    assert_same_outputs(outs, refs, tol=1e-4)
    assert [o.num_cached_tokens for o in outs] == [r.num_cached_tokens for r in refs] == [0, 21, 21, 0, 0]
    calls = runner.piecewise.calls
    assert calls and max(calls) <= 32
    assert llm.metrics()["steps"] > len(calls)  # the steps above 32 tokens took the plain forward
    llm.engine.check_integrity()


def test_accepts_steps_up_to_the_largest_bucket(moe_model):
    llm = LLM(str(moe_model[0]), **ENGINE)
    engine = llm.engine
    assert engine.runner.piecewise is None  # CPU: the plain forward, always
    piecewise = PiecewiseForward(engine.runner.model, (16, 4, 4), engine.device, capture=False)
    assert piecewise.sizes == (4, 16)
    assert [piecewise.bucket(n) for n in (1, 4, 5, 16)] == [4, 4, 16, 16]
    engine.add_request("r", words(0, 20), SamplingParams(max_tokens=1))
    step = engine.scheduler.schedule()
    plan = step.plan
    batch, _ = engine.runner.prepare(plan)
    assert not piecewise.accepts(batch)  # 20 tokens > 16
    with pytest.raises(ValueError, match="at most 16 tokens"):
        piecewise(batch, engine.runner.caches)
    small = dataclasses.replace(batch, input_ids=batch.input_ids[:3], positions=batch.positions[:3])
    assert piecewise.accepts(small)
    assert piecewise.accepts(dataclasses.replace(small, mrope_positions=small.positions.expand(3, -1)))
    with pytest.raises(ValueError, match="CUDA device"):
        PiecewiseForward(engine.runner.model, (4,), engine.device, capture=True)
    engine.runner.forward(batch)  # the plain forward; keeps the engine consistent
    engine.scheduler.commit(step)
    engine.abort_request("r")
    engine.check_integrity()


def test_default_sizes_and_config():
    assert default_cuda_graph_sizes(8192) == (1, 2, 4, 8, 16, 32, 64, 128, 256, 384) + tuple(range(512, 8193, 512))
    assert default_cuda_graph_sizes(48) == (1, 2, 4, 8, 16, 32, 48)
    assert default_cuda_graph_sizes(1000) == (1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512, 1000)
    assert default_cuda_graph_sizes(1 << 20)[-1] == 8192
    config = EngineConfig(cuda_graph_sizes=[64, 1, 8, 8])
    assert config.cuda_graph_sizes == (1, 8, 64) and not config.enforce_eager
    with pytest.raises(ValueError, match="token counts >= 1"):
        EngineConfig(cuda_graph_sizes=[0, 4])
    with pytest.raises(ValueError, match="exceeds max_num_batched_tokens"):
        EngineConfig(cuda_graph_sizes=[1, 4096], max_num_batched_tokens=2048)


def test_projection_views_live_in_the_static_stacked_buffer(moe_model, monkeypatch):
    # Qwen's projection GEMM writes into the piecewise forward's static stacked buffer, so the fields
    # that are its column views (GDN mixed and z, attention v) are not copied by the pieces
    llm = LLM(str(moe_model[0]), **ENGINE)
    model = llm.engine.runner.model
    piecewise = PiecewiseForward(model, (8,), llm.engine.device, capture=False)
    recurrent, attention = piecewise.projection["recurrent"], piecewise.projection["attention"]
    stacked = {kind: piecewise.stacked[kind].untyped_storage().data_ptr() for kind in ("recurrent", "attention")}

    def in_stacked(kind, t):
        return t.untyped_storage().data_ptr() == stacked[kind]

    assert in_stacked("recurrent", recurrent.mixed) and in_stacked("recurrent", recurrent.z)
    assert not in_stacked("recurrent", recurrent.g) and in_stacked("attention", attention.v)
    assert piecewise.stacked["recurrent"].shape == (8, model.projection_width(model.config.gdn_layer_ids[0]))
    copied = []
    copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda dst, src, *a, **k: copied.append(tuple(dst.shape))
                        or copy(dst, src, *a, **k))
    with torch.inference_mode():
        piecewise._piece(0, 8)  # projects the first core layer (GDN): copies g and beta only
    assert tuple(recurrent.mixed.shape) not in copied and tuple(recurrent.z.shape) not in copied
    assert tuple(recurrent.g.shape) in copied


def test_capture_failure_cause_names_the_op_that_broke_the_capture():
    from forkpoint.runner.piecewise import capture_failure_cause

    def upload_inside_kernel_wrapper():
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore detail")

    try:
        upload_inside_kernel_wrapper()
    except RuntimeError as err:
        cause = capture_failure_cause(err)
    assert cause.startswith("CUDA error: operation not permitted when stream is capturing (raised in "
                            "upload_inside_kernel_wrapper at ")
    assert "more detail" not in cause
