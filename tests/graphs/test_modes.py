"""Graph modes: parsing, the decode/mixed split, and resolution by support level (docs/design.md §2)."""

from __future__ import annotations

import logging

import pytest

from decodegraph.attention.backends.base import AttentionCGSupport
from decodegraph.config import CompilationConfig
from decodegraph.graphs.modes import CUDAGraphMode, RuntimeMode, resolve_cudagraph_mode

M = CUDAGraphMode
S = AttentionCGSupport
ALL_MODES = list(CUDAGraphMode)
ALL_LEVELS = list(AttentionCGSupport)
MODES_LOGGER = "decodegraph.graphs.modes"


# ---------------------------------------------------------------- parsing


@pytest.mark.parametrize("mode", ALL_MODES, ids=lambda m: m.name)
@pytest.mark.parametrize(
    "spell", [str.upper, str.lower, str.title], ids=["upper", "lower", "title"]
)
def test_parse_is_case_insensitive(mode: CUDAGraphMode, spell) -> None:
    assert CUDAGraphMode.parse(spell(mode.name)) is mode


def test_parse_passes_a_mode_through() -> None:
    assert CUDAGraphMode.parse(CUDAGraphMode.FULL_DECODE_ONLY) is CUDAGraphMode.FULL_DECODE_ONLY


@pytest.mark.parametrize("bad", ["FULL_DECODE", "", "cuda", "full-decode-only", 3, None])
def test_parse_rejects_a_bad_name_and_lists_the_valid_ones(bad: object) -> None:
    with pytest.raises(ValueError, match="cudagraph_mode") as info:
        CUDAGraphMode.parse(bad)  # type: ignore[arg-type]
    for mode in ALL_MODES:
        assert mode.name in str(info.value)


def test_compilation_config_parses_the_mode_case_insensitively() -> None:
    config = CompilationConfig.from_any({"cudagraph_mode": "full_and_piecewise"})
    assert config.cudagraph_mode is CUDAGraphMode.FULL_AND_PIECEWISE
    json_config = CompilationConfig.from_any('{"cudagraph_mode": "Piecewise"}')
    assert json_config.cudagraph_mode is CUDAGraphMode.PIECEWISE


@pytest.mark.parametrize("bad", ["yes", 1, [True], "null"])
def test_compilation_config_names_a_bad_dynamic_decode_graph(bad: object) -> None:
    with pytest.raises(ValueError, match="compilation_config.dynamic_decode_graph"):
        CompilationConfig(dynamic_decode_graph=bad)


@pytest.mark.parametrize("field", ["dynamic_decode_graph", "decode_graphs_on_demand"])
@pytest.mark.parametrize("value", [True, False, None])
def test_compilation_config_takes_the_background_graph_fields_as_a_bool_or_unset(
    field: str, value: bool | None
) -> None:
    assert getattr(CompilationConfig.from_any({field: value}), field) is value
    assert getattr(CompilationConfig(), field) is None  # the default: unset


@pytest.mark.parametrize("bad", ["yes", 1, [True], "null"])
def test_compilation_config_names_a_bad_decode_graphs_on_demand(bad: object) -> None:
    with pytest.raises(ValueError, match="^compilation_config.decode_graphs_on_demand: must"):
        CompilationConfig(decode_graphs_on_demand=bad)


def test_compilation_config_rejects_a_bad_mode_listing_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="FULL_DECODE_ONLY"):
        CompilationConfig(cudagraph_mode="FULLDECODE")


# ---------------------------------------------------------------- decode / mixed split

SPLIT = {
    M.NONE: (RuntimeMode.NONE, RuntimeMode.NONE),
    M.PIECEWISE: (RuntimeMode.PIECEWISE, RuntimeMode.PIECEWISE),
    M.FULL: (RuntimeMode.FULL, RuntimeMode.FULL),
    M.FULL_DECODE_ONLY: (RuntimeMode.FULL, RuntimeMode.NONE),
    M.FULL_AND_PIECEWISE: (RuntimeMode.FULL, RuntimeMode.PIECEWISE),
}


@pytest.mark.parametrize("mode", ALL_MODES, ids=lambda m: m.name)
def test_each_mode_splits_into_decode_and_mixed_runtime_modes(mode: CUDAGraphMode) -> None:
    decode, mixed = SPLIT[mode]
    assert mode.decode_mode() is decode
    assert mode.mixed_mode() is mixed
    assert mode.has_full_graphs() == (RuntimeMode.FULL in (decode, mixed))
    assert mode.has_piecewise_graphs() == (RuntimeMode.PIECEWISE in (decode, mixed))


def test_support_levels_are_ordered_always_strongest() -> None:
    assert S.ALWAYS > S.UNIFORM_BATCH > S.UNIFORM_SINGLE_TOKEN_DECODE > S.NEVER


# ---------------------------------------------------------------- resolution

# requested mode -> resolved mode per support level (piecewise graphs available).
# Columns: ALWAYS, UNIFORM_BATCH, UNIFORM_SINGLE_TOKEN_DECODE, NEVER.
FAP = M.FULL_AND_PIECEWISE
RESOLVED = {
    M.NONE: [M.NONE, M.NONE, M.NONE, M.NONE],
    M.PIECEWISE: [M.PIECEWISE, M.PIECEWISE, M.PIECEWISE, M.PIECEWISE],
    M.FULL: [M.FULL, FAP, FAP, M.PIECEWISE],
    M.FULL_DECODE_ONLY: [M.FULL_DECODE_ONLY] * 3 + [M.PIECEWISE],
    FAP: [FAP, FAP, FAP, M.PIECEWISE],
}
LEVEL_COLUMN = [S.ALWAYS, S.UNIFORM_BATCH, S.UNIFORM_SINGLE_TOKEN_DECODE, S.NEVER]

# The same without piecewise graphs: piecewise parts fall to eager / FULL_DECODE_ONLY.
FDO = M.FULL_DECODE_ONLY
RESOLVED_NO_PIECEWISE = {
    M.NONE: [M.NONE] * 4,
    M.PIECEWISE: [M.NONE] * 4,
    M.FULL: [M.FULL, FDO, FDO, M.NONE],
    FDO: [FDO, FDO, FDO, M.NONE],
    FAP: [FDO, FDO, FDO, M.NONE],
}


def _expected(table: dict, mode: CUDAGraphMode, level: AttentionCGSupport) -> CUDAGraphMode:
    return table[mode][LEVEL_COLUMN.index(level)]


@pytest.mark.parametrize("level", ALL_LEVELS, ids=lambda s: s.name)
@pytest.mark.parametrize("mode", ALL_MODES, ids=lambda m: m.name)
def test_resolution_by_support_level(
    mode: CUDAGraphMode, level: AttentionCGSupport, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=MODES_LOGGER)
    resolved = resolve_cudagraph_mode(mode, [level], platform_supports_graphs=True)
    expected = _expected(RESOLVED, mode, level)
    assert resolved is expected
    warnings = [r for r in caplog.records if r.name == MODES_LOGGER]
    if expected is mode:
        assert warnings == []
    else:
        # Logged once, naming both modes.
        assert len(warnings) == 1
        assert mode.name in warnings[0].getMessage()
        assert expected.name in warnings[0].getMessage()


@pytest.mark.parametrize("level", ALL_LEVELS, ids=lambda s: s.name)
@pytest.mark.parametrize("mode", ALL_MODES, ids=lambda m: m.name)
def test_resolution_without_piecewise_graphs(
    mode: CUDAGraphMode, level: AttentionCGSupport, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=MODES_LOGGER)
    resolved = resolve_cudagraph_mode(mode, [level], True, piecewise_available=False)
    assert resolved is _expected(RESOLVED_NO_PIECEWISE, mode, level)
    if resolved is not mode:
        assert caplog.records, "a downgrade must be logged"
    assert not resolved.has_piecewise_graphs()


@pytest.mark.parametrize("mode", ALL_MODES, ids=lambda m: m.name)
@pytest.mark.parametrize(
    "levels, weakest",
    [
        ([S.ALWAYS, S.UNIFORM_BATCH], S.UNIFORM_BATCH),
        ([S.UNIFORM_BATCH, S.ALWAYS, S.UNIFORM_SINGLE_TOKEN_DECODE], S.UNIFORM_SINGLE_TOKEN_DECODE),
        ([S.ALWAYS, S.NEVER, S.ALWAYS], S.NEVER),
        ([S.ALWAYS, S.ALWAYS], S.ALWAYS),
    ],
    ids=["batch", "single-token", "never", "always"],
)
def test_the_weakest_attention_group_wins(
    mode: CUDAGraphMode, levels: list[AttentionCGSupport], weakest: AttentionCGSupport
) -> None:
    assert resolve_cudagraph_mode(mode, levels, True) is _expected(RESOLVED, mode, weakest)


def test_no_attention_groups_means_full_support() -> None:
    assert resolve_cudagraph_mode(M.FULL, [], True) is M.FULL


@pytest.mark.parametrize("mode", ALL_MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("level", ALL_LEVELS, ids=lambda s: s.name)
def test_a_platform_without_graphs_resolves_every_mode_to_none_loudly(
    mode: CUDAGraphMode, level: AttentionCGSupport, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=MODES_LOGGER)
    assert resolve_cudagraph_mode(mode, [level], platform_supports_graphs=False) is M.NONE
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    if mode is M.NONE:
        assert warnings == []
    else:
        assert len(warnings) == 1
        assert "platform" in warnings[0].getMessage()
        assert mode.name in warnings[0].getMessage()
