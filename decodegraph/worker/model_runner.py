"""The model runner: persistent buffers in, dispatch, graph replay or eager, sampling.

Start-up (DESIGN §3): load weights, profile memory with an eager dummy run, size and
allocate the KV cache, resolve the graph mode, capture graphs, close capture.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PretrainedConfig

from decodegraph.attention.backends.base import EAGER_SLOT, AttentionBackend, AttentionMetadata
from decodegraph.attention.forward_context import ForwardContext, set_forward_context
from decodegraph.config import EngineConfig
from decodegraph.core.sched_output import ModelRunnerOutput, SchedulerOutput
from decodegraph.graphs.dispatcher import BatchDescriptor, CudagraphDispatcher
from decodegraph.graphs.manager import CaptureClosedError, CaptureStats, GraphManager
from decodegraph.graphs.modes import CUDAGraphMode, RuntimeMode, resolve_cudagraph_mode
from decodegraph.models.llama import get_head_dim
from decodegraph.models.loader import get_model
from decodegraph.platforms.base import Platform
from decodegraph.sample.metadata import SamplingMetadata
from decodegraph.sample.sampler import Sampler, SamplerOutput
from decodegraph.worker.input_buffers import InputBuffers

logger = logging.getLogger(__name__)


@dataclass
class _Step:
    """One step's prepared batch (host side)."""

    mode: RuntimeMode
    key: BatchDescriptor
    num_tokens: int
    num_reqs: int
    metadata: AttentionMetadata
    sample_rows: list[int]  # indices into scheduled_requests that sample this step


class ModelRunner:
    """Runs the model for one `SchedulerOutput` at a time."""

    def __init__(
        self, config: EngineConfig, platform: Platform, hf_config: PretrainedConfig
    ) -> None:
        mc, cc, sc = config.model_config, config.cache_config, config.scheduler_config
        self.config = config
        self.platform = platform
        self.hf_config = hf_config
        self.device = platform.device()
        self.dtype: torch.dtype = mc.dtype  # resolved by the engine
        self.max_model_len: int = mc.max_model_len
        self.block_size = cc.block_size
        self.max_num_reqs = sc.max_num_seqs
        self.max_num_tokens: int = sc.max_num_batched_tokens
        self.num_layers = hf_config.num_hidden_layers
        self.num_heads = hf_config.num_attention_heads
        self.num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or self.num_heads
        self.head_size = get_head_dim(hf_config)
        self.vocab_size = hf_config.vocab_size

        self.attn_backend: AttentionBackend = platform.attention_backend_cls()(
            self.num_heads,
            self.num_kv_heads,
            self.head_size,
            self.head_size**-0.5,
            self.block_size,
            self.max_model_len,
        )
        # Every step's forward runs in this context (graphs refresh their own slots).
        self._eager_context = ForwardContext(self.attn_backend, EAGER_SLOT)
        self.buffers = InputBuffers(
            self.max_num_tokens,
            self.max_num_reqs,
            self.attn_backend.max_blocks_per_seq,
            self.device,
        )
        self.sampler = Sampler()
        self.model: torch.nn.Module | None = None
        self.num_blocks = 0
        self.profile_peak_bytes = 0
        self.mode = CUDAGraphMode.NONE
        self.dispatcher = CudagraphDispatcher(CUDAGraphMode.NONE, [])
        self.graphs: GraphManager | None = None
        self.capture_stats = CaptureStats()
        self._graph_slots: dict[BatchDescriptor, int] = {}
        self._graph_inputs: dict[BatchDescriptor, list[torch.Tensor]] = {}
        # (padded reqs, padded tokens) -> metadata views of the persistent buffers.
        self._views: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        # (step kind, runtime mode) -> steps run; step kind is "decode" or "mixed".
        self.mode_counts: Counter[tuple[str, str]] = Counter()

    # ---------------------------------------------------------------- start-up

    def load_model(self, path: object = None) -> None:
        mc = self.config.model_config
        self.model = get_model(mc, self.hf_config, self.dtype, self.device, path)

    def kv_cache_bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_size * elem

    def workspace_bytes(self, max_num_reqs: int) -> int:
        """Attention gather workspace: max_num_reqs contexts of max_model_len, K and V."""
        per_block = self.kv_cache_bytes_per_block() // self.num_layers
        return max_num_reqs * self.attn_backend.max_blocks_per_seq * per_block

    @torch.inference_mode()
    def profile_run(self) -> None:
        """An eager forward of the largest batch, for peak-memory profiling and warm-up.

        Its attention metadata has no requests, so it writes no KV cache.
        """
        n = self.max_num_tokens
        self.platform.reset_peak_memory()
        before = self.platform.memory_allocated()
        md = self._metadata(0, 0, 0, 0, False, [0], [], self.max_num_reqs, n)
        self.attn_backend.set_eager_metadata(md)
        with set_forward_context(self._eager_context):
            hidden = self.model(self.buffers.input_ids.gpu[:n], self.buffers.positions.gpu[:n])
            self.model.compute_logits(hidden[: self.max_num_reqs])
        self.platform.synchronize()
        # Activation peak of the largest batch; graphs keep their own pool of about this.
        self.profile_peak_bytes = max(0, self.platform.peak_memory_allocated() - before)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        shape = self.attn_backend.get_kv_cache_shape(
            num_blocks, self.block_size, self.num_kv_heads, self.head_size
        )
        new = self.platform.allocate_kv_cache
        caches = [
            (new(shape, self.dtype, self.device), new(shape, self.dtype, self.device))
            for _ in range(self.num_layers)
        ]
        self.num_blocks = num_blocks
        self.attn_backend.bind_kv_caches(caches)
        self.attn_backend.allocate_workspace(self.max_num_reqs, self.dtype, self.device)

    def resolve_graph_mode(self) -> CUDAGraphMode:
        cc = self.config.compilation_config
        requested = CUDAGraphMode.NONE if self.config.enforce_eager else cc.cudagraph_mode
        self.mode = resolve_cudagraph_mode(
            requested,
            [self.attn_backend.cudagraph_support],
            self.platform.supports_graphs,
        )
        self.dispatcher = CudagraphDispatcher(self.mode, self.capture_sizes(), self.max_num_reqs)
        return self.mode

    def capture_sizes(self) -> list[int]:
        """Token counts to capture: the listed sizes up to max_num_batched_tokens (mixed
        keys count tokens), or the platform's defaults up to max_num_seqs; decode keys
        are further limited to max_num_seqs by the dispatcher."""
        cc = self.config.compilation_config
        limit = self.max_num_tokens
        if not cc.cudagraph_capture_sizes:
            limit = min(limit, self.max_num_reqs)
        if cc.max_cudagraph_capture_size:
            limit = min(limit, cc.max_cudagraph_capture_size)
        sizes = [
            s
            for s in cc.cudagraph_capture_sizes or self.platform.default_capture_sizes
            if s <= limit
        ]
        # A default bucket list must contain its own maximum (a nano-vllm pitfall).
        if not cc.cudagraph_capture_sizes and cc.max_cudagraph_capture_size and limit not in sizes:
            sizes.append(limit)
        return sorted(set(sizes))

    def capture_graphs(self) -> CaptureStats:
        """Capture every graph the dispatcher can ask for; then close capture."""
        if self.graphs is not None and self.graphs.closed:
            raise CaptureClosedError("graphs are captured once, at start-up")
        kind = self.platform.graph_capture_kind or "cpu"
        self.graphs = GraphManager(
            kind, self.config.compilation_config, self.platform.default_inductor_options
        )
        keys = self.dispatcher.all_keys()
        self.capture_stats = self.graphs.capture_all(
            keys, self._capture_one, self.platform.memory_allocated
        )
        return self.capture_stats

    @torch.inference_mode()
    def _capture_one(self, mode: RuntimeMode, key: BatchDescriptor) -> None:
        n = key.num_tokens
        b = self.buffers
        # Dummy requests of one token at length 1 (every row reads the null block) with
        # workspaces sized for max_model_len at allocation; K/V of the capture run go to
        # the null block. A mixed key's one dummy request leaves its other rows as padding.
        reqs = n if key.uniform else 1
        b.slot_mapping.np[:n] = 0
        b.seq_lens.np[:reqs] = 1
        # Mixed-batch graphs serve any number of requests: their views span the buffers
        # (rows past the requests end at the last real token, as in _prepare).
        views = reqs if key.uniform else self.max_num_reqs
        b.query_start_loc.np[: reqs + 1] = np.arange(reqs + 1)
        b.query_start_loc.np[reqs + 1 : views + 1] = reqs
        b.copy_to_device(n, views)
        b.num_reqs_np[0] = reqs
        qsl = list(range(reqs + 1))
        md = self._metadata(reqs, reqs, 1, 1, key.uniform, qsl, [1] * reqs, views, n)
        if mode is RuntimeMode.FULL:
            slot = self.attn_backend.new_graph_slot(md)
            self._graph_slots[key] = slot
            fn = self._full_graph_fn(key.uniform)
        else:
            slot = EAGER_SLOT
            self.attn_backend.set_eager_metadata(md)
            fn = self._hidden_fn
        inputs = self._graph_input_list(key)
        split = mode is RuntimeMode.PIECEWISE
        with set_forward_context(ForwardContext(self.attn_backend, slot, split)):
            self.graphs.capture(mode, key, fn, inputs)
        b.slot_mapping.np[:n] = -1
        b.seq_lens.np[:reqs] = 0

    def _buffer_views(self, num_tokens: int) -> list[torch.Tensor]:
        """Views of the persistent buffers (the model reads the first two; the rest
        are listed so that their addresses are checked too)."""
        b = self.buffers
        return [
            b.input_ids.gpu[:num_tokens],
            b.positions.gpu[:num_tokens],
            b.slot_mapping.gpu[:num_tokens],
            b.seq_lens.gpu,
            b.block_tables.gpu,
            b.query_start_loc.gpu,
        ]

    def _graph_input_list(self, key: BatchDescriptor) -> list[torch.Tensor]:
        """A graph's inputs: buffer views, and for a full graph every tensor its
        attention reads (see AttentionBackend.graph_tensors)."""
        inputs = self._buffer_views(key.num_tokens)
        slot = self._graph_slots.get(key)
        if slot is not None:
            inputs += self.attn_backend.graph_tensors(slot)
        return inputs

    def _replay_inputs(self, key: BatchDescriptor) -> list[torch.Tensor]:
        """Fresh views of the current buffers on a graph's first replay (which checks
        their addresses against capture), the same list afterwards."""
        inputs = self._graph_inputs.get(key)
        if inputs is None:
            inputs = self._graph_inputs[key] = self._graph_input_list(key)
        return inputs

    def _hidden_fn(self, input_ids: torch.Tensor, positions: torch.Tensor, *_: object):
        return self.model(input_ids, positions)

    def _full_graph_fn(self, uniform: bool):
        if not uniform:
            return self._hidden_fn

        def fn(
            input_ids: torch.Tensor, positions: torch.Tensor, *_: object
        ) -> tuple[torch.Tensor, torch.Tensor]:
            # Greedy ids too: inside the graph the argmax is fused with the LM head (at
            # batch 1 an eager argmax after the replay was ~5 % of a step); the sampler
            # still gets the logits for everything else.
            logits = self.model.compute_logits(self.model(input_ids, positions))
            return logits, logits.argmax(dim=-1)

        return fn

    # ---------------------------------------------------------------- per step

    def _metadata(
        self,
        num_reqs: int,
        num_tokens: int,
        max_query_len: int,
        max_seq_len: int,
        uniform: bool,
        qsl_cpu: list[int] | None,
        seq_lens_cpu: list[int],
        padded_reqs: int,
        padded_tokens: int,
    ) -> AttentionMetadata:
        views = self._views.get((padded_reqs, padded_tokens))
        if views is None:
            b = self.buffers
            views = (
                b.query_start_loc.gpu[: padded_reqs + 1],
                b.seq_lens.gpu[:padded_reqs],
                b.block_tables.gpu[:padded_reqs],
                b.slot_mapping.gpu[:padded_tokens],
                b.seq_lens.cpu[:padded_reqs],
                b.num_reqs_host,
                b.query_start_loc.cpu[: padded_reqs + 1],
            )
            self._views[(padded_reqs, padded_tokens)] = views
        return AttentionMetadata(
            num_reqs,
            num_tokens,
            max_query_len,
            max_seq_len,
            uniform,
            qsl_cpu or [],
            seq_lens_cpu,
            *views,
        )

    def _prepare(self, so: SchedulerOutput) -> _Step:
        """Write this step's inputs into the persistent buffers (host side first)."""
        b, bs = self.buffers, self.block_size
        reqs, counts = so.scheduled_requests, so.num_scheduled_tokens
        num_reqs, num_tokens = len(reqs), so.total_num_scheduled_tokens
        uniform = num_tokens == num_reqs
        mode, key = self.dispatcher.dispatch(BatchDescriptor(num_tokens, num_reqs, uniform))
        padded_tokens = key.num_tokens
        if key.uniform:
            padded_reqs = key.num_reqs
        elif mode is RuntimeMode.FULL:
            # A mixed graph's metadata spans every request row (captured so): rows past
            # this batch must read as empty to kernels that search them on the device.
            padded_reqs = self.max_num_reqs
        else:
            padded_reqs = num_reqs
        if so.preempted_request_ids:
            b.forget(so.preempted_request_ids)
        ids, pos, slots = b.input_ids.np, b.positions.np, b.slot_mapping.np
        seq_lens, qsl, logits_idx = b.seq_lens.np, b.query_start_loc.np, b.logits_indices.np
        seq_lens_cpu: list[int] = []
        sample_rows: list[int] = []
        start = 0
        for i, (req, n) in enumerate(zip(reqs, counts, strict=True)):
            first = req.num_computed_tokens
            end = first + n
            block_ids = so.block_ids[i]
            if n == 1:
                ids[start] = req.all_token_ids[first]
                pos[start] = first
                slots[start] = block_ids[first // bs] * bs + first % bs
            else:
                p = np.arange(first, end)
                ids[start : start + n] = req.all_token_ids[first:end]
                pos[start : start + n] = p
                slots[start : start + n] = np.asarray(block_ids)[p // bs] * bs + p % bs
            seq_lens[i] = end
            seq_lens_cpu.append(end)
            b.write_block_row(i, req.request_id, block_ids)
            start += n
            qsl[i + 1] = start
            logits_idx[i] = start - 1
            if end == req.num_tokens:
                sample_rows.append(i)
        # Padding (DESIGN §5) and stale tails.
        if padded_tokens > num_tokens:
            ids[num_tokens:padded_tokens] = 0
            pos[num_tokens:padded_tokens] = 0
            slots[num_tokens:padded_tokens] = -1
        if padded_reqs > num_reqs:
            seq_lens[num_reqs:padded_reqs] = 0
            qsl[num_reqs + 1 : padded_reqs + 1] = num_tokens
            b.clear_block_rows(num_reqs, padded_reqs)
        b.copy_to_device(padded_tokens, padded_reqs)
        b.num_reqs_np[0] = num_reqs
        md = self._metadata(
            num_reqs,
            num_tokens,
            max(counts),
            max(seq_lens_cpu),
            uniform,
            [0, 1] if num_reqs == 1 and num_tokens == 1 else qsl[: num_reqs + 1].tolist(),
            seq_lens_cpu,
            padded_reqs,
            padded_tokens,
        )
        return _Step(mode, key, num_tokens, num_reqs, md, sample_rows)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        step = self._prepare(so)
        logits, greedy_ids = self._forward(step)
        kind = "decode" if step.num_tokens == step.num_reqs else "mixed"
        self.mode_counts[(kind, step.mode.name)] += 1
        req_ids = [r.request_id for r in so.scheduled_requests]
        sampled: list[int | None] = [None] * step.num_reqs
        logprobs: list | None = None
        if step.sample_rows:
            rows = step.sample_rows
            sampling_reqs = [so.scheduled_requests[i] for i in rows]
            if len(rows) != logits.shape[0]:
                logits = logits[rows]
                if greedy_ids is not None:
                    greedy_ids = greedy_ids[rows]
            meta = SamplingMetadata.from_requests(sampling_reqs, self.vocab_size, self.device)
            if greedy_ids is not None and meta.is_fast_greedy:
                # The graph's argmax: the sampler's greedy rule (first maximum).
                out = SamplerOutput(greedy_ids.tolist(), None)
            else:
                out = self.sampler(logits, meta)
            for i, tok in zip(rows, out.sampled_token_ids, strict=True):
                sampled[i] = tok
            if out.logprobs is not None:
                logprobs = [None] * step.num_reqs
                for i, lp in zip(rows, out.logprobs, strict=True):
                    logprobs[i] = lp
        return ModelRunnerOutput(req_ids, sampled, logprobs)

    def _forward(self, step: _Step) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits for each request's last scheduled token ([num_reqs, vocab]), and their
        greedy ids where a full decode graph computed them (else None)."""
        backend, b = self.attn_backend, self.buffers
        with set_forward_context(self._eager_context):
            if step.mode is RuntimeMode.FULL:
                backend.update_graph_params(self._graph_slots[step.key], step.metadata)
                out = self.graphs.replay(step.mode, step.key, self._replay_inputs(step.key))
                if step.key.uniform:
                    logits, greedy_ids = out
                    n = step.num_reqs
                    if logits.shape[0] == n:
                        return logits, greedy_ids
                    return logits[:n], greedy_ids[:n]
                hidden = out
            elif step.mode is RuntimeMode.PIECEWISE:
                backend.set_eager_metadata(step.metadata)
                hidden = self.graphs.replay(step.mode, step.key, self._replay_inputs(step.key))
            else:
                backend.set_eager_metadata(step.metadata)
                n = step.num_tokens
                hidden = self.model(b.input_ids.gpu[:n], b.positions.gpu[:n])
            if step.key.uniform and step.num_tokens == step.num_reqs:
                return self.model.compute_logits(hidden[: step.num_reqs]), None
            return self.model.compute_logits(hidden[b.logits_indices.gpu[: step.num_reqs]]), None
