"""Platforms: what each declares, and how the platform and its attention backend's support
level drive mode resolution on a real engine (stories260K)."""

from __future__ import annotations

import gc
import importlib.util
import itertools
import logging
import os
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from decodegraph.attention import selector
from decodegraph.attention.backends.base import AttentionBackend, AttentionCGSupport
from decodegraph.attention.backends.torch_paged import (
    CPUAttentionBackend,
    CUDATorchAttentionBackend,
)
from decodegraph.config import CompilationConfig, DeviceConfig, ModelConfig
from decodegraph.entrypoints.llm import LLM
from decodegraph.graphs.modes import CUDAGraphMode
from decodegraph.models.loader import get_model, load_hf_config
from decodegraph.platforms import cpu as cpu_platform
from decodegraph.platforms import get_platform, platform_names
from decodegraph.platforms.base import FairRLock, Platform
from decodegraph.platforms.cpu import CpuPlatform
from decodegraph.platforms.cuda import CudaPlatform, unowned
from tests.utils.platforms import NoGraphCpuPlatform, registered_backend, registered_platform
from tests.utils.requests import greedy

MODES_LOGGER = "decodegraph.graphs.modes"
GREEDY = greedy(10)
PROMPTS = [[1, 40, 41, 42], [1, 90], [1, 7, 8]]


def test_get_platform_cpu() -> None:
    platform = get_platform("cpu")
    assert isinstance(platform, CpuPlatform)
    assert platform.device() == torch.device("cpu")
    assert platform.dist_backend == "gloo"
    assert platform.supports_graphs
    assert platform.graph_pool() is None
    assert selector.get_attn_backend(platform) is CPUAttentionBackend
    platform.synchronize()  # a no-op that must not fail


def test_get_platform_cuda_needs_no_device_to_describe_itself() -> None:
    platform = get_platform("cuda")
    assert isinstance(platform, CudaPlatform)
    assert platform.device_type == "cuda"
    assert platform.dist_backend == "nccl"
    assert platform.supports_graphs
    expected = "TRITON_ATTN" if importlib.util.find_spec("triton") else "CUDA_TORCH"
    assert platform.default_attention_backend == expected


@pytest.mark.parametrize(
    "mode, enforce_eager, refused",
    [("FULL_DECODE_ONLY", False, True), ("PIECEWISE", False, True), ("NONE", False, False)]
    + [("FULL_DECODE_ONLY", True, False)],
)
def test_cuda_refuses_graphs_without_a_warm_up(
    mode: str, enforce_eager: bool, refused: bool
) -> None:
    """A Triton kernel compiles on its first run, which must never be inside a capture."""
    config = SimpleNamespace(
        enforce_eager=enforce_eager,
        compilation_config=CompilationConfig(cudagraph_mode=mode, cudagraph_num_of_warmups=0),
    )
    check = get_platform("cuda").check_and_update_config
    if refused:
        with pytest.raises(ValueError, match=r"compilation_config.cudagraph_num_of_warmups: .*1"):
            check(config)  # type: ignore[arg-type]
    else:
        check(config)  # type: ignore[arg-type]
    config.compilation_config.cudagraph_num_of_warmups = 1
    check(config)  # type: ignore[arg-type]


def test_an_unowned_view_aliases_without_holding_the_memory() -> None:
    """What a CUDA graph keeps of outputs captured with weak_outputs (checked on CPU
    tensors: the storage's owners do not change)."""
    base = torch.arange(12.0).view(3, 4)[1:]
    owners = torch._C._storage_Use_Count(base.untyped_storage()._cdata)
    view = unowned(base)
    assert torch._C._storage_Use_Count(base.untyped_storage()._cdata) == owners
    assert (view.data_ptr(), view.shape, view.stride()) == (
        base.data_ptr(),
        base.shape,
        base.stride(),
    )
    base[0, 0] = -1.0
    assert view[0, 0].item() == -1.0


def test_the_attention_backend_can_be_chosen_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(selector.ENV_VAR, "cuda_torch")
    assert selector.get_attn_backend(get_platform("cpu")) is CUDATorchAttentionBackend
    monkeypatch.setenv(selector.ENV_VAR, "FLASH_ATTN")
    with pytest.raises(ValueError, match="DECODEGRAPH_ATTENTION_BACKEND.*CPU_TORCH, CUDA_TORCH"):
        selector.get_attn_backend(get_platform("cuda"))


def test_get_platform_rejects_an_unknown_device_listing_the_known_ones() -> None:
    with pytest.raises(ValueError, match="cpu, cuda"):
        get_platform("npu")
    with pytest.raises(ValueError, match="device: 'npu' is not one of auto, cpu, cuda"):
        DeviceConfig(device="npu")


def test_a_registered_platform_is_a_device_choice_until_unregistered() -> None:
    with registered_platform(NoGraphCpuPlatform) as name:
        assert name in platform_names()
        assert DeviceConfig(device=name).device == name
        assert isinstance(get_platform(name), NoGraphCpuPlatform)
    assert name not in platform_names()


@pytest.mark.parametrize("platform_cls", [CpuPlatform, CudaPlatform], ids=["cpu", "cuda"])
def test_default_capture_sizes_are_sorted_unique_and_start_at_one(
    platform_cls: type[Platform],
) -> None:
    sizes = platform_cls.default_capture_sizes
    assert sizes[0] == 1
    assert sizes == sorted(set(sizes))
    assert all(isinstance(s, int) and s > 0 for s in sizes)


def test_the_base_platform_has_no_graphs_and_names_no_backend() -> None:
    platform = Platform()
    assert not platform.supports_graphs
    assert platform.graph_pool() is None
    assert platform.memory_allocated() == 0
    with pytest.raises(NotImplementedError, match="cannot capture graphs"):
        platform.make_graph("g", lambda x: x, [torch.ones(1)], None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="names no attention backend"):
        selector.get_attn_backend(platform)


def test_cpu_kv_cache_budget_is_positive_and_bounded() -> None:
    budget = CpuPlatform().available_kv_cache_memory(0.9, 0)
    assert 0 < budget <= 4 << 30


def test_the_fair_lock_goes_to_a_waiting_thread_before_its_holder_takes_it_again() -> None:
    """The engine's steps take module_call_lock back to back; a trace in the background
    that waits for it goes first."""
    lock, order = FairRLock(), []

    def wait_for_it() -> None:
        with lock:
            order.append("waiting thread")

    lock.acquire()
    waiter = threading.Thread(target=wait_for_it)
    waiter.start()
    deadline = time.monotonic() + 30
    while lock.num_waiting() == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert lock.num_waiting() == 1
    lock.release()
    with lock:  # at once, as the next step does
        order.append("holder")
    waiter.join()
    assert order == ["waiting thread", "holder"]


def test_the_fair_lock_is_reentrant_and_refuses_a_release_by_another_thread() -> None:
    lock = FairRLock()
    with lock, lock:
        errors = []

        def release() -> None:
            try:
                lock.release()
            except RuntimeError as e:
                errors.append(str(e))

        other = threading.Thread(target=release)
        other.start()
        other.join()
    assert errors == ["FairRLock released by a thread that does not hold it"]
    with pytest.raises(RuntimeError, match="does not hold it"):
        lock.release()
    assert lock.acquire() and lock.num_waiting() == 0
    lock.release()


# ---------------------------------------------------------------- resolution on an engine


def _backend_declaring(level: AttentionCGSupport) -> type[AttentionBackend]:
    attrs = {"cudagraph_support": level, "name": f"CPU_{level.name}"}
    return type(f"CPUAttention{level.name}", (CPUAttentionBackend,), attrs)


def _platform_with_support(level: AttentionCGSupport) -> type[Platform]:
    backend = _backend_declaring(level)
    attrs = {"default_attention_backend": backend.name, "test_backend": backend}
    return type(f"LimitedCpuPlatform{level.name}", (CpuPlatform,), attrs)


def _start(stories_dir: Path, platform_cls: type[Platform], mode: str) -> LLM:
    backend = getattr(platform_cls, "test_backend", None)
    with ExitStack() as stack:
        if backend is not None:
            stack.enter_context(registered_backend(backend))
        device = stack.enter_context(
            registered_platform(platform_cls, f"test-{platform_cls.__name__}")
        )
        return LLM(
            str(stories_dir),
            device=device,
            compilation_config={
                "cudagraph_mode": mode,
                "cudagraph_capture_sizes": [1, 4],
                "use_inductor": False,
            },
            max_model_len=64,
            max_num_seqs=4,
        )


def _greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def eager_ids(stories_dir: Path) -> list[list[int]]:
    return _greedy(LLM(str(stories_dir), enforce_eager=True, max_model_len=64, max_num_seqs=4))


def _mode_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == MODES_LOGGER and r.levelno >= logging.WARNING
    ]


@pytest.mark.parametrize("mode", ["FULL_DECODE_ONLY", "PIECEWISE"])
def test_a_platform_without_graphs_runs_every_mode_eager_and_says_so_once(
    stories_dir: Path,
    caplog: pytest.LogCaptureFixture,
    eager_ids: list[list[int]],
    mode: str,
) -> None:
    caplog.set_level(logging.WARNING, logger=MODES_LOGGER)
    llm = _start(stories_dir, NoGraphCpuPlatform, mode)
    runner = llm.llm_engine.runner
    assert runner.graph_runner.mode is CUDAGraphMode.NONE
    assert runner.graph_runner.stats.num_graphs == 0
    warnings = _mode_warnings(caplog)
    assert len(warnings) == 1 and "platform" in warnings[0]
    assert _greedy(llm) == eager_ids
    assert {mode for _, mode in runner.graph_runner.mode_counts} == {"NONE"}


@pytest.mark.parametrize(
    "level, mode, resolved, graphs",
    [
        # 2 sizes; stories260K has 5 layers, so 6 pieces per size.
        (AttentionCGSupport.UNIFORM_BATCH, "FULL", "FULL_AND_PIECEWISE", 2 * (1 + 6)),
        (AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE, "FULL", "FULL_AND_PIECEWISE", 14),
        (AttentionCGSupport.NEVER, "FULL_DECODE_ONLY", "PIECEWISE", 2 * 6),
        (AttentionCGSupport.NEVER, "FULL", "PIECEWISE", 12),
    ],
    ids=["uniform-batch", "single-token", "never-fdo", "never-full"],
)
def test_the_backend_support_level_downgrades_the_mode_once_on_an_engine(
    stories_dir: Path,
    caplog: pytest.LogCaptureFixture,
    eager_ids: list[list[int]],
    level: AttentionCGSupport,
    mode: str,
    resolved: str,
    graphs: int,
) -> None:
    caplog.set_level(logging.WARNING, logger=MODES_LOGGER)
    llm = _start(stories_dir, _platform_with_support(level), mode)
    runner = llm.llm_engine.runner
    assert runner.graph_runner.mode.name == resolved
    assert runner.graph_runner.stats.num_graphs == graphs
    warnings = _mode_warnings(caplog)
    assert len(warnings) == 1
    assert mode in warnings[0] and resolved in warnings[0]
    assert _greedy(llm) == eager_ids


def test_enforce_eager_means_mode_none_without_a_downgrade_warning(
    stories_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=MODES_LOGGER)
    llm = LLM(
        str(stories_dir),
        enforce_eager=True,
        compilation_config={"cudagraph_mode": "FULL"},
        max_model_len=64,
    )
    assert llm.llm_engine.runner.graph_runner.mode is CUDAGraphMode.NONE
    assert llm.llm_engine.runner.graph_runner.stats.num_graphs == 0
    assert _mode_warnings(caplog) == []


class PeakReportingCpuPlatform(CpuPlatform):
    """A CPU platform that reports an activation peak for the profiling run, as a device
    platform does (8 MiB: about what a 2048-token profile run of a small model peaks at)."""

    def peak_memory_allocated(self) -> int:
        return 8 << 20


def test_the_graph_pool_reserve_does_not_starve_a_small_model(
    stories_dir: Path,
) -> None:
    llm = _start(stories_dir, PeakReportingCpuPlatform, "FULL_DECODE_ONLY")
    runner = llm.llm_engine.runner
    assert (
        runner.num_blocks_per_group[0] - 1
        >= runner.max_num_reqs * runner.attn_backend.max_blocks_per_seq
    )


def _smaps_entry(address: int) -> dict[str, str]:
    """/proc/self/smaps' fields of the mapping holding `address`, with its range as
    "start" and "end" (hex)."""
    entry: dict[str, str] = {}
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head, _, rest = line.partition(" ")
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            if entry:
                return entry
            start, end = head.split("-")
            if int(start, 16) <= address < int(end, 16):
                entry = {"start": start, "end": end}
        elif entry:
            entry[head.rstrip(":")] = rest.strip()
    return entry


def _thp_eligible(address: int) -> bool:
    """Whether the kernel may back the mapping holding `address` with huge pages."""
    return _smaps_entry(address).get("THPeligible") == "1"


def _huge_page_advised(address: int) -> bool:
    """Whether the mapping holding `address` has MADV_HUGEPAGE's flag ("hg")."""
    return "hg" in _smaps_entry(address).get("VmFlags", "").split()


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("2097152\n", 2 << 20),  # x86-64, 4 KiB-page ARM kernels
        ("536870912\n", 512 << 20),  # 64 KiB-page ARM kernels
        ("33554432\n", 32 << 20),  # 16 KiB-page ARM kernels
        ("3000\n", 2 << 20),  # not a power of two: not a page size
        ("0\n", 2 << 20),
        ("madvise\n", 2 << 20),
        (None, 2 << 20),  # no transparent huge pages in this kernel
    ],
)
def test_cpu_huge_page_size_is_the_kernels_pmd_size(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: str | None, size: int
) -> None:
    pmd_size = tmp_path / "hpage_pmd_size"
    if text is not None:
        pmd_size.write_text(text)
    monkeypatch.setattr(cpu_platform, "_PMD_SIZE_FILE", pmd_size)
    cpu_platform.huge_page_size.cache_clear()
    try:
        assert cpu_platform.huge_page_size() == size
    finally:
        cpu_platform.huge_page_size.cache_clear()


def test_cpu_huge_page_mappings_follow_the_kernels_huge_page_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A 64 KiB-page ARM kernel's 512 MiB huge pages, stood for by 8 MiB here: bytes that
    # fill one start on its boundary; fewer bytes take no slack, as no huge page fits.
    # Either way the whole mapping is advised.
    monkeypatch.setattr(cpu_platform, "huge_page_size", lambda: 8 << 20)
    big = cpu_platform._huge_page_bytes((8 << 20) + 4096)
    assert big.data_ptr() % (8 << 20) == 0
    small = cpu_platform._huge_page_bytes((1 << 20) + 100)  # a part page at the end
    # Advised to the last page (the kernel may merge the mapping with a neighbour advised
    # alike, so its size is not checked).
    ends = (small.data_ptr(), small.data_ptr() + small.numel() - 1)
    if sys.platform.startswith("linux"):
        assert _huge_page_advised(big.data_ptr())
        assert all(_huge_page_advised(address) for address in ends)
    big.fill_(1)
    small.fill_(2)
    assert big.eq(1).all() and small.eq(2).all()


def test_cpu_kv_caches_are_zeros_and_advised_onto_huge_pages() -> None:
    cache = CpuPlatform().allocate_kv_cache((4096, 4, 8, 16), torch.float32, torch.device("cpu"))
    assert cache.shape == (4096, 4, 8, 16) and cache.dtype == torch.float32
    assert not cache.any()
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("transparent huge pages are off on this machine")
    assert cache.data_ptr() % cpu_platform.huge_page_size() == 0  # its first blocks too
    assert _thp_eligible(cache.data_ptr() + cache.nbytes // 2)
    assert _thp_eligible(cache.data_ptr())


def test_cpu_kv_caches_are_not_written_at_start_up_and_outlive_their_mapping_name() -> None:
    # Kernel-zeroed pages: a 64 MiB cache adds almost nothing to the resident set until
    # written, and the tensor alone keeps its memory mapped.
    platform = CpuPlatform()
    before = platform.memory_allocated()
    cache = platform.allocate_kv_cache((1024, 2, 16, 2, 256), torch.float32, torch.device("cpu"))
    assert platform.memory_allocated() - before < cache.nbytes // 4
    gc.collect()
    cache[-1].fill_(1.5)
    assert cache[-1].eq(1.5).all() and not cache[0].any()
    assert cache.is_contiguous()


class _Weights(torch.nn.Module):
    """Parameters of every kind place_parameters meets: large and small, bf16, tied, and
    one that views a larger tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.big = torch.nn.Parameter(torch.empty(1024, 1536), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.empty(7), requires_grad=False)
        self.bf16 = torch.nn.Parameter(torch.empty(3, 1000, dtype=torch.bfloat16))
        self.head = torch.nn.Linear(16, 8, bias=False)
        self.tied = torch.nn.Linear(16, 8, bias=False)
        self.tied.weight = self.head.weight
        self.backing = torch.zeros(4, 16)
        self.view = torch.nn.Parameter(self.backing[1:3], requires_grad=False)


def test_cpu_parameters_are_packed_into_one_huge_page_mapping_before_loading(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("DECODEGRAPH_CPU_HUGE_PAGE_WEIGHTS", raising=False)
    model = _Weights()
    before = {name: (p, p.shape, p.dtype) for name, p in model.named_parameters()}
    view_ptr = model.view.data_ptr()
    CpuPlatform().place_parameters(model)
    # The same Parameter objects, shapes and dtypes; the tie kept; the view left alone.
    for name, p in model.named_parameters():
        assert (p, p.shape, p.dtype) == before[name]
    assert model.tied.weight.data_ptr() == model.head.weight.data_ptr()
    assert model.view.data_ptr() == view_ptr
    moved = sorted((p.data_ptr(), p.nbytes) for n, p in model.named_parameters() if n != "view")
    assert moved[0][0] % cpu_platform.huge_page_size() == 0
    for (start, nbytes), (next_start, _) in itertools.pairwise(moved):
        assert start % 64 == 0 and start + nbytes <= next_start < start + nbytes + 64
    # Writable, and each parameter's own memory.
    for i, p in enumerate(model.parameters()):
        p.data.fill_(i + 1)
    for i, p in enumerate(model.parameters()):
        assert p.eq(i + 1).all()
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("transparent huge pages are off on this machine")
    assert _thp_eligible(model.big.data_ptr())


def test_cpu_parameters_stay_put_when_switched_off_and_a_bad_switch_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = _Weights()
    ptrs = [p.data_ptr() for p in model.parameters()]
    monkeypatch.setenv("DECODEGRAPH_CPU_HUGE_PAGE_WEIGHTS", "0")
    CpuPlatform().place_parameters(model)
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    monkeypatch.setenv("DECODEGRAPH_CPU_HUGE_PAGE_WEIGHTS", "yes")
    with pytest.raises(ValueError, match="DECODEGRAPH_CPU_HUGE_PAGE_WEIGHTS"):
        CpuPlatform().place_parameters(model)


def test_get_model_loads_into_the_placed_parameters(stories_dir: Path) -> None:
    # The engine's path (the platform places, then loading writes) gives the same
    # weights as loading where the parameters were allocated.
    mc = ModelConfig(model=str(stories_dir))
    hf_config = load_hf_config(mc)
    placed = get_model(mc, hf_config, torch.float32, "cpu", platform=CpuPlatform())
    plain = get_model(mc, hf_config, torch.float32, "cpu")
    weights = dict(plain.named_parameters())
    starts = []
    for name, p in placed.named_parameters():
        assert torch.equal(p, weights[name]), name
        starts.append(p.data_ptr())
    # One mapping of the platform's, advised onto huge pages.
    assert len({_smaps_entry(start)["start"] for start in starts}) == 1
    if sys.platform.startswith("linux"):
        assert _huge_page_advised(min(starts))
    hidden = torch.randn(1, hf_config.hidden_size)
    assert torch.equal(placed.compute_logits(hidden), plain.compute_logits(hidden))


_PICKED_ISA = """
import json, sys
import torch._inductor.config as config
from torch._inductor.cpu_vec_isa import pick_vec_isa
config.cpp.vec_isa_ok = json.loads(sys.argv[1])
isa = pick_vec_isa()
print(str(isa), "|", isa.build_arch_flags())
"""


def test_cpu_graphs_skip_inductors_isa_probe_only_where_it_picks_the_same_isa(
    tmp_path: Path,
) -> None:
    """Where our operators' build stands for Inductor's vector-ISA probe, the platform
    turns the probe off; Inductor must then pick the ISA, and the compiler flags, that the
    probe would have picked (the extensions it still tests, AMX among them, included)."""
    from decodegraph import native

    options = CpuPlatform().inductor_options(CompilationConfig())
    if native.cpu_isa() not in ("avx512", "avx2", "neon"):
        assert "cpp.vec_isa_ok" not in options
        pytest.skip(f"our operators are built for {native.cpu_isa()}: the probe stays on")
    if "cpp.vec_isa_ok" not in options:
        pytest.skip("this CPU has SVE, which the probe still checks")
    assert options["cpp.vec_isa_ok"] is True
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    picked = [
        subprocess.run(
            [sys.executable, "-c", _PICKED_ISA, arg], env=env, capture_output=True, text=True
        ).stdout.strip()
        for arg in ("null", "true")
    ]
    assert picked[0] and picked[0] == picked[1]


def test_the_isa_probe_stays_for_a_narrowed_build_and_at_the_users_word(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from decodegraph import native

    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: True)
    monkeypatch.setattr(native, "cpu_isa", lambda: "avx2")  # DECODEGRAPH_CPU_ISA=avx2
    assert "cpp.vec_isa_ok" not in CpuPlatform().inductor_options(CompilationConfig())
    monkeypatch.setattr(native, "cpu_isa", lambda: "scalar")
    assert "cpp.vec_isa_ok" not in CpuPlatform().inductor_options(CompilationConfig())
    monkeypatch.setattr(native, "cpu_isa", lambda: "avx512")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert CpuPlatform().inductor_options(CompilationConfig())["cpp.vec_isa_ok"] is True
    user = CompilationConfig(inductor_compile_config={"cpp.vec_isa_ok": None})
    assert CpuPlatform().inductor_options(user)["cpp.vec_isa_ok"] is None
    # AMX keeps Inductor's own test of it, which vec_isa_ok does not skip.
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert CpuPlatform().inductor_options(CompilationConfig())["cpp.vec_isa_ok"] is True


def test_a_neon_build_keeps_the_probe_on_sve_and_where_torch_cannot_say(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On ARM the probe is redundant only without SVE (which Inductor checks apart), told
    by torch.cpu.get_capabilities; a torch without it (2.10 has none) keeps the probe
    rather than failing the engine's start."""
    from decodegraph import native

    monkeypatch.setattr(native, "cpu_isa", lambda: "neon")
    for caps, skipped in (({"neon": True}, True), ({"neon": True, "sve": True}, False)):
        monkeypatch.setattr(torch.cpu, "get_capabilities", lambda c=caps: c, raising=False)
        options = CpuPlatform().inductor_options(CompilationConfig())
        assert ("cpp.vec_isa_ok" in options) == skipped
    monkeypatch.delattr(torch.cpu, "get_capabilities", raising=False)
    assert "cpp.vec_isa_ok" not in CpuPlatform().inductor_options(CompilationConfig())


def test_cpu_graphs_build_the_wrapper_at_o1_and_the_kernels_at_o3_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The C++ wrapper of a CPU graph (ATen calls unrolled over the layers) is compiled
    apart from its kernels and less optimised; the kernels keep -O3."""
    import torch._inductor.cpp_builder as cpp_builder
    from torch._inductor.utils import fresh_cache

    commands: list[str] = []
    run = cpp_builder.run_compile_cmd

    def recorded(cmd_line: str, cwd: str) -> None:
        commands.append(cmd_line)
        run(cmd_line, cwd)

    monkeypatch.setattr(cpp_builder, "run_compile_cmd", recorded)
    platform, x = CpuPlatform(), torch.randn(4, 8)
    with fresh_cache():
        graph = platform.make_graph("g", lambda x: (torch.relu(x) + 1,), [x], CompilationConfig())
        torch.testing.assert_close(graph.replay()[0], torch.relu(x) + 1)
    wrapper = [c for c in commands if ".main.cpp" in c]
    kernels = [c for c in commands if ".optimized.cpp" in c]
    assert len(wrapper) == 1 and " -O1 " in wrapper[0] and " -O3 " not in wrapper[0]
    assert len(kernels) == 1 and " -O3 " in kernels[0]
