"""TEMPORARY stub until the model side lands (world size 1 only)."""

from __future__ import annotations

import torch


class TPGroup:
    rank = 0
    world_size = 1
    device_group = None

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return tensor


_TP = TPGroup()


def get_tp_group() -> TPGroup:
    return _TP
