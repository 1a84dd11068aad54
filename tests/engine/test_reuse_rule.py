"""The restore-versus-recompute rule in an engine (cache/reuse_rule.py, fed by engine.py's step times):
with the measured costs given so that moving a checkpoint back from the host or disk tier loses, the
request recomputes, says why (`recompute_faster`) and gives the outputs of a run without reuse; given
so that it wins, the hit is restored as before the rule; a restore the rule chose whose file cannot be
read is a clean miss (float32 CPU, tiny model)."""

from __future__ import annotations

from pathlib import Path

from forkpoint import SamplingParams
from forkpoint.cache.disk_format import SUFFIX
from forkpoint.cache.reuse_rates import MeasuredCost, ReuseRates, StepCost
from forkpoint.config import EngineConfig
from forkpoint.engine.builder import EngineBuilder
from forkpoint.engine.engine import LLMEngine
from tests.helpers import assert_same_outputs, finish
from tests.tiny_models import token_words, words

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
MARK = "<|mamba_checkpoint|>"
ANCHORS = [token_words(20 + i, 37) for i in range(2)]  # 37 tokens each


def slow_moves() -> ReuseRates:
    """A second per byte to move anything back (measured, say, on a broken link): every move loses."""
    return ReuseRates(host_restore=MeasuredCost(1.0, 1.0), disk_read=MeasuredCost(1.0, 1.0))


def free_moves() -> ReuseRates:
    """Moves measured as free and a prefill cost given: every move wins."""
    return ReuseRates(step=StepCost.per_token_prior(1e-3), host_restore=MeasuredCost(0.0, 1e12),
                      disk_read=MeasuredCost(0.0, 1e12), disk_restore=MeasuredCost(0.0, 1e12))


def engine(model_dir, rates: ReuseRates, **kwargs) -> LLMEngine:
    config = EngineConfig(model=str(model_dir), num_kv_blocks=256, **kwargs)
    return LLMEngine(config, EngineBuilder(config, reuse_rates=rates).build())


def run(llm: LLMEngine, prompts: list[str]) -> list:
    """Each prompt alone, in order (integrity checked after each); their outputs."""
    outs = []
    for i, prompt in enumerate(prompts):
        llm.add_request(f"r{i}-{len(llm.metrics())}", prompt, GREEDY, stream=False)
        outs.extend(finish(llm))
    return outs


def same_as_plain(plain, outs) -> None:
    refs = plain.generate([{"prompt_token_ids": o.prompt_token_ids} for o in outs], GREEDY, use_tqdm=False)
    assert_same_outputs(outs, refs)


def host_engine(model_dir, rates: ReuseRates) -> LLMEngine:
    """One device checkpoint slot and a host tier: the second anchor's checkpoint spills the first's."""
    llm = engine(model_dir, rates, checkpoint_pool_size=1, checkpoint_host_bytes=64 << 20)
    run(llm, [f"{anchor} {MARK} {words(1)}" for anchor in ANCHORS])
    assert llm.metrics()["checkpoints_spilled"] >= 1
    return llm


def test_a_host_restore_measured_slower_recomputes_with_its_reason(model_dir, plain):
    llm = host_engine(model_dir, slow_moves())
    [out] = run(llm, [f"{ANCHORS[0]} {MARK} {words(3)}"])
    metrics = llm.metrics()
    assert out.num_cached_tokens == 0 and out.cache_miss_reason == "recompute_faster"
    assert metrics["checkpoints_restored"] == 0 and metrics["checkpoint_restores_declined_host"] >= 1
    assert metrics["cache_misses_recompute_faster"] == 1 and metrics["reuse_prefill_s_per_token"] > 0
    same_as_plain(plain, [out])


def test_a_host_restore_measured_faster_restores_as_before(model_dir, plain):
    llm = host_engine(model_dir, free_moves())
    [out] = run(llm, [f"{ANCHORS[0]} {MARK} {words(3)}"])
    metrics = llm.metrics()
    assert out.num_cached_tokens == 37 and out.cache_miss_reason is None
    assert metrics["checkpoints_restored"] >= 1 and metrics["checkpoint_restores_declined_host"] == 0
    same_as_plain(plain, [out])


def disk_engine(model_dir, directory: Path, rates: ReuseRates) -> LLMEngine:
    return engine(model_dir, rates, checkpoint_dir=str(directory), auto_checkpoints=False)


def written(model_dir, directory: Path) -> Path:
    """A first engine writes the first anchor's checkpoint to a file; returns the file."""
    first = disk_engine(model_dir, directory, ReuseRates())
    run(first, [f"{ANCHORS[0]} {MARK} {words(1)}"])
    first.runner.storage.disk.flush()
    [path] = directory.glob(f"*/37-*{SUFFIX}")
    return path


def test_a_disk_read_measured_slower_is_never_issued_and_recomputes(model_dir, plain, tmp_path):
    written(model_dir, tmp_path)
    second = disk_engine(model_dir, tmp_path, slow_moves())
    run(second, [f"{ANCHORS[1]} {words(2)}"])  # a prefill measured: the rule has both sides now
    [out] = run(second, [f"{ANCHORS[0]} {words(3)}"])
    metrics = second.metrics()
    assert out.num_cached_tokens == 0 and out.cache_miss_reason == "recompute_faster"
    assert metrics["disk_reads_ahead"] == 0 and metrics["checkpoints_loaded_from_disk"] == 0
    assert metrics["checkpoint_restores_declined_disk"] >= 2  # the read ahead at queueing, the admission
    same_as_plain(plain, [out])


def test_a_disk_read_measured_faster_restores_as_before(model_dir, plain, tmp_path):
    written(model_dir, tmp_path)
    second = disk_engine(model_dir, tmp_path, free_moves())
    [out] = run(second, [f"{ANCHORS[0]} {words(3)}"])
    assert out.num_cached_tokens == 37 and out.cache_miss_reason is None
    assert second.metrics()["checkpoints_loaded_from_disk"] == 1
    same_as_plain(plain, [out])


def test_a_restore_the_rule_chose_whose_read_fails_is_a_clean_miss(model_dir, plain, tmp_path):
    path = written(model_dir, tmp_path)
    second = disk_engine(model_dir, tmp_path, free_moves())
    path.unlink()
    path.mkdir()  # reading it now fails in the operating system
    [out] = run(second, [f"{ANCHORS[0]} {words(3)}"])  # (finish checks the engine's integrity)
    assert out.num_cached_tokens == 0 and out.cache_miss_reason == "disk_read_error"
    assert second.metrics()["checkpoint_restores_declined_disk"] == 0
    same_as_plain(plain, [out])
