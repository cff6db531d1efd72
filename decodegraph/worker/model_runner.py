"""The model runner: its requests' state, the persistent buffers, eager or graph, sampling.

Start-up (docs/design.md §3): load weights, profile memory with an eager dummy run,
size and allocate the KV cache, resolve the graph mode and capture the graphs (the
graph runner's part), close capture.

A step (`execute_model`): apply the scheduler's deltas to the runner's own request
states, write the batch into the persistent buffers (`InputBatch`), let the graph
runner dispatch it, run it (eager, or a graph replay), sample, and append the sampled
tokens to the states.
"""

from __future__ import annotations

import logging

import torch
from transformers import PretrainedConfig

from decodegraph.attention.backends.base import AttentionBackend, AttentionMetadata
from decodegraph.attention.selector import get_attn_backend
from decodegraph.config import EngineConfig
from decodegraph.core.sched_output import ModelRunnerOutput, SchedulerOutput
from decodegraph.forward_context import (
    EAGER_PARAMS_ID,
    BatchDescriptor,
    ForwardContext,
    set_forward_context,
)
from decodegraph.graphs.graph_runner import CaptureStats, GraphRunner
from decodegraph.graphs.modes import CUDAGraphMode, RuntimeMode
from decodegraph.models.llama import get_head_dim
from decodegraph.models.loader import get_model
from decodegraph.platforms.base import Platform
from decodegraph.sample.metadata import BatchStaticsCache, SamplingMetadata
from decodegraph.sample.sampler import Sampler, SamplerOutput
from decodegraph.worker.input_batch import InputBatch
from decodegraph.worker.input_buffers import InputBuffers
from decodegraph.worker.request_state import CachedRequestState, RequestStates

logger = logging.getLogger(__name__)

# The one attention group every layer belongs to (until models mix attention kinds).
FULL_ATTENTION = "full_attention"


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

        self.attn_backend: AttentionBackend = get_attn_backend(platform)(
            self.num_heads,
            self.num_kv_heads,
            self.head_size,
            self.head_size**-0.5,
            self.block_size,
            self.max_model_len,
        )
        # Eager steps and graph replays run in this context (a graph's attention reads
        # the params id baked into it; eager attention reads EAGER_PARAMS_ID's).
        self._eager_context = ForwardContext(self.attn_backend, EAGER_PARAMS_ID)
        self.buffers = InputBuffers(
            self.max_num_tokens,
            self.max_num_reqs,
            self.attn_backend.max_blocks_per_seq,
            self.block_size,
            self.device,
        )
        self.graph_runner = GraphRunner(
            config, platform, self.buffers, {FULL_ATTENTION: self.attn_backend}
        )
        self.sampler = Sampler()
        self._sampling_statics = BatchStaticsCache()
        # What the runner knows of each request (from the scheduler's data only).
        self.requests = RequestStates(self.device)
        self.model: torch.nn.Module | None = None
        self.num_blocks = 0
        self.profile_peak_bytes = 0

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

        Its batch has no requests, so it attends nothing and writes no KV cache.
        """
        n = self.max_num_tokens
        self.platform.reset_peak_memory()
        before = self.platform.memory_allocated()
        batch = InputBatch.make_dummy(0, n, False, self.buffers)
        self.attn_backend.set_eager_metadata(batch.attention_metadata(self.buffers))
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
        return self.graph_runner.resolve()

    def capture_graphs(self) -> CaptureStats:
        """Capture every graph the dispatcher can ask for; then close capture."""
        return self.graph_runner.capture_all(self.model, self._prepare_dummy)

    def _prepare_dummy(
        self, mode: RuntimeMode, key: BatchDescriptor
    ) -> dict[str, AttentionMetadata]:
        """A capture batch for `key` in the buffers: a uniform key's rows are one-token
        dummy requests; a mixed key's one dummy request leaves its other rows as padding."""
        num_reqs = key.num_tokens if key.uniform else 1
        batch = InputBatch.make_dummy(num_reqs, key.num_tokens, key.uniform, self.buffers, mode)
        return {
            name: batch.attention_metadata(self.buffers) for name in self.graph_runner.attn_groups
        }

    # ---------------------------------------------------------------- per step

    def _prepare_inputs(self, so: SchedulerOutput, states: list[CachedRequestState]) -> InputBatch:
        """Dispatch the batch and write it into the persistent buffers."""
        num_reqs, num_tokens = len(states), so.total_num_scheduled_tokens
        mode, key = self.graph_runner.dispatch(num_tokens, num_reqs, num_tokens == num_reqs)
        return InputBatch.prepare(
            so.req_ids, states, so.num_scheduled_tokens, mode, key, self.buffers
        )

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        states, replaced = self.requests.update(so)
        if so.preempted_req_ids or replaced:
            # Their rows were written for blocks that are gone.
            self.buffers.forget(so.preempted_req_ids | replaced)
        batch = self._prepare_inputs(so, states)
        logits, greedy_ids = self._forward(batch)
        sampled: list[int | None] = [None] * batch.num_reqs
        logprobs: list | None = None
        rows = batch.sample_rows
        if rows:
            sampling_states = [states[i] for i in rows]
            if len(rows) != logits.shape[0]:
                logits = logits[rows]
                if greedy_ids is not None:
                    greedy_ids = greedy_ids[rows]
            meta = SamplingMetadata.from_requests(
                sampling_states, self.vocab_size, self.device, self._sampling_statics
            )
            if greedy_ids is not None and meta.is_fast_greedy:
                # The graph's argmax: the sampler's greedy rule (first maximum).
                out = SamplerOutput(greedy_ids.tolist(), None)
            else:
                out = self.sampler(logits, meta)
            for i, state, tok in zip(rows, sampling_states, out.sampled_token_ids, strict=True):
                sampled[i] = tok
                state.append_output_token(tok)
            if out.logprobs is not None:
                logprobs = [None] * batch.num_reqs
                for i, lp in zip(rows, out.logprobs, strict=True):
                    logprobs[i] = lp
        return ModelRunnerOutput(batch.req_ids, sampled, logprobs)

    def _forward(self, batch: InputBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits for each request's last scheduled token ([num_reqs, vocab]), and their
        greedy ids where a full decode graph computed them (else None)."""
        mode, key, n = batch.runtime_mode, batch.batch_descriptor, batch.num_reqs
        metadata = batch.attention_metadata(self.buffers)
        b = self.buffers
        with set_forward_context(self._eager_context):
            if mode is RuntimeMode.NONE:
                self.attn_backend.set_eager_metadata(metadata)
                t = batch.num_tokens
                hidden = self.model(b.input_ids.gpu[:t], b.positions.gpu[:t])
            else:
                out = self.graph_runner.replay(mode, key, {FULL_ATTENTION: metadata})
                if mode is RuntimeMode.FULL and key.uniform:
                    logits, greedy_ids = out
                    if logits.shape[0] == n:
                        return logits, greedy_ids
                    return logits[:n], greedy_ids[:n]
                hidden = out
            if key.uniform and batch.num_tokens == n:
                return self.model.compute_logits(hidden[:n]), None
            return self.model.compute_logits(hidden[b.logits_indices.gpu[:n]]), None
