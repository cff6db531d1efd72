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

import functools
import logging

import torch
from transformers import PretrainedConfig

from decodegraph.attention.backends.base import AttentionBackend, AttentionMetadata
from decodegraph.attention.selector import get_attn_backend
from decodegraph.config import EngineConfig
from decodegraph.core.kv_cache_spec import KVCacheGroupSpec
from decodegraph.core.sched_output import ModelRunnerOutput, SchedulerOutput
from decodegraph.distributed.parallel_state import (
    get_tensor_model_parallel_world_size,
    get_tp_group,
)
from decodegraph.forward_context import (
    EAGER_PARAMS_ID,
    BatchDescriptor,
    ForwardContext,
    set_forward_context,
)
from decodegraph.graphs.dispatcher import StepPlan
from decodegraph.graphs.graph_runner import CaptureStats, GraphRunner
from decodegraph.graphs.modes import CUDAGraphMode, RuntimeMode
from decodegraph.models.llama import get_head_dim, get_num_heads_per_rank
from decodegraph.models.loader import get_model
from decodegraph.platforms.base import Platform, graph_build_lock, module_call_lock
from decodegraph.structured_output.manager import StructuredOutputManager
from decodegraph.worker import prompt_logprobs
from decodegraph.worker.attention_groups import AttentionGroups, build_attention_groups
from decodegraph.worker.input_batch import InputBatch
from decodegraph.worker.input_buffers import InputBuffers
from decodegraph.worker.request_state import CachedRequestState, RequestStates
from decodegraph.worker.step_sampler import StepSampler

logger = logging.getLogger(__name__)


def _in_inference_mode(fn):  # noqa: ANN001, ANN202 - a decorator of one method
    """`@torch.inference_mode()` for the per-step method: the same guard, without the
    decorator's context object built, entered and left in Python at every call."""

    @functools.wraps(fn)
    def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        with torch._C._InferenceMode(True):
            return fn(*args, **kwargs)

    return run


class ModelRunner:
    """Runs the model for one `SchedulerOutput` at a time."""

    def __init__(
        self,
        config: EngineConfig,
        platform: Platform,
        hf_config: PretrainedConfig,
        structured_output: StructuredOutputManager | None = None,
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
        # This rank's heads: what its KV cache holds (all of them at tensor parallel 1).
        self.num_heads, self.num_kv_heads = get_num_heads_per_rank(
            hf_config, get_tensor_model_parallel_world_size()
        )
        self.head_size = get_head_dim(hf_config)
        self.vocab_size = hf_config.vocab_size

        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        # Made by load_model, which learns the model's attention groups: the backends,
        # the persistent buffers (a block table per KV cache group) and the graph runner.
        self.groups: AttentionGroups | None = None
        self.attn_backend: AttentionBackend | None = None
        self.buffers: InputBuffers | None = None
        self.graph_runner: GraphRunner | None = None
        # This rank's tensor-parallel group: rank 0 samples for all (world size 1: alone).
        self.tp_group = get_tp_group()
        # Samples each step's rows (with the grammar masks of structured-output requests).
        self.step_sampler = StepSampler(
            self.vocab_size, self.device, self.tp_group, structured_output
        )
        # What the runner knows of each request (from the scheduler's data only).
        self.requests = RequestStates(self.device, structured_output)
        self.model: torch.nn.Module | None = None
        # Blocks of each KV cache group (the null block included), set by initialize_kv_cache.
        self.num_blocks_per_group: list[int] = []
        self.profile_peak_bytes = 0
        # The last step's batch where it was a decode batch whose every row sampled, with
        # the tokens it sampled (batch order): what the next step may go on from in place
        # (InputBatch.next_decode).
        self._last_decode: tuple[InputBatch, list[int]] | None = None

    # ---------------------------------------------------------------- start-up

    def set_structured_output(self, manager: StructuredOutputManager | None) -> None:
        """The manager that gives grammar requests their matchers and masks."""
        self.requests.structured_output = manager
        self.step_sampler.structured_output = manager

    def load_model(self, path: object = None) -> None:
        """Load the weights, then set up what follows from the model's attention groups."""
        mc = self.config.model_config
        self.model = get_model(mc, self.hf_config, self.dtype, self.device, path, self.platform)
        groups = self.groups = build_attention_groups(
            self.model, get_attn_backend(self.platform), self.block_size, self.max_model_len
        )
        self.attn_backend = groups.first
        self._group_names = list(groups.backends)
        # Eager steps and graph replays run in this context (a graph's attention reads
        # the params id baked into it; eager attention reads EAGER_PARAMS_ID's).
        self._eager_context = ForwardContext(
            groups.first,
            EAGER_PARAMS_ID,
            layer_backends=groups.layer_backends if len(groups.backends) > 1 else None,
        )
        self.buffers = InputBuffers(
            self.max_num_tokens,
            self.max_num_reqs,
            self.max_blocks_per_seq,
            self.block_size,
            self.device,
            num_kv_groups=len(groups.kv_cache_groups),
        )
        self.graph_runner = GraphRunner(
            self.config,
            self.platform,
            self.buffers,
            groups.backends,
            self._eager_context,
            self.tp_group.rank,
            self.tp_group.world_size,
        )

    @property
    def kv_cache_groups(self) -> list[KVCacheGroupSpec]:
        """The model's KV cache groups (after load_model)."""
        return self.groups.kv_cache_groups

    def kv_cache_bytes_per_block(self, group: int | None = None) -> int:
        """Bytes of one block of KV cache group `group` (its layers' K and V, this
        rank's KV heads); of every layer when `group` is None."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        layers = (
            self.num_layers if group is None else len(self.kv_cache_groups[group].layer_indices)
        )
        return 2 * layers * self.block_size * self.num_kv_heads * self.head_size * elem

    def workspace_bytes(self) -> int:
        """Device bytes every attention group's workspace takes (each backend says what
        it allocates): the KV cache budget leaves them out."""
        return sum(
            backend.workspace_bytes(self.max_num_reqs, self.dtype)
            for backend in self.groups.backends.values()
        )

    @torch.inference_mode()
    def profile_run(self) -> None:
        """An eager forward of the largest batch, for peak-memory profiling and warm-up
        (of fewer tokens on a platform that measures no peak: Platform.profile_num_tokens).

        Its batch has no requests, so it attends nothing and writes no KV cache.
        """
        with module_call_lock:  # no trace elsewhere in the process meanwhile
            n = self.platform.profile_num_tokens(self.max_num_tokens)
            self.platform.reset_peak_memory()
            before = self.platform.memory_allocated()
            self._set_eager_metadata(InputBatch.make_dummy(0, n, False, self.buffers))
            with set_forward_context(self._eager_context):
                hidden = self.model(self.buffers.input_ids.gpu[:n], self.buffers.positions.gpu[:n])
                self.model.compute_logits(hidden[: self.max_num_reqs])
            self.platform.synchronize()
            # Activation peak of the largest batch; graphs keep their own pool of about this.
            self.profile_peak_bytes = max(0, self.platform.peak_memory_allocated() - before)

    def initialize_kv_cache(self, num_blocks: int | list[int]) -> None:
        """K and V caches of `num_blocks` blocks for every layer of each KV cache group
        (one count per group, or one for all)."""
        groups = self.kv_cache_groups
        counts = [num_blocks] * len(groups) if isinstance(num_blocks, int) else num_blocks
        new = self.platform.allocate_kv_cache
        for group, count, backend in zip(
            groups, counts, self.groups.backends.values(), strict=True
        ):
            shape = backend.get_kv_cache_shape(
                count, self.block_size, self.num_kv_heads, self.head_size
            )
            caches = [
                (new(shape, self.dtype, self.device), new(shape, self.dtype, self.device))
                for _ in group.layer_indices
            ]
            backend.bind_kv_caches(caches, group.layer_indices)
            backend.allocate_workspace(self.max_num_reqs, self.dtype, self.device)
        self.num_blocks_per_group = list(counts)

    def resolve_graph_mode(self) -> CUDAGraphMode:
        return self.graph_runner.resolve()

    def capture_graphs(self) -> CaptureStats:
        """Capture every graph the dispatcher can ask for; then close capture (no other
        trace, compile or step in the process meanwhile: platforms/base.py)."""
        with graph_build_lock, module_call_lock:
            return self.graph_runner.capture_all(self.model, self._prepare_dummy)

    def _prepare_dummy(
        self, mode: RuntimeMode, key: BatchDescriptor
    ) -> dict[str, AttentionMetadata]:
        """A capture batch for `key` in the buffers: a uniform key's rows are one-token
        dummy requests; a mixed key's one dummy request leaves its other rows as padding."""
        num_reqs = key.num_tokens if key.uniform else 1
        batch = InputBatch.make_dummy(num_reqs, key.num_tokens, key.uniform, self.buffers, mode)
        return self._attention_metadata(batch)

    def _set_eager_metadata(self, batch: InputBatch) -> None:
        """Every attention group's eager metadata for `batch` (an eager forward's)."""
        for g, backend in enumerate(self.groups.backends.values()):
            backend.set_eager_metadata(batch.attention_metadata(self.buffers, g))

    def _attention_metadata(self, batch: InputBatch) -> dict[str, AttentionMetadata]:
        """Each attention group's metadata for `batch`, by group name."""
        names = self._group_names
        if len(names) == 1:
            return {names[0]: batch.attention_metadata(self.buffers)}
        return {name: batch.attention_metadata(self.buffers, g) for g, name in enumerate(names)}

    # ---------------------------------------------------------------- per step

    def _prepare_inputs(
        self, so: SchedulerOutput, states: list[CachedRequestState], plan: StepPlan | None
    ) -> InputBatch:
        """Dispatch the batch (to the driver's plan, where it sent one) and write it into
        the persistent buffers: as the last step's decode batch one token on, where it is
        that (`_grown_rows`), else afresh."""
        num_reqs, num_tokens = len(states), so.total_num_scheduled_tokens
        mode, key = self.graph_runner.dispatch(num_tokens, num_reqs, num_tokens == num_reqs, plan)
        last, self._last_decode = self._last_decode, None
        if last is not None and so.num_steps == 1 and num_tokens == num_reqs:
            batch, tokens = last
            if batch.continues_in_place(so.req_ids, mode, key, self.buffers):
                grown = self._grown_rows(so, batch)
                if grown is not None:
                    return batch.next_decode(states, tokens, grown, self.buffers)
        return InputBatch.prepare(
            so.req_ids, states, so.num_scheduled_tokens, mode, key, self.buffers
        )

    @staticmethod
    def _grown_rows(so: SchedulerOutput, last: InputBatch) -> list[int] | None:
        """The rows of `last` whose requests the scheduler gave blocks since, or None where
        this step cannot be `last` a token on: a request is new or resumed."""
        cached = so.scheduled_cached_reqs
        if so.scheduled_new_reqs or any(cached.resumed_from_preemption):
            return None
        if not cached.req_ids:
            return []
        row = {req_id: i for i, req_id in enumerate(last.req_ids)}
        grown = [row.get(req_id) for req_id in cached.req_ids]
        return None if None in grown else grown

    @_in_inference_mode
    def execute_model(self, so: SchedulerOutput, plan: StepPlan | None = None) -> ModelRunnerOutput:
        """One batch: its step, then the later steps of a multi-step batch, each feeding
        the tokens the step before sampled. `plan` is the driver's dispatch (runtime mode
        and padded key): every rank runs it, or refuses the step if its own graphs say
        otherwise (no rank ever replays while another runs eager).

        After the batch, each graph made in the background since (the dynamic decode
        graph, a decode size made on demand) is run once and serves from the next step
        (the output says which). Its modules run with no trace anywhere in the process
        (platforms/base.py: module_call_lock: a step waits while a graph is traced in the
        background, not while it compiles)."""
        with module_call_lock:
            output = self._execute_batch(so, plan)
            output.dynamic_decode_rows, output.decode_sizes_made = self._finish_background_graphs()
        return output

    def _execute_batch(self, so: SchedulerOutput, plan: StepPlan | None) -> ModelRunnerOutput:
        if so.num_steps > 1:
            output = self._execute_greedy_multi_step(so, plan)
            if output is not None:
                return output
        output, batch = self._execute_step(so, plan)
        if so.num_steps > 1:
            later = so.continuation()
            for _ in range(so.num_steps - 1):
                step_output, batch = self._execute_step(later, plan, batch)
                output.later_steps.append(step_output)
        return output

    @_in_inference_mode
    def wait_for_background_graph(self) -> tuple[tuple[int, int] | None, list[int]]:
        """Between steps: wait for the graphs being made in the background, where any are,
        and run each once; what `_finish_background_graphs` returns."""
        self.graph_runner.join_background_build()  # holding no lock its trace needs
        with module_call_lock:
            return self._finish_background_graphs()

    def _finish_background_graphs(self) -> tuple[tuple[int, int] | None, list[int]]:
        """Each graph made in the background and ready now, run once (the caller holds
        module_call_lock): the rows the dynamic decode graph serves from now on, where it
        is one of them (else None), and the decode sizes made on demand among them."""
        made = self.graph_runner.finish_background_build(self._prepare_dummy)
        if not made:
            return None, []
        dynamic = self.graph_runner.dynamic_key
        rows = self.graph_runner.dynamic_rows if dynamic in made else None
        return rows, [key.num_tokens for key in made if key != dynamic]

    def _execute_greedy_multi_step(
        self, so: SchedulerOutput, plan: StepPlan | None
    ) -> ModelRunnerOutput | None:
        """A multi-step batch whose sampling is one argmax a step, the full decode graph's
        own (every request greedy with nothing that edits logits; no new or resumed
        request, logprobs, grammars or prompt logprobs), at a size that replays a full
        decode graph, on one rank (under tensor parallelism rank 0 samples and
        broadcasts): one replay of its multi-step graph where there is one for its size
        and number of steps, else the one-step graph replayed once per step, each step's
        argmax written as the next step's token (`InputBatch.advance`), with none of a
        step's sampler, runner output or request-delta work between them. Either way
        the requests' states end as the steps one by one leave them. None where it
        cannot (the caller runs the steps one by one); the inputs are not written then."""
        graphs = self.graph_runner
        n = so.num_reqs
        steps_key = graphs.multi_step_key(n, so.num_steps)
        if steps_key is None and (
            self.tp_group.world_size > 1
            or graphs.dispatcher.dispatch(BatchDescriptor(n, n, True)).mode is not RuntimeMode.FULL
        ):
            return None
        if (
            so.scheduled_new_reqs
            or so.total_num_scheduled_tokens != n
            or self.requests.num_with_grammar
            or self.requests.collecting_prompt_logprobs
        ):
            return None
        # A multi-step batch holds no new or resumed request (the scheduler plans one only
        # while every request decodes): its deltas are new blocks, which sampling never
        # reads, so the requests' states as they are decide it.
        if not self.step_sampler.metadata([self.requests[r] for r in so.req_ids]).is_fast_greedy:
            return None
        states = self.requests.update(so)
        if steps_key is not None:
            rows = self._replay_multi_step_graph(so, states, plan, steps_key)
        else:
            rows = self._replay_steps(so, states, plan)
        output = ModelRunnerOutput(so.req_ids, rows[0])
        output.later_steps = [ModelRunnerOutput(so.req_ids, ids) for ids in rows[1:]]
        return output

    def _replay_multi_step_graph(
        self,
        so: SchedulerOutput,
        states: list[CachedRequestState],
        plan: StepPlan | None,
        steps_key: BatchDescriptor,
    ) -> list[list[int]]:
        """Every step's ids [steps][rows] from one replay of the multi-step graph, then
        appended to the states as the steps one by one would."""
        graphs = self.graph_runner
        n = so.num_reqs
        # A decode size's batch runs FULL (the multi-step graphs exist only then).
        mode = graphs.dispatch(n, n, True, plan).mode
        batch = InputBatch.prepare(
            so.req_ids, states, so.num_scheduled_tokens, mode, steps_key, self.buffers
        )
        with set_forward_context(self._eager_context):
            ids = graphs.replay(mode, steps_key, self._attention_metadata(batch))
        rows = ids[:, :n].tolist()
        for step, sampled in enumerate(rows):
            if step:
                graphs.dispatch(n, n, True, plan)  # counted per step, as steps one by one
            for state, tok in zip(states, sampled, strict=True):
                if step:
                    state.num_computed_tokens += 1
                state.append_output_token(tok)
        return rows

    def _replay_steps(
        self, so: SchedulerOutput, states: list[CachedRequestState], plan: StepPlan | None
    ) -> list[list[int]]:
        """Every step's ids [steps][rows]: the one-step full graph replayed once per step,
        its argmax appended to the states before the next step's inputs are written."""
        n = so.num_reqs
        batch = self._prepare_inputs(so, states, plan)
        rows = []
        for step in range(so.num_steps):
            if step:
                self.graph_runner.dispatch(n, n, True, plan)  # counted, and checked
                batch = batch.advance(states, self.buffers)
            sampled = self._forward(batch)[1].tolist()
            for state, tok in zip(states, sampled, strict=True):
                state.append_output_token(tok)
            rows.append(sampled)
        return rows

    def _execute_step(
        self, so: SchedulerOutput, plan: StepPlan | None, previous: InputBatch | None = None
    ) -> tuple[ModelRunnerOutput, InputBatch]:
        """One step; `previous` is the batch of the step before in a multi-step batch
        (whose inputs then advance by one token instead of being written afresh)."""
        states = self.requests.update(so)
        if previous is None:
            batch = self._prepare_inputs(so, states, plan)
        else:
            # The plan is the first step's; dispatching again checks this rank agrees.
            n = previous.num_reqs
            self.graph_runner.dispatch(n, n, True, plan)
            batch = previous.advance(states, self.buffers)
        logits, greedy_ids, hidden = self._forward(batch)
        prompt_rows = None
        if self.requests.collecting_prompt_logprobs:
            prompt_rows = prompt_logprobs.find_rows(
                states, so.num_scheduled_tokens, batch.query_start_loc_cpu
            )
        if prompt_rows is not None:
            prompt_logprobs.score(self.model, states, prompt_rows, logits, hidden)
        sampled: list[int | None] = [None] * batch.num_reqs
        logprobs: list | None = None
        rows = batch.sample_rows
        if rows:
            sampling_states = [states[i] for i in rows]
            if len(rows) != logits.shape[0]:
                logits = logits[rows]
                if greedy_ids is not None:
                    greedy_ids = greedy_ids[rows]
            out = self.step_sampler(
                sampling_states, logits, greedy_ids, bool(self.requests.num_with_grammar)
            )
            for i, state, tok in zip(rows, sampling_states, out.sampled_token_ids, strict=True):
                sampled[i] = tok
                state.append_output_token(tok)
            if out.logprobs is not None:
                logprobs = [None] * batch.num_reqs
                for i, lp in zip(rows, out.logprobs, strict=True):
                    logprobs[i] = lp
        if batch.positions is not None and previous is None and so.num_steps == 1:
            self._last_decode = (batch, sampled)  # every row sampled
        output = ModelRunnerOutput(batch.req_ids, sampled, logprobs)
        if self.requests.collecting_prompt_logprobs:
            output.prompt_logprobs_dict = prompt_logprobs.take_finished(states, rows)
            self.requests.collecting_prompt_logprobs.difference_update(output.prompt_logprobs_dict)
        return output, batch

    def _forward(
        self, batch: InputBatch
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Logits for each request's last scheduled token ([num_reqs, vocab]), their
        greedy ids where a full decode graph computed them (else None), and the hidden
        states of every token row (None from a uniform full graph, which returns logits)."""
        mode, key, n = batch.runtime_mode, batch.batch_descriptor, batch.num_reqs
        b = self.buffers
        with set_forward_context(self._eager_context):
            if mode is RuntimeMode.NONE:
                self._set_eager_metadata(batch)
                t = batch.num_tokens
                hidden = self.model(b.input_ids.gpu[:t], b.positions.gpu[:t])
            else:
                out = self.graph_runner.replay(mode, key, self._attention_metadata(batch))
                if mode is RuntimeMode.FULL and key.uniform:
                    logits, greedy_ids = out
                    if logits.shape[0] == n:
                        return logits, greedy_ids, None
                    return logits[:n], greedy_ids[:n], None
                hidden = out
            if key.uniform and batch.num_tokens == n:
                return self.model.compute_logits(hidden[:n]), None, hidden
            return self.model.compute_logits(hidden[b.logits_indices.gpu[:n]]), None, hidden
