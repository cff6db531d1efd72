"""Find a checkpoint, read its config, build the model on its device and load weights.

Sources: a local directory (`config.json` plus one or several `*.safetensors`, the
latter listed by `model.safetensors.index.json`), a Hugging Face hub id (downloaded
with `huggingface_hub`), or `preset:NAME` (config in code, random weights).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoConfig, PretrainedConfig

from decodegraph.config import ModelConfig
from decodegraph.layers.linear import MergedColumnParallelLinear
from decodegraph.models.bundled import bundled_model_path
from decodegraph.models.presets import get_preset_config, is_preset
from decodegraph.models.registry import get_model_class
from decodegraph.models.weights import CheckpointSlice

if TYPE_CHECKING:
    from decodegraph.platforms.base import Platform

logger = logging.getLogger(__name__)

HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.jinja", "*.txt"]
SAFETENSORS_INDEX = "model.safetensors.index.json"


def resolve_model_path(model: str, revision: str | None = None) -> Path | None:
    """The local directory of `model`: itself when it is a directory, a hub snapshot
    otherwise; None for `preset:NAME` (no files). Raises ValueError with the reason and
    what to do when the hub cannot be reached or has no such model."""
    if is_preset(model):
        return None
    local = Path(model).expanduser()
    if local.is_dir():
        return local
    bundled = bundled_model_path(model)
    if bundled is not None:
        return bundled
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return Path(snapshot_download(model, revision=revision, allow_patterns=HUB_ALLOW_PATTERNS))
    except HFValidationError as e:
        raise ValueError(
            f"model: {model!r} is neither a local directory nor a valid Hugging Face hub id ({e})"
        ) from None
    except Exception as e:  # noqa: BLE001 - hub errors have many types; all mean "not fetched"
        raise ValueError(
            f"model: {model!r} is not a local directory and could not be fetched from the "
            f"Hugging Face hub ({type(e).__name__}: {e}). If this machine is offline "
            "(HF_HUB_OFFLINE=1 or no network), download it elsewhere and pass its local "
            "directory, or use a preset such as 'preset:llama-tiny'."
        ) from e


def load_hf_config(model_config: ModelConfig, path: Path | None = None) -> PretrainedConfig:
    """The Hugging Face config of the model (built in code for presets)."""
    if is_preset(model_config.model):
        return get_preset_config(model_config.model)
    if path is None:
        path = resolve_model_path(model_config.model, model_config.revision)
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"model: could not read config.json in {path}: {e}") from e


def get_config_dtype(hf_config: PretrainedConfig) -> torch.dtype | str | None:
    """The checkpoint's dtype (`dtype`, or `torch_dtype` in older configs), for
    `parse_dtype("auto", ...)`."""
    return getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def get_model(
    model_config: ModelConfig,
    hf_config: PretrainedConfig,
    dtype: torch.dtype,
    device: str | torch.device,
    path: Path | None = None,
    platform: Platform | None = None,
) -> nn.Module:
    """Build the model for `hf_config` on `device` in `dtype` and load its weights.

    Parameters are allocated uninitialised directly on the device in the target dtype
    (no random init, no copy), placed by `platform` (Platform.place_parameters), then
    written from safetensors or, for `load_format="dummy"` and presets, filled with
    random values; then the layers' `process_weights_after_loading` and the platform's
    `tune_for_weights`.
    """
    model_cls = get_model_class(hf_config)
    with _default_dtype(dtype), torch.device(device):
        model = model_cls(hf_config)
    model.eval()
    if platform is not None:
        platform.place_parameters(model)
    dummy = model_config.load_format == "dummy" or is_preset(model_config.model)
    if is_preset(model_config.model) and model_config.load_format == "safetensors":
        raise ValueError(
            f"load_format: {model_config.model!r} is a preset with no weights; use 'dummy'"
        )
    if dummy:
        if model_config.load_format != "dummy":
            logger.warning(
                "%s has no weights: using random ones (text will be noise)", model_config.model
            )
        initialize_dummy_weights(model, model_config.seed)
        return _after_loading(model, platform)
    if path is None:
        path = resolve_model_path(model_config.model, model_config.revision)
    loaded = model.load_weights(iterate_safetensors(path))
    missing = sorted(name for name, _ in model.named_parameters() if name not in loaded)
    if missing:
        shown = ", ".join(missing[:10]) + (
            f" (and {len(missing) - 10} more)" if len(missing) > 10 else ""
        )
        raise ValueError(f"checkpoint {path} is missing weights: {shown}")
    return _after_loading(model, platform)


def _after_loading(model: nn.Module, platform: Platform | None) -> nn.Module:
    """The layers' hooks, then the platform's choices that depend on the loaded weights."""
    process_weights_after_loading(model)
    if platform is not None:
        platform.tune_for_weights(model)
    return model


def process_weights_after_loading(model: nn.Module) -> None:
    """Let every layer that has the hook (vLLM's name) prepare its loaded weights."""
    for module in model.modules():
        hook = getattr(module, "process_weights_after_loading", None)
        if hook is not None:
            hook()


def list_safetensors_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory: those in the index if there is
    one, else every `*.safetensors` file."""
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"{index} lists shards that are absent: {absent}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {path} (only safetensors is supported)")
    return files


def iterate_safetensors(path: Path) -> Iterator[tuple[str, CheckpointSlice]]:
    """(name, lazy slice) pairs of every tensor of the safetensors files under `path`,
    with a progress bar over the shards. Nothing is read until a weight loader reads
    its rank's part of a slice (on the host), which it must do before the next pair:
    the file closes after its last tensor."""
    from safetensors import safe_open

    files = list_safetensors_files(path)
    for file in tqdm(files, desc="Loading safetensors checkpoint shards", unit="shard"):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, CheckpointSlice.of(f.get_slice(name))


@torch.no_grad()
def initialize_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights for benchmarks: normal(0, std) matrices, norm weights 1, biases 0.
    Deterministic for a seed, and the same model whatever the tensor parallel size: a
    rank draws each matrix it holds part of whole, as a single process would, and keeps
    its part (one matrix at a time), so its shards are slices of the unsharded weights."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            # Drawn where the parameter lives: no host copy of a billion values.
            if param.device not in generators:
                generators[param.device] = torch.Generator(param.device).manual_seed(seed)
            generator = generators[param.device]
            module = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            if getattr(module, "tp_size", 1) == 1:
                param.normal_(0.0, std, generator=generator)
            else:
                _draw_whole_keep_shard(module, param, generator, std)


def _draw_whole_keep_shard(
    module: nn.Module, param: nn.Parameter, generator: torch.Generator, std: float
) -> None:
    """Draw the unsharded matrix of a tensor-parallel layer's `param` and load this
    rank's part of it through the layer's weight_loader."""
    if isinstance(module, MergedColumnParallelLinear):
        sizes = module.full_output_sizes
        shape = (sum(sizes), *param.shape[1:])
    else:
        shape = module.full_weight_shape
    full = torch.empty(shape, dtype=param.dtype, device=param.device)
    full.normal_(0.0, std, generator=generator)
    if isinstance(module, MergedColumnParallelLinear):
        for shard_id, piece in enumerate(full.split(sizes)):
            module.weight_loader(param, piece, shard_id)
    else:
        module.weight_loader(param, full)
