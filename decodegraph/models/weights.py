"""Loading Hugging Face checkpoints' tensors into our modules' parameters."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from decodegraph.layers.linear import default_weight_loader

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
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], tie_word_embeddings: bool
) -> set[str]:
    """Copy Hugging Face-named tensors into `model`'s parameters, q/k/v and gate/up into
    their stacked projections; returns the names of the parameters fully loaded (a
    stacked one only once all its shards arrived)."""
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
        try:
            if stacked is None:
                default_weight_loader(params[target], tensor)
                loaded.add(target)
            else:
                module = model.get_submodule(target.rsplit(".", 1)[0])
                module.weight_loader(params[target], tensor, shard_id)
                shards_seen.setdefault(target, set()).add(shard_id)
        except ValueError as e:
            raise ValueError(f"weight {name!r}: {e}") from None
    for target, seen in shards_seen.items():
        if len(seen) == _NUM_SHARDS[target.split(".")[-2]]:
            loaded.add(target)
    return loaded
