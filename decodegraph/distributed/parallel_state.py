"""The tensor-parallel group of this process, and the collectives the model calls.

Every rank of the world is one tensor-parallel group (pipeline parallelism does not
exist here). Until `init_distributed_environment` runs, the group is a world of one,
and the collectives are identities: a single-process engine never touches
torch.distributed.

The collectives a forward calls (all-reduce, all-gather) are the functional ones
(`torch.ops._c10d_functional`, what `torch.distributed._functional_collectives` is
built on): each returns a new tensor and is followed by an explicit `wait_tensor`, so
make_fx records them as graph nodes and Inductor compiles them into a CPU graph; on
CUDA they run on NCCL inside a captured graph. On a gloo group whose ranks share one
host both go through a shared-memory segment instead (distributed/shm_all_reduce.py:
the operators `decodegraph_cpu::shm_all_reduce` and `shm_all_gather`, opaque in a
graph like the functional ones), except for tensors too large for its slots and, for
the all-reduce, dtypes other than float32 and bfloat16. `TPGroup.broadcast` and
`broadcast_object` are eager helpers for the runner (rank 0's sampled ids), never
called inside a graph.
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

from decodegraph.distributed.shm_all_reduce import ShmAllReduce, create_shm_all_reduce

logger = logging.getLogger(__name__)


class TPGroup:
    """This process's tensor-parallel group: its rank, its size, and the process groups
    collectives run on (`device_group` for tensors on the model's device, `cpu_group`, a
    gloo group, for host objects; both None in a world of one)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        device_group: dist.ProcessGroup | None = None,
        cpu_group: dist.ProcessGroup | None = None,
        shm: ShmAllReduce | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device_group = device_group
        self.cpu_group = cpu_group if cpu_group is not None else device_group
        # The name the functional collectives find the group by.
        self.group_name: str | None = device_group.group_name if device_group else None
        # The ranks' shared-memory segment, where they share a host (else None: gloo).
        self.shm = shm

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, as a new tensor (`x` itself at world size 1)."""
        if self.world_size == 1:
            return x
        if self.shm is not None and self.shm.applies(x):
            return self.shm.all_reduce(x)
        out = torch.ops._c10d_functional.all_reduce(x, "sum", self.group_name)
        return torch.ops._c10d_functional.wait_tensor(out)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' `x` concatenated along `dim`, in rank order (`x` at world size 1)."""
        if self.world_size == 1:
            return x
        dim = dim % x.dim()
        # The collective stacks along dim 0; other dims are put together from its chunks.
        if self.shm is not None and self.shm.fits(x):
            out = self.shm.all_gather(x)
        else:
            out = torch.ops._c10d_functional.all_gather_into_tensor(
                x.contiguous(), self.world_size, self.group_name
            )
            out = torch.ops._c10d_functional.wait_tensor(out)
        if dim == 0:
            return out
        return torch.cat(out.chunk(self.world_size, dim=0), dim=dim)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s `tensor` written into every rank's `tensor` (eager, in place)."""
        if self.world_size > 1:
            dist.broadcast(tensor, src=src, group=self.device_group)
        return tensor

    def broadcast_object(self, obj: object = None, src: int = 0) -> object:
        """Rank `src`'s picklable `obj` on every rank (other ranks' `obj` is ignored)."""
        if self.world_size == 1:
            return obj
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src, group=self.cpu_group)
        return box[0]

    def barrier(self) -> None:
        """Wait until every rank got here."""
        if self.world_size > 1:
            dist.barrier(group=self.cpu_group)

    def __repr__(self) -> str:
        return f"TPGroup(rank={self.rank}, world_size={self.world_size})"


_SINGLE = TPGroup(0, 1)
_TP_GROUP: TPGroup | None = None


def init_distributed_environment(
    world_size: int,
    rank: int,
    init_method: str,
    backend: str,
    local_rank: int = 0,
    timeout_s: float | None = None,
) -> None:
    """Join the `world_size`-process group at `init_method` (e.g. "tcp://127.0.0.1:29500")
    as `rank` with `backend` ("gloo" on CPU, "nccl" on CUDA), and make every rank one
    tensor-parallel group. `timeout_s` bounds each collective (a dead peer then fails
    the others instead of hanging them). At world size 1 no process group is made.
    A gloo group on one host gets a shared-memory all-reduce (module docstring);
    DECODEGRAPH_CPU_SHM_ALLREDUCE=0 keeps gloo."""
    global _TP_GROUP
    if _TP_GROUP is not None:
        if (_TP_GROUP.rank, _TP_GROUP.world_size) != (rank, world_size):
            raise RuntimeError(
                f"the distributed environment is already initialised as {_TP_GROUP}; "
                f"cannot re-initialise as rank {rank} of {world_size}"
            )
        return
    if world_size == 1:
        _TP_GROUP = TPGroup(0, 1)
        return
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    kwargs = {} if timeout is None else {"timeout": timeout}
    if not dist.is_initialized():
        dist.init_process_group(
            backend, init_method=init_method, world_size=world_size, rank=rank, **kwargs
        )
    ranks = list(range(world_size))
    device_group = dist.new_group(ranks, backend=backend, **kwargs)
    # Host objects go through gloo whatever the device backend is.
    cpu_group = device_group if backend == "gloo" else dist.new_group(ranks, "gloo", **kwargs)
    shm, why = None, f"backend {backend}"
    if backend == "gloo":
        shm, why = create_shm_all_reduce(rank, world_size, cpu_group, timeout_s)
    _TP_GROUP = TPGroup(rank, world_size, device_group, cpu_group, shm)
    logger.info(
        "rank %d of %d (local rank %d): backend %s at %s; all-reduce: %s (%s)",
        rank,
        world_size,
        local_rank,
        backend,
        init_method,
        "shared memory" if shm is not None else backend,
        why,
    )


def destroy_distributed_environment() -> None:
    """Leave the process group (if any); the group is a world of one again."""
    global _TP_GROUP
    if _TP_GROUP is not None and _TP_GROUP.shm is not None:
        _TP_GROUP.shm.close()
    _TP_GROUP = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def get_tp_group() -> TPGroup:
    """This process's tensor-parallel group (a world of one when not initialised)."""
    return _TP_GROUP if _TP_GROUP is not None else _SINGLE


def get_tensor_model_parallel_rank() -> int:
    return get_tp_group().rank


def get_tensor_model_parallel_world_size() -> int:
    return get_tp_group().world_size


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of `x` over the tensor-parallel ranks (`x` itself at world size 1)."""
    return get_tp_group().all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The tensor-parallel ranks' `x` concatenated along `dim` (`x` at world size 1)."""
    return get_tp_group().all_gather(x, dim)
