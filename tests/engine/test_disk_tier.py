"""The disk tier (`checkpoint_dir`): a second engine on the same directory reuses what the first
computed, with outputs equal to a run without reuse; a damaged or foreign file, or one that cannot be
read, is a miss with its reason and leaves nothing behind (float32 CPU, tiny model)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from forkpoint import LLM, SamplingParams
from forkpoint.cache.disk_format import HEADER_BYTES, SUFFIX
from forkpoint.config import EngineConfig
from tests.helpers import assert_same_outputs
from tests.tiny_models import token_words, words

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
MARK = "<|mamba_checkpoint|>"
SYSTEM = token_words(3, 70)  # 70 tokens: 4 full blocks and a partial one


def disk_llm(model_dir, directory, **kwargs) -> LLM:
    return LLM(str(model_dir), num_kv_blocks=256, checkpoint_dir=str(directory), **kwargs)


def settle(llm: LLM) -> None:
    """The checkpoints made so far are on disk: an engine that went idle applied its last saves
    (`_persist_when_idle`), and the writer has finished them."""
    llm.engine.runner.storage.disk.flush()


def computed(llm: LLM, prompt) -> tuple[object, int]:
    before = llm.metrics()["prompt_tokens_computed"]
    out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    return out, llm.metrics()["prompt_tokens_computed"] - before


def system_files(directory) -> list:
    """This model's checkpoint files of the system prompt's marked prefix (70 tokens)."""
    return sorted(directory.glob(f"*/70-*{SUFFIX}"))


def first_run(model_dir, directory) -> LLM:
    llm = disk_llm(model_dir, directory)
    llm.generate([f"{SYSTEM} {MARK} {words(1)}", f"{SYSTEM} {MARK} {words(2)}"], GREEDY, use_tqdm=False)
    settle(llm)
    return llm


def test_a_restarted_engine_reuses_the_system_prompt_exactly(model_dir, plain, tmp_path):
    first = first_run(model_dir, tmp_path)
    assert first.metrics()["checkpoints_saved_to_disk"] >= 1 and len(system_files(tmp_path)) == 1
    repeat = f"{SYSTEM} {words(4, 5)}"
    out, count = computed(first, repeat)
    settle(first)

    # every hit restored: the 71-token prompt end saves 1 token over the 70-token checkpoint already on the
    # device, which the restore rule on would (rightly, at CPU rates) recompute (tests/engine/test_reuse_rule.py)
    second = disk_llm(model_dir, tmp_path, checkpoint_restore_rule=False)
    assert second.metrics()["disk_tier_checkpoints"] >= 2
    salted, _ = computed(second, {"prompt": f"{SYSTEM} {words(3)}", "cache_salt": "tenant"})
    assert salted.num_cached_tokens == 0  # the salt is part of every key: the files are another tenant's
    fresh, fresh_count = computed(second, f"{SYSTEM} {words(3)}")
    assert fresh.num_cached_tokens == 70 and fresh.cache_miss_reason is None
    assert fresh_count == len(fresh.prompt_token_ids) - 70
    again, again_count = computed(second, repeat)  # the first engine's prompt end: one token to compute
    assert again.num_cached_tokens == len(again.prompt_token_ids) - 1 and again_count == 1
    assert second.metrics()["checkpoints_loaded_from_disk"] == 2
    assert second.metrics()["disk_reads_ahead_used"] == 2  # read while queued, taken at admission
    refs = plain.generate([{"prompt_token_ids": o.prompt_token_ids} for o in (fresh, again, out)], GREEDY,
                          use_tqdm=False)
    assert_same_outputs([fresh, again, out], refs)
    assert_same_outputs([again], [out])
    second.engine.check_integrity()


def _truncate(path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: HEADER_BYTES + (len(data) - HEADER_BYTES) // 2])


def _flip_payload_bit(path) -> None:
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x10  # a bit of the last attention layer's V
    path.write_bytes(bytes(data))


def _flip_header_bit(path) -> None:
    data = bytearray(path.read_bytes())
    data[60] ^= 0x01  # inside num_tokens
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, reason", [(_truncate, "disk_truncated"), (_flip_payload_bit, "disk_corrupt"),
                                            (_flip_header_bit, "disk_corrupt")])
def test_a_damaged_file_is_a_miss_with_its_reason_and_is_deleted(model_dir, plain, tmp_path, damage, reason):
    first_run(model_dir, tmp_path)
    [path] = system_files(tmp_path)
    damage(path)
    second = disk_llm(model_dir, tmp_path)
    out, count = computed(second, f"{SYSTEM} {words(3, 8, 9)}")  # (its prompt end is not at 70)
    assert out.num_cached_tokens == 0 and count == len(out.prompt_token_ids)
    assert out.cache_miss_reason == reason
    assert second.metrics()[f"disk_files_rejected_{reason.removeprefix('disk_')}"] == 1
    assert second.metrics()[f"cache_misses_{reason}"] == 1
    second.engine.check_integrity()  # the slot and blocks taken for the file were released
    settle(second)
    assert not path.exists()  # deleted (after any pending write)
    ref = plain.generate({"prompt_token_ids": out.prompt_token_ids}, GREEDY, use_tqdm=False)
    assert_same_outputs([out], ref)


def test_files_of_another_model_or_dtype_are_never_read(model_dir, tmp_path, tiny_model_factory):
    """Another dtype (or model) has its own subdirectory: it reuses nothing from the first; a file of
    the first put in its place is foreign, a miss, and deleted."""
    first_run(model_dir, tmp_path)
    [path] = system_files(tmp_path)
    other = disk_llm(model_dir, tmp_path, dtype="bfloat16")
    out, _ = computed(other, f"{SYSTEM} {words(3)}")  # its prompt end: a 70-token file of its own
    assert out.num_cached_tokens == 0
    settle(other)
    [own] = [p for p in system_files(tmp_path) if p.parent != path.parent]
    own.write_bytes(path.read_bytes())  # the float32 engine's file under the bfloat16 engine's name
    again = disk_llm(model_dir, tmp_path, dtype="bfloat16")
    out, _ = computed(again, f"{SYSTEM} {words(6, 8, 9)}")
    assert out.num_cached_tokens == 0 and out.cache_miss_reason == "disk_foreign"
    again.engine.check_integrity()
    settle(again)
    assert not own.exists()

    qwen_dir = tiny_model_factory("qwen3_5_text")[0]
    another = disk_llm(qwen_dir, tmp_path)
    assert another.metrics()["disk_tier_checkpoints"] == 0  # the others' files only take room
    out, _ = computed(another, f"{SYSTEM} {words(3)}")
    assert out.num_cached_tokens == 0


def test_a_read_error_is_a_miss_and_releases_everything(model_dir, plain, tmp_path):
    first_run(model_dir, tmp_path)
    [path] = system_files(tmp_path)
    second = disk_llm(model_dir, tmp_path)
    path.unlink()
    path.mkdir()  # reading it now fails in the operating system (IsADirectoryError)
    out, _ = computed(second, f"{SYSTEM} {words(3)}")
    assert out.num_cached_tokens == 0 and out.cache_miss_reason == "disk_read_error"
    second.engine.check_integrity()
    assert path.is_dir()  # an unreadable file is left alone, no longer counted
    ref = plain.generate({"prompt_token_ids": out.prompt_token_ids}, GREEDY, use_tqdm=False)
    assert_same_outputs([out], ref)


def test_disk_restores_that_evict_each_other_stay_exact(model_dir, plain, tmp_path):
    """A device pool of one checkpoint slot: each restore from disk evicts the checkpoint restored
    before it, which spills to the host tier from the row its own restore wrote (the writes apply in
    the order recorded) and comes back from there; in one batch, the restores compete for the one
    slot while readers pin it. Every output equals the run without reuse."""
    anchors = [token_words(10 + i, 37) for i in range(3)]
    first = disk_llm(model_dir, tmp_path, auto_checkpoints=False)
    first.generate([f"{a} {MARK} {words(1)}" for a in anchors], GREEDY, use_tqdm=False)
    settle(first)
    prompts = [{"prompt": f"{a} {words(i)}"} for i in (2, 3) for a in anchors]
    second = disk_llm(model_dir, tmp_path, auto_checkpoints=False, checkpoint_pool_size=1,
                      checkpoint_host_bytes=64 << 20, checkpoint_restore_rule=False)  # (every hit restored)
    outs = [second.generate(p, GREEDY, use_tqdm=False)[0] for p in prompts]
    assert [o.num_cached_tokens for o in outs] == [37] * 6
    metrics = second.metrics()
    assert metrics["checkpoints_loaded_from_disk"] == 3 and metrics["checkpoints_restored"] == 3
    second.engine.check_integrity()
    third = disk_llm(model_dir, tmp_path, auto_checkpoints=False, checkpoint_pool_size=1, checkpoint_restore_rule=False)
    batch = third.generate(prompts, GREEDY, use_tqdm=False)
    assert batch[0].num_cached_tokens == 37 and third.metrics()["checkpoints_loaded_from_disk"] >= 1
    third.engine.check_integrity()
    refs = plain.generate([{"prompt_token_ids": o.prompt_token_ids} for o in outs], GREEDY, use_tqdm=False)
    assert_same_outputs(outs, refs)
    assert_same_outputs(batch, refs)


def test_reset_prefix_cache_deletes_the_files(model_dir, tmp_path):
    first = first_run(model_dir, tmp_path)
    assert first.metrics()["disk_files_written"] >= 3 and system_files(tmp_path)
    assert first.reset_prefix_cache()
    settle(first)
    assert first.metrics()["disk_tier_checkpoints"] == 0 and not system_files(tmp_path)
    out, count = computed(disk_llm(model_dir, tmp_path), f"{SYSTEM} {words(3, 8, 9)}")
    assert out.num_cached_tokens == 0 and count == len(out.prompt_token_ids)


def test_a_process_that_exits_leaves_its_files_written(model_dir, plain, tmp_path):
    """No flush: the writer drains its queue at interpreter exit, so a restart finds the files."""
    script = (f"from forkpoint import LLM, SamplingParams\n"
              f"llm = LLM({str(model_dir)!r}, num_kv_blocks=256, checkpoint_dir={str(tmp_path)!r})\n"
              f"llm.generate([{SYSTEM + ' ' + MARK + ' ' + words(1)!r}, {SYSTEM + ' ' + MARK + ' ' + words(2)!r}],"
              f" SamplingParams(max_tokens=1), use_tqdm=False)\n")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300, cwd=Path(__file__).parents[2])
    assert len(system_files(tmp_path)) == 1
    out, count = computed(disk_llm(model_dir, tmp_path), f"{SYSTEM} {words(3, 8, 9)}")
    assert out.num_cached_tokens == 70 and count == len(out.prompt_token_ids) - 70
    ref = plain.generate({"prompt_token_ids": out.prompt_token_ids}, GREEDY, use_tqdm=False)
    assert_same_outputs([out], ref)


def test_bad_disk_tier_settings_are_value_errors(model_dir, tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(ValueError, match="cannot be used .* pass a writable directory"):
        disk_llm(model_dir, tmp_path / "file")
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        EngineConfig(checkpoint_dir=str(tmp_path), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="checkpoint_dir_bytes must be >= 1"):
        EngineConfig(checkpoint_dir=str(tmp_path), checkpoint_dir_bytes=0)


@pytest.mark.gpu
def test_gpu_a_disk_restore_gives_the_device_checkpoints_bits(model_dir, tmp_path):
    """CUDA (bfloat16, pinned copies waited on by the writer): the second engine's checkpoint, read
    from the file, holds the bits of the first engine's device checkpoint (state rows, and KV over the
    70 prefix tokens), and a consumer of it samples what the first engine's device-hit consumer did."""
    first = disk_llm(model_dir, tmp_path, device="cuda")
    first.generate(f"{SYSTEM} {MARK} {words(1)}", GREEDY, use_tqdm=False)
    [kept] = [c for c in first.engine.registry if c.num_tokens == 70]
    key = kept.key

    def bits(llm: LLM) -> list:
        checkpoint = llm.engine.registry.get(key)
        storage = llm.engine.runner.storage
        index = torch.tensor(checkpoint.blocks, device="cuda")
        kv = [t.index_select(0, index).flatten(0, 1)[:70].cpu() for t in storage.k + storage.v]
        return [storage.conv_stack[:, checkpoint.slot].cpu(), storage.ssm_stack[:, checkpoint.slot].cpu(), *kv]

    expected = bits(first)
    settle(first)
    # the second engine runs the consumer first: had the first engine run it before, the second would
    # find that run's own prompt-end checkpoint (72 tokens) on disk instead of the 70-token one
    second = disk_llm(model_dir, tmp_path, device="cuda")
    disk_hit = second.generate(f"{SYSTEM} {words(3, 8, 9)}", GREEDY, use_tqdm=False)[0]
    device_hit = first.generate(f"{SYSTEM} {words(3, 8, 9)}", GREEDY, use_tqdm=False)[0]
    assert device_hit.num_cached_tokens == disk_hit.num_cached_tokens == 70
    assert second.metrics()["checkpoints_loaded_from_disk"] == 1
    assert all(torch.equal(a, b) for a, b in zip(expected, bits(second)))
    assert disk_hit.outputs[0].token_ids == device_hit.outputs[0].token_ids
    assert_same_outputs([disk_hit], [device_hit], tol=1e-3)
    second.engine.check_integrity()


def test_the_directory_stays_within_its_bytes_and_equal_to_the_index(model_dir, tmp_path):
    """checkpoint_dir_bytes of about three files: the least recently used leave (deleted in order
    after their writes), and the files on disk are exactly those the tier counts."""
    probe = first_run(model_dir, tmp_path / "probe")
    size = max(p.stat().st_size for p in (tmp_path / "probe").glob(f"*/*{SUFFIX}"))
    capacity = 3 * size + size // 2
    llm = disk_llm(model_dir, tmp_path / "bounded", checkpoint_dir_bytes=capacity)
    for seed in range(5):
        llm.generate(f"{token_words(20 + seed, 60)} {MARK} {words(1)}", GREEDY, use_tqdm=False)
    settle(llm)
    files = list((tmp_path / "bounded").glob(f"*/*{SUFFIX}*"))
    metrics = llm.metrics()
    assert metrics["checkpoints_dropped_from_disk"] > 0 and len(files) == metrics["disk_tier_checkpoints"]
    assert sum(p.stat().st_size for p in files) == metrics["disk_tier_bytes"] <= capacity
    llm.engine.check_integrity()
    probe.engine.check_integrity()
