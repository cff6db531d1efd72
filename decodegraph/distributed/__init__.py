"""torch.distributed groups and the collectives tensor-parallel layers call."""

from decodegraph.distributed.parallel_state import (
    TPGroup,
    destroy_distributed_environment,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    init_distributed_environment,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)

__all__ = [
    "TPGroup",
    "destroy_distributed_environment",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tp_group",
    "init_distributed_environment",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
]
