"""Piecewise CUDA graphs (runner/piecewise.py) against the eager forward, on CUDA (skipped without).

Tiny random transformers-built Qwen3.5-MoE with the GPU kernels' head sizes (tests/models/
test_gpu_model.py), text-only and with a vision tower, bfloat16. Graph and eager paths run the same kernels;
they differ only where a
graph computes on a padded bucket (GEMMs of another row count round differently), so logits agree
to bf16 rounding and greedy tokens are identical. The graph path includes the per-step GDN core
graph (captured after the first GDN layer, replayed for the others with their state row offset).
Measured values are printed (`pytest -s`, lines starting with GPU_GRAPHS).
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from forkpoint import LLM, SamplingParams
from tests.models.test_gpu_model import ENGINE, GPU_DIMS, lengthen_memory, max_logprob_diff, random_ids
from tests.tiny_models import IMAGE, build_tiny_model, random_image, words

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
GRAPH_REL_TOL = 1e-2  # graph vs eager, both bf16 CUDA, ||graph - eager|| / ||eager||: logits and pool rows per step
GRAPH_LOGPROB_TOL = 0.05  # graph vs eager over whole generations, max |logprob difference| of the top 5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpu_graphs")
    build_tiny_model(directory, "qwen3_5_moe_text", fused_experts=True, **GPU_DIMS)
    lengthen_memory(directory)
    return directory


@pytest.fixture(scope="module")
def image_model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpu_graphs_images")
    # rotary_dim 32: 16 frequencies, split over the T, H, W axes
    rope = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5, mrope_section=[6, 5, 5])
    build_tiny_model(directory, "qwen3_5_moe", fused_experts=True, rope_parameters=rope, **GPU_DIMS)
    lengthen_memory(directory)
    return directory


def make_llm(model_dir, **kwargs) -> LLM:
    return LLM(str(model_dir), **{"device": "cuda", "dtype": "bfloat16", **ENGINE, **kwargs})


def test_capture_every_bucket_and_when_not_to(model_dir):
    llm = make_llm(model_dir, cuda_graph_sizes=SIZES)
    piecewise = llm.engine.runner.piecewise
    num_layers = llm.engine.model_config.num_layers
    assert piecewise is not None and sorted(piecewise.graphs) == list(SIZES)
    assert all(len(graphs) == num_layers + 1 for graphs in piecewise.graphs.values())
    assert make_llm(model_dir, enforce_eager=True).engine.runner.piecewise is None
    # float32 routes the experts through the reference MoE, which syncs: eager, with a warning
    assert make_llm(model_dir, dtype="float32").engine.runner.piecewise is None
    # the default buckets stop at max_num_batched_tokens
    default = make_llm(model_dir, max_num_batched_tokens=96).engine.runner.piecewise
    assert default.sizes == (1, 2, 4, 8, 16, 32, 64, 96)


def slot_rows(tensor: torch.Tensor, block_size: int, is_kv: bool) -> torch.Tensor:
    """Pool tensor as rows of one state slot or one KV token slot: [rows, -1]."""
    return tensor.reshape(tensor.shape[0] * block_size, -1) if is_kv else tensor.reshape(tensor.shape[0], -1)


def assert_same_pool_writes(tensors, before, after, is_kv, block_size: int) -> None:
    """Pool tensors after a graph step against their copies `before` and `after` the eager step (the
    tensors restored to `before` in between): rows the eager step wrote hold its values to bf16
    rounding (GRAPH_REL_TOL), every other row is bit-identical."""
    for tensor, old, new, kv in zip(tensors, before, after, is_kv):
        old_rows, new_rows = slot_rows(old, block_size, kv), slot_rows(new, block_size, kv)
        rows = slot_rows(tensor, block_size, kv)
        written = (old_rows != new_rows).any(dim=1)
        assert torch.equal(rows[~written], old_rows[~written]), "the graph path wrote rows the eager step did not"
        if written.any():
            ref = new_rows[written].float()
            assert ((rows[written].float() - ref).norm() / ref.norm().clamp_min(1e-6)).item() <= GRAPH_REL_TOL


class GraphVsEager:
    """Stands in for `ModelRunner.forward`: each step runs eagerly, the pools are restored, then it
    runs through the graphs. Checks the logits, that the graphs write the pools' rows the eager step
    writes (to bf16 rounding) and leave every other row bit-identical."""

    def __init__(self, runner, block_size: int) -> None:
        self.runner, self.block_size = runner, block_size
        self.worst, self.argmax_equal, self.steps, self.padded = 0.0, True, 0, 0
        self.image_steps = 0

    def __call__(self, batch):
        runner = self.runner
        caches = runner.caches
        assert runner.piecewise.accepts(batch)
        tensors = [*caches.conv, *caches.ssm, *caches.k, *caches.v]
        is_kv = [False] * (len(caches.conv) + len(caches.ssm)) + [True] * (len(caches.k) + len(caches.v))
        before = [t.clone() for t in tensors]
        eager = runner.model(batch, caches)
        after = [t.clone() for t in tensors]
        for tensor, saved in zip(tensors, before):
            tensor.copy_(saved)
        graph = runner.piecewise(batch, caches)
        rel = ((graph - eager).norm() / eager.norm()).item()
        self.worst = max(self.worst, rel)
        self.argmax_equal &= bool(torch.equal(graph.argmax(-1), eager.argmax(-1)))
        self.steps += 1
        self.padded += runner.piecewise.bucket(batch.num_tokens) > batch.num_tokens
        self.image_steps += batch.embedding_overrides is not None and batch.mrope_positions is not None
        assert_same_pool_writes(tensors, before, after, is_kv, self.block_size)
        return eager


def test_graph_steps_match_eager_steps(model_dir):
    llm = make_llm(model_dir, max_num_batched_tokens=64, cuda_graph_sizes=(1, 2, 4, 8, 16, 32, 64))
    engine = llm.engine
    check = GraphVsEager(engine.runner, engine.config.block_size)
    engine.runner.forward = check
    generator = torch.Generator().manual_seed(11)
    anchor = random_ids(generator, 37)
    marker = llm.checkpoint_token_id
    prompts = [{"prompt_token_ids": anchor + [marker] + random_ids(generator, n)} for n in (3, 1, 9)]
    prompts += [{"prompt_token_ids": random_ids(generator, n)} for n in (150, 5)]  # chunked next to decodes
    piecewise = engine.runner.piecewise
    core_graph_steps = piecewise.core_graph_steps
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    print(f"GPU_GRAPHS per-step logits graph vs eager: worst rel err {check.worst:.3e} over {check.steps} steps "
          f"({check.padded} padded), argmax equal: {check.argmax_equal} (tol {GRAPH_REL_TOL:.0e})")
    assert check.worst <= GRAPH_REL_TOL and check.argmax_equal and check.padded > 0
    # every step (decodes, mixed, two-phase checkpoint steps) replayed a captured GDN core
    assert piecewise.core_graph_steps - core_graph_steps == check.steps and piecewise.core_capture_failures == 0
    assert outs[1].num_cached_tokens == len(anchor)
    engine.check_integrity()


def image_prompts(marker: str) -> list[dict]:
    """One-to-N with images: an anchor with an image, a checkpoint, suffixes with their own image."""
    anchor = f"{words(*range(0, 20))} {IMAGE} {words(20, 21, 22)}"  # 20 + 1 + 15 + 1 + 3 = 40 tokens
    prompts = [{"prompt": f"{anchor}{marker} {words(30 + i, 31)} {IMAGE} {words(40 + i)}",
                "multi_modal_data": {"image": [random_image(1, 40, 24), random_image(2 + i, 16 + 8 * i, 32)]}}
               for i in range(3)]
    return prompts + [{"prompt": words(*range(50, 120))}, {"prompt": f"{IMAGE} {words(7)}",
                                                          "multi_modal_data": {"image": [random_image(9, 32, 32)]}}]


def test_image_steps_through_graphs_match_eager_steps(image_model_dir):
    """Steps that compute image tokens replay the graphs (embedding overrides and [3, T] rotary
    computed eagerly into the static buffers) and match the eager forward."""
    llm = make_llm(image_model_dir, max_num_batched_tokens=64, cuda_graph_sizes=(1, 2, 4, 8, 16, 32, 64))
    engine = llm.engine
    assert engine.runner.piecewise is not None and engine.runner.piecewise.graphs
    check = GraphVsEager(engine.runner, engine.config.block_size)
    engine.runner.forward = check
    core_graph_steps = engine.runner.piecewise.core_graph_steps
    prompts = image_prompts("<|mamba_checkpoint|>")  # LLM's default checkpoint_token
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert engine.runner.piecewise.core_graph_steps - core_graph_steps == check.steps
    assert engine.runner.piecewise.core_capture_failures == 0
    print(f"GPU_GRAPHS image steps, per-step logits graph vs eager: worst rel err {check.worst:.3e} over "
          f"{check.steps} steps ({check.image_steps} with images, {check.padded} padded), argmax equal: "
          f"{check.argmax_equal} (tol {GRAPH_REL_TOL:.0e})")
    assert check.worst <= GRAPH_REL_TOL and check.argmax_equal
    assert check.image_steps >= 2 and check.padded > 0
    assert [o.num_cached_tokens for o in outs[:3]] == [0, 40, 40]
    engine.check_integrity()


def test_greedy_generation_with_graphs_equals_eager_including_one_to_n(model_dir):
    graphs = make_llm(model_dir, cuda_graph_sizes=SIZES)
    eager = make_llm(model_dir, cuda_graph_sizes=SIZES, enforce_eager=True)
    generator = torch.Generator().manual_seed(5)
    anchor = random_ids(generator, 150)
    suffixes = [random_ids(generator, n) for n in (5, 17, 40, 1, 64, 23)]
    marker = graphs.checkpoint_token_id
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    # round 1: producer and consumers in one step (two phases); round 2: from the ready checkpoint
    prompts = [{"prompt_token_ids": anchor + [marker] + s} for s in suffixes]
    prompts_plain = [{"prompt_token_ids": random_ids(generator, n)} for n in (3, 77, 300)]  # 300: eager step
    results = []
    for llm in (graphs, eager):
        results.append(llm.generate(prompts[:4], params, use_tqdm=False)
                       + llm.generate(prompts[4:] + prompts_plain, params, use_tqdm=False))
    outs, refs = results
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in refs]
    assert [o.num_cached_tokens for o in outs] == [0] + [len(anchor)] * 5 + [0, 0, 0]
    diff = max(max_logprob_diff(o, r) for o, r in zip(outs, refs))
    print(f"GPU_GRAPHS generation graph vs eager: max |logprob diff| {diff:.3e} (tol {GRAPH_LOGPROB_TOL})")
    assert diff <= GRAPH_LOGPROB_TOL
    for llm in (graphs, eager):
        llm.engine.check_integrity()


def decode_step_ms(llm: LLM, steps: int = 20) -> tuple[float, int]:
    """Median wall time of a 16-sequence decode step (host enqueue plus GPU; tiny model: host-bound), and
    how many of the `steps` timed steps a whole decode graph served (its replay count's growth; 0
    without decode graphs)."""
    engine = llm.engine
    graphs = engine.runner.decode_graphs
    generator = torch.Generator().manual_seed(9)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(16):
        engine.add_request(f"d{i}", {"prompt_token_ids": random_ids(generator, 20)}, params)
    engine.step()  # the prefill
    replays_before = graphs.replays if graphs is not None else 0
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    replays = (graphs.replays if graphs is not None else 0) - replays_before
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()
    return 1e3 * statistics.median(times), replays


def test_every_steady_decode_step_replays_a_graph(model_dir):
    """Each of the 20 timed decode steps is one whole-graph replay with graphs and none with
    enforce_eager; the step times are printed, not asserted (they are bench/'s, and eight workers share
    the GPU in the one GPU check: session 22 saw graphs 4.94 ms against eager 5.57 ms there)."""
    graphs, graph_replays = decode_step_ms(make_llm(model_dir, cuda_graph_sizes=SIZES))
    eager_llm = make_llm(model_dir, cuda_graph_sizes=SIZES, enforce_eager=True)
    assert eager_llm.engine.runner.decode_graphs is None
    eager, eager_replays = decode_step_ms(eager_llm)
    print(f"GPU_GRAPHS 16-sequence decode step, median: graphs {graphs:.2f} ms, eager {eager:.2f} ms")
    assert (graph_replays, eager_replays) == (20, 0)


def two_phase_prefill_ms(llm: LLM, steps: int = 6) -> tuple[float, int]:
    """Median wall time of an 880-token prefill through a checkpoint (600 + 280 tokens: two recurrent
    phases), one request per step, and the number of phases of the timed steps' batches."""
    engine = llm.engine
    runner = engine.runner
    forward, phases = runner.forward, set()

    def recording(batch):
        phases.add(len(batch.phases))
        return forward(batch)

    runner.forward = recording
    generator = torch.Generator().manual_seed(13)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for i in range(steps + 1):  # the first step warms up (compiles, autotunes)
        ids = random_ids(generator, 600) + [llm.checkpoint_token_id] + random_ids(generator, 280)
        engine.add_request(f"p{i}", {"prompt_token_ids": ids}, params)
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        while engine.has_unfinished_requests():
            engine.step()
    runner.forward = forward
    engine.check_integrity()
    return 1e3 * statistics.median(times[1:]), max(phases)


def test_gdn_core_graph_two_phase_prefill_time(model_dir):
    llm = make_llm(model_dir, max_num_batched_tokens=1024, cuda_graph_sizes=(16, 1024))
    piecewise = llm.engine.runner.piecewise
    with_cores, phases = two_phase_prefill_ms(llm)
    assert phases == 2 and piecewise.core_graph_steps > 0 and piecewise.core_capture_failures == 0
    piecewise.capture_cores = False
    steps = piecewise.core_graph_steps
    without, _ = two_phase_prefill_ms(llm)
    assert piecewise.core_graph_steps == steps
    print(f"GPU_GRAPHS 880-token two-phase prefill step, median: GDN core graph {with_cores:.2f} ms, "
          f"eager GDN cores {without:.2f} ms ({len(llm.engine.model_config.gdn_layer_ids)} GDN layers)")
