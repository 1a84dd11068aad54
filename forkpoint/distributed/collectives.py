"""The process group of one tensor-parallel engine and the collectives the forward needs.

The group is built directly on a `FileStore` (`ProcessGroupGloo` on CPU, `ProcessGroupNCCL` on CUDA),
never through `torch.distributed.init_process_group`: no process-wide default group, so one process may
hold several engines. Every collective has the group's timeout; a peer that dies makes gloo raise at
once ("Connection closed by peer"), a peer that hangs makes it raise after the timeout.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


class TensorParallelGroup:
    """Rank `rank` of `world` ranks over the store file `store_path`; tensors live on `device`."""

    def __init__(self, store_path: str, rank: int, world: int, device: torch.device, timeout_s: float) -> None:
        self.rank, self.world, self.device = rank, world, device
        store = dist.FileStore(store_path, world)
        timeout = datetime.timedelta(seconds=timeout_s)
        store.set_timeout(timeout)  # the rendezvous too: a rank that never joins is an error, not a hang
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._group = dist.ProcessGroupNCCL(store, rank, world, options)
        else:
            self._group = dist.ProcessGroupGloo(store, rank, world, timeout)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum of `tensor` over the ranks, in place (returns it). Every rank gets the same bits."""
        self._group.allreduce([tensor]).wait()
        return tensor

    def all_gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """tensor: [R, d] on each rank -> [R, world * d], rank r's columns at r * d .. r * d + d - 1."""
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world)]
        self._group.allgather([parts], [tensor]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's `tensor` into every rank's `tensor` (same shape and dtype on every rank), in place."""
        self._group.broadcast(tensor, 0).wait()
        return tensor

    def barrier(self) -> None:
        """Wait until every rank got here (an all-reduce of one element: works on both backends)."""
        self.all_reduce(torch.zeros(1, device=self.device))
