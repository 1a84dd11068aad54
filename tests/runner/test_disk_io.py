"""The disk tier's bytes: a `DiskSave` applied by the storage becomes a verified file whose payload,
restored with `DiskRestore` into other rows and blocks, gives the same bits (bfloat16 conv states of
an odd size included); deletions follow the writes queued before them; a write that fails is counted
and leaves no file."""

from __future__ import annotations

import torch

from forkpoint.cache.disk_format import file_name, read_file
from forkpoint.cache.sizing import PoolShapes, PoolSizes
from forkpoint.cache.state_pool import RecurrentStateSpec
from forkpoint.runner.disk_io import DiskWriter, payload_tensors, split_payload
from forkpoint.runner.storage import DeviceStorage
from forkpoint.step.plan import DiskDrop, DiskRestore, DiskSave

IDENTITY = b"i" * 32
KEY = b"k" * 16


def storage_with_disk(root) -> DeviceStorage:
    spec = RecurrentStateSpec((5, 3), torch.bfloat16, (2, 3, 4), torch.float32)  # 15 bf16s: fp32 after them misaligned
    shapes = PoolShapes(2, 2, 4, torch.bfloat16, 3, spec)
    storage = DeviceStorage(PoolSizes(8, 2, 2), 4, shapes, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    for tensor in (storage.conv_stack, storage.ssm_stack, *storage.k, *storage.v):
        tensor.copy_(torch.randn(tensor.shape, generator=generator))
    storage.conv_stack[:, 0].zero_()
    storage.ssm_stack[:, 0].zero_()
    storage.attach_disk(DiskWriter(root, IDENTITY))
    return storage


def test_split_payload_reads_back_payload_tensors():
    generator = torch.Generator().manual_seed(1)
    tensors = [torch.randn((3, 5), generator=generator).to(torch.bfloat16), torch.randn((2, 2), generator=generator),
               torch.randn((1, 3), generator=generator).to(torch.float16), torch.randn((4,), generator=generator)]
    payload = bytearray(b"".join(t.view(torch.uint8).numpy().tobytes() for t in tensors))
    back = split_payload(payload, [(tuple(t.shape), t.dtype) for t in tensors])
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(tensors, back))


def test_save_then_restore_gives_the_same_bits(tmp_path):
    (tmp_path / "d").mkdir()
    storage = storage_with_disk(tmp_path)
    name = f"d/{file_name(6, KEY)}"
    storage.apply([DiskSave(name, KEY, 6, 6, "marker", 3, (4, 1))])
    expected = payload_tensors(storage.conv_stack[:, 3].clone(), storage.ssm_stack[:, 3].clone(),
                               [k[[4, 1]].clone() for k in storage.k], [v[[4, 1]].clone() for v in storage.v])
    storage.conv_stack[:, 3].zero_()  # the row is reused at once: the save copied it already
    storage.disk.flush()
    header, payload = read_file(tmp_path / name)
    assert (header.identity, header.key, header.num_tokens, header.num_blocks) == (IDENTITY, KEY, 6, 2)
    storage.apply([DiskRestore(5, (7, 0), payload), DiskDrop(name)], first=1)
    restored = payload_tensors(storage.conv_stack[:, 5], storage.ssm_stack[:, 5], [k[[7, 0]] for k in storage.k],
                               [v[[7, 0]] for v in storage.v])
    assert all(torch.equal(a, b) for a, b in zip(expected, restored))
    storage.disk.flush()
    assert not (tmp_path / name).exists() and storage.disk.counters.written == 1
    storage.check_integrity()


def test_a_drop_follows_the_write_queued_before_it_and_a_failed_write_leaves_nothing(tmp_path):
    (tmp_path / "d").mkdir()
    storage = storage_with_disk(tmp_path)
    name = f"d/{file_name(6, KEY)}"
    storage.apply([DiskSave(name, KEY, 6, 6, "marker", 3, (4, 1)), DiskDrop(name)])
    storage.disk.flush()
    assert list((tmp_path / "d").iterdir()) == []
    storage.apply([DiskSave(f"gone/{file_name(6, KEY)}", KEY, 6, 6, "marker", 3, (4,))], first=2)
    storage.disk.flush()  # no such directory: counted, logged, nothing left behind
    assert storage.disk.counters.write_errors == 1 and not (tmp_path / "gone").exists()
    storage.disk.close()


class _BrokenEvent:
    def synchronize(self) -> None:
        raise ValueError("injected: the copy never completed")


def test_the_writer_thread_outlives_a_failed_job(tmp_path):
    writer = DiskWriter(tmp_path, IDENTITY)
    tensors = [torch.arange(6, dtype=torch.float32), torch.ones(2, dtype=torch.bfloat16)]
    assert writer.save(file_name(3, KEY), KEY, 3, 3, 0, "marker", tensors, ready=_BrokenEvent())
    assert writer.save(file_name(4, KEY), KEY, 4, 4, 0, "marker", tensors)
    writer.flush()
    assert writer.counters.write_errors == 1 and writer.counters.written == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [file_name(4, KEY)] and writer.pending_bytes == 0
    header, payload = read_file(tmp_path / file_name(4, KEY))
    assert header.num_tokens == 4 and len(payload) == 6 * 4 + 2 * 2
    writer.close()
