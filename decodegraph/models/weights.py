"""Loading Hugging Face checkpoints' tensors into our modules' parameters.

Under tensor parallelism a rank holds part of most matrices, and must read only that
part of the checkpoint: the safetensors iterator (models/loader.py) yields
`CheckpointSlice`s, lazy views of a tensor in its file, and each layer's weight_loader
narrows one to its rows or columns before it reads (layers/linear.py). A plain tensor
works wherever a slice does (it has `.shape` and `.narrow` too).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from decodegraph.layers.linear import default_weight_loader


class CheckpointSlice:
    """A tensor in a safetensors file, of which only a region is read: `narrow` selects
    (reading nothing), `read` reads what is selected.

    `source` is what `safe_open(...).get_slice(name)` returns: it must be read while its
    file is open, i.e. while the iterator that yielded it has not moved on."""

    def __init__(
        self, source: Any, shape: tuple[int, ...], region: tuple[tuple[int, int], ...] = ()
    ) -> None:
        self.source = source
        self.full_shape = tuple(shape)
        self.region = region or tuple((0, n) for n in shape)  # (start, stop) per dim

    @classmethod
    def of(cls, source: Any) -> CheckpointSlice:
        return cls(source, tuple(source.get_shape()))

    @property
    def shape(self) -> torch.Size:
        return torch.Size(stop - start for start, stop in self.region)

    def dim(self) -> int:
        return len(self.region)

    def numel(self) -> int:
        return self.shape.numel()

    def narrow(self, dim: int, start: int, length: int) -> CheckpointSlice:
        """Rows (or columns, ...) [start, start + length) of dimension `dim` of this
        selection, as `torch.Tensor.narrow` does; nothing is read."""
        dim = dim % len(self.region)
        lo, hi = self.region[dim]
        if start < 0 or length < 0 or lo + start + length > hi:
            raise ValueError(
                f"narrow({dim}, {start}, {length}) is outside a selection of shape "
                f"{tuple(self.shape)}"
            )
        region = list(self.region)
        region[dim] = (lo + start, lo + start + length)
        return CheckpointSlice(self.source, self.full_shape, tuple(region))

    def read(self) -> torch.Tensor:
        """The selected region, read from the file."""
        if not self.region:  # a 0-d tensor
            return self.source[...]
        return self.source[tuple(slice(start, stop) for start, stop in self.region)]

    def __repr__(self) -> str:
        return f"CheckpointSlice(shape={tuple(self.shape)}, of {self.full_shape})"


# HF checkpoint name fragment -> (our stacked parameter fragment, shard id).
_STACKED_PARAMS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_NUM_SHARDS = {"qkv_proj": 3, "gate_up_proj": 2}


def load_stacked_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor | CheckpointSlice]],
    tie_word_embeddings: bool,
) -> set[str]:
    """Copy Hugging Face-named tensors (or lazy slices of them) into `model`'s
    parameters, q/k/v and gate/up into their stacked projections, each through its
    layer's `weight_loader` (which takes this rank's part); returns the names of the
    parameters fully loaded (a stacked one only once all its shards arrived)."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    shards_seen: dict[str, set[int | str]] = {}
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name:
            continue  # old checkpoints saved the rope buffer; ours is computed
        if tie_word_embeddings and name == "lm_head.weight":
            continue  # some tied checkpoints store the copy anyway
        parts = name.split(".")
        stacked = next((p for p in parts if p in _STACKED_PARAMS), None)
        target = name
        if stacked is not None:
            fragment, shard_id = _STACKED_PARAMS[stacked]
            target = ".".join(fragment if p == stacked else p for p in parts)
        if target not in params:
            raise ValueError(
                f"unexpected weight {name!r} in the checkpoint: "
                f"{type(model).__name__} has no parameter {target!r}"
            )
        module = model.get_submodule(target.rsplit(".", 1)[0]) if "." in target else model
        try:
            if stacked is None:
                loader = getattr(module, "weight_loader", None)
                if loader is None:  # replicated: norms, ReplicatedLinear
                    default_weight_loader(params[target], tensor)
                else:
                    loader(params[target], tensor)
                loaded.add(target)
            else:
                module.weight_loader(params[target], tensor, shard_id)
                shards_seen.setdefault(target, set()).add(shard_id)
        except ValueError as e:
            raise ValueError(f"weight {name!r}: {e}") from None
    for target, seen in shards_seen.items():
        if len(seen) == _NUM_SHARDS[target.split(".")[-2]]:
            loaded.add(target)
    return loaded
