"""The runner's storage: the cache tensors the bookkeeping's indices address, and the plans' device
writes applied to them. A recorded engine run's plans (checkpoints, turn ends, host-tier spills,
restores and drops) replayed on fresh storages, directly and through a pickled copy of each plan,
give the engine's own bytes: a plan is a complete description of what a step does to device memory."""

from __future__ import annotations

import pickle

import pytest
import torch

from forkpoint import LLM, SamplingParams
from forkpoint.cache.sizing import PoolShapes, PoolSizes
from forkpoint.cache.state_pool import RecurrentStateSpec
from forkpoint.runner.model_runner import ModelRunner
from forkpoint.runner.storage import DeviceStorage
from forkpoint.step.plan import HostDrop, Restore, Spill, StateCopy

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _spec(conv_dim: int, width: int, heads: int, k: int, v: int) -> RecurrentStateSpec:
    """A GDN-shaped state: conv [conv_dim, width - 1], SSM [heads, k, v], float32."""
    return RecurrentStateSpec((conv_dim, width - 1), torch.float32, (heads, k, v), torch.float32)


def _storage(sizes: PoolSizes, block_size: int, spec: RecurrentStateSpec, *, attention_layers: int = 1,
             recurrent_layers: int = 2, kv_dtype: torch.dtype = torch.float32) -> DeviceStorage:
    shapes = PoolShapes(attention_layers, 2, 8, kv_dtype, recurrent_layers, spec)
    return DeviceStorage(sizes, block_size, shapes, CPU)


def test_storage_takes_any_mixer_declaration():
    spec = RecurrentStateSpec((20, 3), torch.bfloat16, (4, 8, 6), torch.float32)  # Mamba2: [H, P, N]
    storage = _storage(PoolSizes(6, 3, 2), 4, spec, recurrent_layers=5)
    # rows: zero, 3 requests, 2 checkpoints, scratch
    assert storage.conv_stack.shape == (5, 7, 20, 3) and storage.conv_stack.dtype == torch.bfloat16
    assert storage.ssm_stack.shape == (5, 7, 4, 8, 6) and storage.ssm_stack.dtype == torch.float32
    assert storage.scratch_slot == 6
    # the scratch block sits after the counted ones
    assert storage.scratch_block == 6 and storage.k[0].shape[0] == 7
    storage.check_integrity()


def test_storage_zero_row():
    storage = _storage(PoolSizes(4, 2, 1), 4, _spec(12, 4, 2, 4, 4))
    storage.check_integrity()
    storage.ssm[0][0, 0, 0, 0] = 1.0
    with pytest.raises(AssertionError, match="zero state row"):
        storage.check_integrity()


def test_storage_layers_are_views_of_the_stacked_states():
    spec = _spec(12, 4, 2, 4, 4)
    storage = _storage(PoolSizes(4, 2, 1), 4, spec, recurrent_layers=3)
    # rows: zero, 2 requests, 1 checkpoint, scratch
    assert storage.conv_stack.shape == (3, 5, 12, 3) and storage.ssm_stack.shape == (3, 5, 2, 4, 4)
    assert 3 * spec.bytes * 5 == (storage.conv_stack.numel() * 4 + storage.ssm_stack.numel() * 4)
    for layer in range(3):
        assert storage.conv[layer].is_contiguous() and storage.ssm[layer].is_contiguous()
        storage.conv[layer][1].fill_(layer + 1.0)
        storage.ssm[layer][2].fill_(layer + 5.0)
    # layer i's rows are rows i * S .. i * S + S - 1 of the flattened stacks
    flat_conv, flat_ssm = storage.conv_stack.flatten(0, 1), storage.ssm_stack.flatten(0, 1)
    assert [flat_conv[i * 5 + 1, 0, 0].item() for i in range(3)] == [1.0, 2.0, 3.0]
    assert [flat_ssm[i * 5 + 2, 0, 0, 0].item() for i in range(3)] == [5.0, 6.0, 7.0]
    storage.check_integrity()
    storage.conv_stack[2, 0, 5, 1] = 1.0  # layer 2's zero row, through the stack
    with pytest.raises(AssertionError, match="zero state row"):
        storage.check_integrity()
    storage.conv_stack[2, 0].zero_()
    storage.ssm[1] = storage.ssm[1].clone()  # a layer no longer in the stack
    with pytest.raises(AssertionError, match="no longer views"):
        storage.check_integrity()


def test_writes_copy_spill_restore_and_drop_in_order():
    storage = _storage(PoolSizes(6, 2, 2), 4, _spec(6, 4, 2, 2, 2), attention_layers=2)
    for layer, (k, v) in enumerate(zip(storage.k, storage.v)):
        k.copy_(torch.randn(k.shape, generator=torch.Generator().manual_seed(layer)))
        v.copy_(-k)
    storage.conv_stack[:, 1].fill_(3.0)
    storage.ssm_stack[:, 1].fill_(4.0)
    kv = [t[[2, 4]].clone() for t in storage.k + storage.v]
    # the row copy lands before the spill reads row 3; the spill reads row 3 before the restore overwrites it
    storage.apply([StateCopy(1, 3), Spill(0, 3, (2, 4)), Spill(1, 1, ()), StateCopy(2, 3)])
    assert not storage.conv_stack[:, 3].any() and sorted(storage.host) == [0, 1]
    for t in storage.k + storage.v:
        t[[2, 4]] = 0.0
    storage.apply([HostDrop(1), Restore(0, 4, (5, 1))], first=4)
    assert list(storage.host) == []
    assert (storage.conv_stack[:, 4] == 3.0).all() and (storage.ssm_stack[:, 4] == 4.0).all()
    for saved, t in zip(kv, storage.k + storage.v):
        assert torch.equal(t[[5, 1]], saved)
    # a failed step's writes come again in the next plan: the applied ones are skipped, once each
    storage.apply([Restore(0, 4, (5, 1)), StateCopy(4, 2)], first=5)
    assert storage.writes_applied == 7 and (storage.conv_stack[:, 2] == 3.0).all()
    with pytest.raises(RuntimeError, match="never applied"):
        storage.apply([StateCopy(1, 3)], first=8)
    with pytest.raises(ValueError, match="zero state row"):
        storage.apply([StateCopy(1, 0)], first=7)
    storage.check_integrity()


def test_recorded_plans_replayed_directly_and_pickled_give_the_engines_bytes(model_dir):
    """An engine with a checkpoint pool of two slots and a host tier of about two checkpoints: its
    prompt-end and turn-end checkpoints evict each other, spill, come back and leave the host tier.
    Its plans, replayed through fresh runners on fresh storages (the same model), give its bytes."""
    llm = LLM(str(model_dir), num_kv_blocks=96, checkpoint_pool_size=2, auto_checkpoint_min_tokens=16,
              checkpoint_host_bytes=70_000)
    engine = llm.engine
    recorded: list[tuple[object, bytes]] = []
    execute = engine.runner.execute

    def record(plan, *args, **kwargs):
        recorded.append((plan, pickle.dumps(plan)))
        return execute(plan, *args, **kwargs)

    engine.runner.execute = record
    generator = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": torch.randint(0, 150, (n,), generator=generator).tolist()} for n in (40, 50, 60)]
    outs = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in prompts + prompts[:2]]
    turns = [llm.generate({"prompt_token_ids": o.prompt_token_ids + o.outputs[0].token_ids + [5]}, GREEDY,
                          use_tqdm=False)[0] for o in outs[:3]]
    # the first two conversations' turn ends come back from the host tier
    assert [o.num_cached_tokens for o in turns[:2]] == [43, 53]
    engine.check_integrity()
    kinds = {type(w) for plan, _ in recorded for w in plan.writes}
    assert kinds == {StateCopy, Spill, Restore, HostDrop}, kinds
    assert engine.metrics()["checkpoints_restored"] >= 1

    shapes = engine.runner.model.pool_shapes(engine.dtype)
    sizes = PoolSizes(engine.block_pool.num_blocks, engine.state_pool.requests.count,
                      engine.state_pool.checkpoints.count)
    # the third through the host tier's arena (the CUDA path's bookkeeping and byte layout)
    direct, pickled, arena = (ModelRunner(engine.runner.model, DeviceStorage(
        sizes, engine.config.block_size, shapes, CPU, host_arena_bytes=arena_bytes), CPU)
        for arena_bytes in (0, 0, engine.config.checkpoint_host_bytes))
    for plan, blob in recorded:
        direct.execute(plan)
        pickled.execute(pickle.loads(blob))
        arena.execute(plan)
        arena.storage.check_integrity()
    expected = engine.runner.storage.tensors()
    assert expected["ssm_stack"].abs().sum() > 0 and any(name.startswith("host") for name in expected)
    for runner in (direct, pickled, arena):
        replayed = runner.storage.tensors()
        assert replayed.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(replayed[name], tensor), name


@pytest.fixture(scope="module")
def model_dir(moe_model):
    return moe_model[0]
