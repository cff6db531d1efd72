"""The shared-memory all-reduce of a tensor-parallel group whose ranks share one host.

gloo over loopback costs 1.5-2 ms per all-reduce of one decode row on two cores, and a
decode step makes two per layer; a shared-memory segment does it in microseconds. The
exchange itself is the C++ operator `decodegraph_cpu::shm_all_reduce` (and
`shm_all_gather`), csrc/shm_all_reduce.h, which a CPU graph calls as an opaque op with a
tensor and an integer handle: no Python object in the graph, so Inductor's C++ wrapper
can call it too. This module makes and names the segment:

1. every rank says whether it can take part (same host as rank 0, the CPU operators
   loaded, DECODEGRAPH_CPU_SHM_ALLREDUCE not 0); unless all can, the group keeps gloo;
2. rank 0 creates the segment under /dev/shm with a unique name and broadcasts the
   name; every rank maps it and reports back;
3. rank 0 unlinks the name once every rank has mapped it (or failed to): the memory lives
   on while mapped, and nothing is left under /dev/shm, even if a rank crashes later.

Tensors larger than a slot, and dtypes other than float32 and bfloat16, take gloo.
"""

from __future__ import annotations

import os
import socket
import uuid

import torch
import torch.distributed as dist

# Bytes of one rank's slot (a segment holds two per rank): a prefill chunk of 1,024
# tokens of a 1,024-wide float32 model; larger tensors take gloo.
DEFAULT_SLOT_BYTES = 4 << 20
# How long a call waits for a peer before it fails, naming that peer.
DEFAULT_TIMEOUT_S = 600.0

_SHM_DTYPES = (torch.float32, torch.bfloat16)


class ShmAllReduce:
    """One mapped segment of a group: `all_reduce` / `all_gather` where `applies`."""

    def __init__(self, handle: int, name: str, world_size: int, slot_bytes: int) -> None:
        self.handle = handle
        self.name = name  # already unlinked: for logs and tests
        self.world_size = world_size
        self.slot_bytes = slot_bytes

    def fits(self, x: torch.Tensor) -> bool:
        """Whether `x` fits one slot, on the CPU."""
        return x.device.type == "cpu" and x.numel() * x.element_size() <= self.slot_bytes

    def applies(self, x: torch.Tensor) -> bool:
        """Whether `all_reduce(x)` runs here (else the caller takes gloo)."""
        return x.dtype in _SHM_DTYPES and self.fits(x)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.decodegraph_cpu.shm_all_reduce(x, self.handle)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' `x` stacked along dim 0 (all_gather_into_tensor's layout)."""
        return torch.ops.decodegraph_cpu.shm_all_gather(x, self.handle, self.world_size)

    def close(self) -> None:
        torch.ops.decodegraph_cpu.shm_segment_close(self.handle)

    def __repr__(self) -> str:
        return f"ShmAllReduce({self.name}, {self.slot_bytes} bytes a slot)"


def _why_not_here() -> str | None:
    """Why this rank cannot use a segment, or None where it can."""
    if os.environ.get("DECODEGRAPH_CPU_SHM_ALLREDUCE", "1") == "0":
        return "DECODEGRAPH_CPU_SHM_ALLREDUCE=0"
    from decodegraph import native

    if native.load_cpu_ops() is None or not hasattr(torch.ops.decodegraph_cpu, "shm_all_reduce"):
        return "the CPU operators are not built"
    return None


def create_shm_all_reduce(
    rank: int,
    world_size: int,
    group: dist.ProcessGroup,
    timeout_s: float | None = None,
    slot_bytes: int = DEFAULT_SLOT_BYTES,
) -> tuple[ShmAllReduce | None, str]:
    """Every rank of gloo `group` calls this at once: the group's mapped segment (None
    where it keeps gloo) and, for the log, why. `timeout_s` bounds each call's wait for a
    peer (DECODEGRAPH_DIST_TIMEOUT_S wins, else 600 s)."""
    env_timeout = os.environ.get("DECODEGRAPH_DIST_TIMEOUT_S")
    timeout = float(env_timeout) if env_timeout else (timeout_s or DEFAULT_TIMEOUT_S)
    local = (socket.gethostname(), _why_not_here())
    views: list = [None] * world_size
    dist.all_gather_object(views, local, group=group)
    if len({host for host, _ in views}) > 1:
        return None, f"ranks on {len({host for host, _ in views})} hosts"
    reasons = [f"rank {r}: {why}" for r, (_, why) in enumerate(views) if why is not None]
    if reasons:
        return None, "; ".join(reasons)

    box = [f"/decodegraph-{os.getpid()}-{uuid.uuid4().hex[:12]}" if rank == 0 else None]
    handle, error = None, None
    if rank == 0:
        try:
            handle = torch.ops.decodegraph_cpu.shm_segment_open(
                box[0], rank, world_size, slot_bytes, timeout
            )
        except RuntimeError as e:
            error = str(e).splitlines()[0]
            box[0] = None
    dist.broadcast_object_list(box, src=0, group=group)
    name = box[0]
    if name is None:
        return None, f"rank 0: {error}"
    if rank != 0:
        try:
            handle = torch.ops.decodegraph_cpu.shm_segment_open(
                name, rank, world_size, slot_bytes, timeout
            )
        except RuntimeError as e:
            error = str(e).splitlines()[0]
    errors: list = [None] * world_size
    dist.all_gather_object(errors, error, group=group)
    if rank == 0:
        torch.ops.decodegraph_cpu.shm_segment_unlink(name)
    dist.barrier(group=group)  # so that no rank sees the name once this returns
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
    if failed:
        if handle is not None:
            torch.ops.decodegraph_cpu.shm_segment_close(handle)
        return None, "; ".join(failed)
    slot = torch.ops.decodegraph_cpu.shm_segment_slot_bytes(handle)
    return ShmAllReduce(
        handle, name, world_size, slot
    ), f"{slot >> 10} KiB slots, {timeout:g} s timeout"
