"""Graph modes, and how a mode is resolved from the attention backends' support levels.

The attention backend never decides the mode: it declares an `AttentionCGSupport`
level (attention/backends/base.py) and `resolve_cudagraph_mode` turns the user's wish into what this platform and
these backends can do, logging every downgrade once with its reason.
"""

from __future__ import annotations

import enum
import logging

from decodegraph.attention.backends.base import AttentionCGSupport

logger = logging.getLogger(__name__)


class CUDAGraphMode(enum.Enum):
    """User-facing graph mode, spelled as in vLLM.

    The value is a pair: the runtime mode for uniform decode batches, and the
    runtime mode for mixed batches (prefills, chunked prefills, mixtures).
    """

    NONE = ("NONE", "NONE")
    PIECEWISE = ("PIECEWISE", "PIECEWISE")
    FULL = ("FULL", "FULL")
    FULL_DECODE_ONLY = ("FULL", "NONE")
    FULL_AND_PIECEWISE = ("FULL", "PIECEWISE")

    @classmethod
    def parse(cls, value: str | CUDAGraphMode) -> CUDAGraphMode:
        """Parse a case-insensitive mode name; a bad name lists the valid ones."""
        if isinstance(value, CUDAGraphMode):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        valid = ", ".join(cls.__members__)
        raise ValueError(f"compilation_config.cudagraph_mode: {value!r} is not one of {valid}")

    def decode_mode(self) -> RuntimeMode:
        return RuntimeMode[self.value[0]]

    def mixed_mode(self) -> RuntimeMode:
        return RuntimeMode[self.value[1]]

    def has_full_graphs(self) -> bool:
        return RuntimeMode.FULL in (self.decode_mode(), self.mixed_mode())

    def has_piecewise_graphs(self) -> bool:
        return RuntimeMode.PIECEWISE in (self.decode_mode(), self.mixed_mode())


class RuntimeMode(enum.Enum):
    """What actually runs for one step."""

    NONE = "NONE"
    PIECEWISE = "PIECEWISE"
    FULL = "FULL"


def resolve_cudagraph_mode(
    requested: CUDAGraphMode,
    supports: list[AttentionCGSupport],
    platform_supports_graphs: bool,
    piecewise_available: bool = True,
) -> CUDAGraphMode:
    """Turn the requested mode into one this platform and these backends can run,
    logging every downgrade with its reason (`explain_cudagraph_mode`'s mode)."""
    return explain_cudagraph_mode(
        requested, supports, platform_supports_graphs, piecewise_available
    )[0]


def explain_cudagraph_mode(
    requested: CUDAGraphMode,
    supports: list[AttentionCGSupport],
    platform_supports_graphs: bool,
    piecewise_available: bool = True,
) -> tuple[CUDAGraphMode, list[str]]:
    """The mode this platform and these backends can run instead of `requested`, and
    one line per downgrade ("FULL -> FULL_AND_PIECEWISE: ..."), each logged as a
    warning. `supports` holds one level per attention group; the weakest group wins."""
    mode, reasons = _downgrade(requested, supports, platform_supports_graphs, piecewise_available)
    for reason in reasons:
        logger.warning("cudagraph_mode %s", reason)
    return mode, reasons


def _downgrade(
    requested: CUDAGraphMode,
    supports: list[AttentionCGSupport],
    platform_supports_graphs: bool,
    piecewise_available: bool,
) -> tuple[CUDAGraphMode, list[str]]:
    if requested is CUDAGraphMode.NONE:
        return requested, []
    if not platform_supports_graphs:
        return CUDAGraphMode.NONE, [
            f"{requested.name} -> NONE: this platform cannot capture graphs"
        ]
    mode, reasons = requested, []
    if mode.has_piecewise_graphs() and not piecewise_available:
        fallback = CUDAGraphMode.FULL_DECODE_ONLY if mode.has_full_graphs() else CUDAGraphMode.NONE
        reasons.append(
            f"{mode.name} -> {fallback.name}: piecewise graphs are unavailable for this model"
        )
        mode = fallback
    if not mode.has_full_graphs():
        return mode, reasons
    level = min(supports, default=AttentionCGSupport.ALWAYS)
    if level is AttentionCGSupport.NEVER:
        fallback = CUDAGraphMode.PIECEWISE if piecewise_available else CUDAGraphMode.NONE
        reasons.append(
            f"{mode.name} -> {fallback.name}: an attention backend supports no full graphs (NEVER)"
        )
        return fallback, reasons
    if mode is CUDAGraphMode.FULL and level < AttentionCGSupport.ALWAYS:
        fallback = (
            CUDAGraphMode.FULL_AND_PIECEWISE
            if piecewise_available
            else CUDAGraphMode.FULL_DECODE_ONLY
        )
        reasons.append(
            f"FULL -> {fallback.name}: attention support is {level.name}, so mixed batches "
            "cannot run in a full graph"
        )
        return fallback, reasons
    return mode, reasons
