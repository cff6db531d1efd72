// decodegraph_cpu: the C kernels of this directory as torch operators.
//
// paged_attention: registered in C++ so that a compiled CPU graph calls it without
// entering Python: at batch 1 the Python-level attention op cost more than the attention
// itself. Host parameters (num_reqs, query_start_loc and the sequence lengths) arrive as
// small CPU tensors that belong to a graph's params; update_graph_params rewrites
// them before a replay. The KV caches are written in place but declared as plain
// inputs: no other operator reads them, and declaring the mutation would make a
// compiler functionalise the op and copy whole caches every step (docs/design.md §6).
// paged_attention_out writes into a given output instead: the eager attention between
// the pieces of a piecewise graph writes into a buffer the piece before allocated.
// A step with enough work splits its requests over torch's intra-op threads
// (at::parallel_for, so torch.set_num_threads and nesting rules apply), into contiguous
// ranges of about equal work, one workspace row each.
//
// rms_norm, fused_add_rms_norm, silu_and_mul: vLLM's names and semantics (out of place
// here). rotary_embedding: the neox rotation with a row's cos and signed sin given
// (vLLM's takes positions and the whole table, in place). argmax_rows: greedy sampling's
// first maximum per row (csrc/argmax.h). Rows are independent: large inputs split their
// rows over the intra-op threads like aten's pointwise ops.
//
// shm_all_reduce, shm_all_gather: the tensor-parallel collectives between the ranks of
// one host, through a shared-memory segment (csrc/shm_all_reduce.h) named by an integer
// handle, so that a compiled graph (Inductor's C++ wrapper included) calls them with
// tensors and ints only. The shm_segment_* operators set a segment up and tear it down
// (eager only).
//
// cpu_allocator_*: the caching allocator for CPU tensors (csrc/cpu_allocator.h), put in
// front of c10's default by the CPU platform: install with a cap in bytes (0: take it
// out again), its statistics, and freeing what it holds.
//
// graph_entry_make: a compiled graph's C++ entry bound to aliases of its inputs
// (csrc/graph_entry.h), as an address; graph_entry_binder: the address of the C function
// that makes a Python callable of it, which owns it (decodegraph_graph_entry_bind).
//
// decodegraph_shim_<op> (at the end): the C shims of the operators a compiled graph
// calls. Inductor's C++ wrapper calls an operator it has a C shim for (its config's
// aot_inductor.custom_ops_to_c_shims) as a C function of tensor handles; any other
// custom operator goes through the dispatcher at every call (aoti_torch_call_dispatcher:
// a new handle per tensor argument, the arguments boxed, the operator looked up by name,
// its kernel unboxed). A batch-1 graph makes one such call per layer (the attention; with
// tensor parallelism the collectives too). A wrapper calls aoti_torch_cpu_<op>, the name
// Inductor gives an operator's CPU shim, declared as native/__init__.py's C_SHIMS (which
// must match these signatures); a small library of its own, loaded RTLD_GLOBAL, defines
// those names and forwards each call here. This library stays RTLD_LOCAL: made global, it
// would take torch's libraries (their BLAS among them) into the global scope with it,
// where libraries loaded later bind to them.
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "activation.h"
#include "argmax.h"
#include "cpu_allocator.h"
#include "graph_entry.h"
#include "linear.h"
#include "paged_attention.h"
#include "rms_norm.h"
#include "rotary_embedding.h"
#include "shm_all_reduce.h"

namespace {

using namespace decodegraph;

// Below this much work (query tokens x context positions x query heads x head size, a
// few tens of microseconds) a step stays on the calling thread: a batch-1 decode step
// would pay more for waking a thread than it could save.
constexpr int64_t kParallelWork = int64_t{1} << 20;

// Request boundaries [0, ..., num_reqs] for up to min(threads, max_parts) contiguous
// ranges of about equal work (a decode's work is its context; a prefill token's is its
// causal prefix, so a prefill of q tokens costs about q times its mean context).
std::vector<int64_t> split_requests(const paged_attention_step& a, int64_t max_parts) {
    const int64_t n = a.num_reqs, per_pos = a.num_heads * a.head_size;
    std::vector<int64_t> cost(n);
    int64_t total = 0;
    for (int64_t r = 0; r < n; r++) {
        const int64_t q = a.query_start_loc[r + 1] - a.query_start_loc[r];
        cost[r] = (q * (2 * a.seq_lens[r] - q + 1) / 2 + 16) * per_pos;  // +16: fixed costs
        total += cost[r];
    }
    const int64_t parts = total < kParallelWork
                              ? 1
                              : std::min({static_cast<int64_t>(at::get_num_threads()), max_parts,
                                          std::max<int64_t>(n, 1)});
    std::vector<int64_t> bounds{0};
    int64_t done = 0;
    for (int64_t r = 0; r < n && static_cast<int64_t>(bounds.size()) < parts; r++) {
        done += cost[r];
        if (done * parts >= total * static_cast<int64_t>(bounds.size()))
            bounds.push_back(r + 1);
    }
    if (bounds.back() != n)
        bounds.push_back(n);
    return bounds;
}

// Writes the attention of every row of `query` into `out` ([rows, heads * head_size],
// contiguous; padding rows zeroed).
void paged_attention_out(const at::Tensor& query, const at::Tensor& key,
                         const at::Tensor& value, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                         const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                         const at::Tensor& seq_lens, const at::Tensor& num_reqs_host,
                         double scale, const at::Tensor& workspace, int64_t sliding_window,
                         double logits_soft_cap, const at::Tensor& out) {
    const auto dtype = k_cache.scalar_type();
    TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) &&
                    query.scalar_type() == dtype && key.scalar_type() == dtype &&
                    value.scalar_type() == dtype && v_cache.scalar_type() == dtype,
                "paged_attention: query, key, value and caches all float32 or all bfloat16");
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && block_tables.scalar_type() == at::kInt &&
                    query_start_loc.scalar_type() == at::kInt &&
                    seq_lens.scalar_type() == at::kInt && num_reqs_host.scalar_type() == at::kInt,
                "paged_attention: slot_mapping int64, block_tables/query_start_loc/seq_lens/"
                "num_reqs int32");
    TORCH_CHECK(query.stride(-1) == 1 && key.stride(-1) == 1 && value.stride(-1) == 1,
                "paged_attention: q/k/v rows must be contiguous");
    TORCH_CHECK(query_start_loc.is_contiguous() && seq_lens.is_contiguous() &&
                    slot_mapping.is_contiguous() && block_tables.stride(1) == 1,
                "paged_attention: metadata tensors must be contiguous");
    TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
                    v_cache.sizes() == k_cache.sizes(),
                "paged_attention: caches must be contiguous [blocks, kv_heads, head_size, "
                "block_size]");
    const int64_t num_reqs = num_reqs_host.data_ptr<int32_t>()[0];
    const int64_t rows = query.size(0);
    TORCH_CHECK(num_reqs >= 0 && num_reqs < query_start_loc.numel() &&
                    num_reqs <= block_tables.size(0) && num_reqs <= seq_lens.size(0),
                "paged_attention: ", num_reqs, " requests exceed the batch's tensors");
    TORCH_CHECK(key.size(0) == rows && value.size(0) == rows && slot_mapping.size(0) >= rows,
                "paged_attention: query, key and value rows differ, or fewer slots than rows");
    const int64_t num_kv_heads = k_cache.size(1), head_size = k_cache.size(2);
    const int64_t block_size = k_cache.size(3);
    const int64_t num_heads = query.size(1) / head_size;
    TORCH_CHECK(key.size(-1) == num_kv_heads * head_size && value.size(-1) == key.size(-1),
                "paged_attention: key/value rows must hold kv_heads * head_size values");
    // Each workspace row holds one context's scores per query head of a KV head's group,
    // then (head_size + 1) * block_size accumulators: one row per thread.
    TORCH_CHECK(num_heads % num_kv_heads == 0, "paged_attention: heads not a multiple of kv heads");
    const int64_t group = num_heads / num_kv_heads;
    TORCH_CHECK(workspace.scalar_type() == at::kFloat && workspace.is_contiguous() &&
                    workspace.dim() == 2,
                "paged_attention: workspace must be float32 [threads, floats per thread]");
    const int64_t max_len = (workspace.size(1) - (head_size + 1) * block_size) / group;
    TORCH_CHECK(max_len > 0 && workspace.size(0) > 0, "paged_attention: workspace too small");
    TORCH_CHECK(out.scalar_type() == dtype && out.is_contiguous() && out.dim() == 2 &&
                    out.size(0) == rows && out.size(1) == query.size(1),
                "paged_attention: out must be contiguous [rows, heads * head_size] of the "
                "query's dtype");
    const paged_attention_step step = {
        query.data_ptr(), key.data_ptr(), value.data_ptr(), out.data_ptr(),
        k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr<int64_t>(),
        block_tables.data_ptr<int32_t>(), query_start_loc.data_ptr<int32_t>(),
        seq_lens.data_ptr<int32_t>(), block_tables.stride(0), num_reqs, rows, query.stride(0),
        key.stride(0), value.stride(0), num_heads, num_kv_heads, head_size, block_size,
        static_cast<float>(scale), k_cache.size(0), block_tables.size(1), max_len,
        dtype == at::kBFloat16, sliding_window, static_cast<float>(logits_soft_cap)};
    TORCH_CHECK(sliding_window >= 0 && logits_soft_cap >= 0,
                "paged_attention: sliding_window and logits_soft_cap must not be negative");
    const int status = paged_attention_begin(&step);
    TORCH_CHECK(status != 3, "paged_attention: head size above 4096");
    TORCH_CHECK(status == 0, "paged_attention: a slot, block id, sequence length or query range "
                "is outside the KV cache, the block table, the rows or the workspace");
    const std::vector<int64_t> bounds = split_requests(step, workspace.size(0));
    float* work = workspace.data_ptr<float>();
    const int64_t per_thread = workspace.size(1);
    at::parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; i++)
            paged_attention_requests(&step, bounds[i], bounds[i + 1], work + i * per_thread);
    });
}

// A new CPU tensor of x's dtype (or `dtype`): c10's CPU allocator directly, without the
// dispatcher call of at::empty or Tensor::new_empty (these operators run once per layer
// in a batch-1 graph).
at::Tensor empty_of(const at::Tensor& x, at::IntArrayRef sizes,
                    std::optional<at::ScalarType> dtype = std::nullopt) {
    return at::detail::empty_cpu(sizes, dtype.value_or(x.scalar_type()), /*pin_memory=*/false,
                                 std::nullopt);
}

at::Tensor paged_attention_windowed_capped(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
    const at::Tensor& num_reqs_host, double scale, const at::Tensor& workspace,
    int64_t sliding_window, double logits_soft_cap) {
    auto out = empty_of(query, {query.size(0), query.size(1)});
    paged_attention_out(query, key, value, k_cache, v_cache, slot_mapping, block_tables,
                        query_start_loc, seq_lens, num_reqs_host, scale, workspace,
                        sliding_window, logits_soft_cap, out);
    return out;
}

// Full attention without soft-capping: two arguments fewer to box per call, which a
// compiled batch-1 graph makes once per layer.
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key,
                           const at::Tensor& value, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                           const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, const at::Tensor& num_reqs_host,
                           double scale, const at::Tensor& workspace) {
    return paged_attention_windowed_capped(query, key, value, k_cache, v_cache, slot_mapping,
                                           block_tables, query_start_loc, seq_lens,
                                           num_reqs_host, scale, workspace, 0, 0.0);
}

// aten's grain size for pointwise ops (at::internal::GRAIN_SIZE): values per thread below
// which splitting costs more than it saves.
constexpr int64_t kGrainValues = 32768;

// fn(first_row, num_rows) over [0, rows), in ranges of at least kGrainValues values
// each, on torch's intra-op threads.
template <class F>
void for_rows(int64_t rows, int64_t values_per_row, const F& fn) {
    const int64_t grain = std::max<int64_t>(1, kGrainValues / std::max<int64_t>(values_per_row, 1));
    at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) { fn(b, e - b); });
}

void check_norm_args(const at::Tensor& x, const at::Tensor& weight) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat &&
                    x.dim() == 2 && x.stride(1) == 1 && weight.is_contiguous() &&
                    weight.numel() == x.size(1),
                "rms_norm: float32 rows [n, hidden] with a contiguous [hidden] weight");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
    check_norm_args(x, weight);
    const int64_t n = x.size(1), stride = x.stride(0);
    auto out = empty_of(x, {x.size(0), n});
    float *o = out.data_ptr<float>();
    const float *xp = x.data_ptr<float>(), *w = weight.data_ptr<float>();
    for_rows(x.size(0), n, [&](int64_t r, int64_t rows) {
        rms_norm_f32(o + r * n, xp + r * stride, w, rows, n, stride, static_cast<float>(eps));
    });
    return out;
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x,
                                                      const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps) {
    check_norm_args(x, weight);
    check_norm_args(residual, weight);
    TORCH_CHECK(residual.size(0) == x.size(0), "fused_add_rms_norm: row counts differ");
    const int64_t n = x.size(1), xs = x.stride(0), rs = residual.stride(0);
    auto out = empty_of(x, {x.size(0), n});
    auto res_out = empty_of(x, {x.size(0), n});
    float *o = out.data_ptr<float>(), *ro = res_out.data_ptr<float>();
    const float *xp = x.data_ptr<float>(), *rp = residual.data_ptr<float>();
    const float *w = weight.data_ptr<float>();
    for_rows(x.size(0), n, [&](int64_t r, int64_t rows) {
        fused_add_rms_norm_f32(o + r * n, ro + r * n, xp + r * xs, rp + r * rs, w, rows, n, xs,
                               rs, static_cast<float>(eps));
    });
    return {out, res_out};
}

at::Tensor rotary_embedding(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat &&
                    sin.scalar_type() == at::kFloat && x.dim() == 3 && x.stride(2) == 1,
                "rotary_embedding: float32 x [tokens, heads, head_size] with contiguous heads");
    const int64_t rows = x.size(0), heads = x.size(1), d = x.size(2);
    TORCH_CHECK(d % 2 == 0 && cos.size(0) == rows && sin.size(0) == rows &&
                    cos.size(-1) == d && sin.size(-1) == d && cos.stride(-1) == 1 &&
                    sin.stride(-1) == 1 && cos.stride(0) == sin.stride(0),
                "rotary_embedding: cos and sin rows of head_size (even) values, one per token");
    auto out = empty_of(x, {rows, heads, d});
    float *o = out.data_ptr<float>();
    const float *xp = x.data_ptr<float>(), *c = cos.data_ptr<float>(), *sn = sin.data_ptr<float>();
    const int64_t xs = x.stride(0), cs = cos.stride(0);
    for_rows(rows, heads * d, [&](int64_t r, int64_t n) {
        rotary_embedding_f32(o + r * heads * d, xp + r * xs, c + r * cs, sn + r * cs, n, heads, d,
                             xs, x.stride(1), cs);
    });
    return out;
}

at::Tensor argmax_rows(const at::Tensor& x) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 &&
                    x.size(1) > 0,
                "argmax_rows: float32 rows [n, vocab] with vocab > 0");
    const int64_t n = x.size(1), xs = x.stride(0);
    auto out = empty_of(x, {x.size(0)}, at::kLong);
    int64_t *o = out.data_ptr<int64_t>();
    const float *xp = x.data_ptr<float>();
    for_rows(x.size(0), n, [&](int64_t r, int64_t rows) {
        argmax_rows_f32(o + r, xp + r * xs, rows, n, xs);
    });
    return out;
}

at::Tensor silu_and_mul(const at::Tensor& x) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 &&
                    x.size(1) % 2 == 0,
                "silu_and_mul: float32 rows [n, 2 * d]");
    const int64_t d = x.size(1) / 2, xs = x.stride(0);
    auto out = empty_of(x, {x.size(0), d});
    float *o = out.data_ptr<float>();
    const float *xp = x.data_ptr<float>();
    for_rows(x.size(0), 2 * d, [&](int64_t r, int64_t rows) {
        silu_and_mul_f32(o + r * d, xp + r * xs, rows, d, xs);
    });
    return out;
}

// Weight values per thread at least (64 KiB of float32 or 32 KiB of bfloat16 weights),
// so that a thread has a few rows even at a hidden size of 4096.
constexpr int64_t kLinearGrainValues = 16384;

// k floats of `storage` starting on a 64-byte boundary: where linear_one_row widens a
// bf16 x, which is read once per weight row. On that boundary each of its vector loads
// stays within one cache line (a split load costs two, and bf16's loop loads x twice per
// weight vector); a float32 x is the activation itself, on the allocator's boundary.
float* aligned_floats(std::vector<float>& storage, int64_t k) {
    storage.resize(k + 16);
    const auto misalign = reinterpret_cast<uintptr_t>(storage.data()) / sizeof(float) % 16;
    return storage.data() + (16 - misalign) % 16;
}

// Output rows per thread for a product of k-value rows (kLinearGrainValues).
int64_t linear_grain(int64_t k) {
    return std::max<int64_t>(4, kLinearGrainValues / std::max<int64_t>(k, 1));
}

// A bfloat16 tensor's values as the kernels take them (raw 16-bit words).
const uint16_t* bf16_words(const at::Tensor& t) {
    return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}

// An optional bias's data (T: float, or uint16_t for bfloat16), or null.
template <class T>
const T* bias_data(const std::optional<at::Tensor>& bias) {
    if (!bias.has_value())
        return nullptr;
    if constexpr (std::is_same_v<T, float>)
        return bias->data_ptr<float>();
    else
        return bf16_words(*bias);
}

// float32 or bfloat16 throughout (x, weight, bias, and the output, of x's dtype);
// bfloat16 sums in float32 (csrc/linear.h).
at::Tensor linear_one_row(const at::Tensor& x, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias) {
    const auto dtype = x.scalar_type();
    TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) &&
                    weight.scalar_type() == dtype && x.dim() == 2 && x.size(0) == 1 &&
                    x.stride(1) == 1 && weight.dim() == 2 && weight.stride(1) == 1 &&
                    weight.size(1) == x.size(1),
                "linear_one_row: x [1, k] and a row-major weight [n, k], both float32 or both "
                "bfloat16");
    const int64_t n = weight.size(0), k = weight.size(1), ws = weight.stride(0);
    TORCH_CHECK(ws == k, "linear_one_row: the weight's rows must be contiguous");
    if (bias.has_value())
        TORCH_CHECK(bias->scalar_type() == dtype && bias->is_contiguous() && bias->numel() == n,
                    "linear_one_row: a contiguous bias [n] of x's dtype");
    auto out = empty_of(x, {1, n});
    const int64_t grain = linear_grain(k);
    if (dtype == at::kFloat) {
        const float* b = bias_data<float>(bias);
        float* y = out.data_ptr<float>();
        const float *xp = x.data_ptr<float>(), *w = weight.data_ptr<float>();
        at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
            linear_one_row_f32(y, xp, w, b, begin, end, k);
        });
        return out;
    }
    std::vector<float> storage;
    float* xf = aligned_floats(storage, k);
    widen_bf16_pairs(xf, bf16_words(x), k);
    const uint16_t *w = bf16_words(weight), *b = bias_data<uint16_t>(bias);
    auto* y = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
        linear_one_row_bf16(y, xf, w, b, begin, end, k);
    });
    return out;
}

// x [m, k] (m <= kMaxFewRows) times a row-major weight [n, k], float32 or bfloat16
// throughout as linear_one_row (csrc/linear.h); one row is linear_one_row's.
at::Tensor linear_few_rows(const at::Tensor& x, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias) {
    const auto dtype = x.scalar_type();
    TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) &&
                    weight.scalar_type() == dtype && x.dim() == 2 && x.size(0) >= 1 &&
                    x.size(0) <= kMaxFewRows && weight.dim() == 2 && weight.is_contiguous() &&
                    weight.size(1) == x.size(1),
                "linear_few_rows: x [m, k], 1 <= m <= 8, and a contiguous weight [n, k], both "
                "float32 or both bfloat16");
    const int64_t m = x.size(0), n = weight.size(0), k = weight.size(1);
    if (bias.has_value())
        TORCH_CHECK(bias->scalar_type() == dtype && bias->is_contiguous() && bias->numel() == n,
                    "linear_few_rows: a contiguous bias [n] of x's dtype");
    const at::Tensor xc = x.contiguous();
    if (m == 1)
        return linear_one_row(xc, weight, bias);
    auto out = empty_of(x, {m, n});
    const int64_t grain = linear_grain(k);
    // The rows of x as float32: the activation itself, or bf16 rows widened in pairs.
    std::vector<float> storage;
    const float* xf = nullptr;
    if (dtype == at::kFloat) {
        xf = xc.data_ptr<float>();
    } else {
        float* widened = aligned_floats(storage, m * k);
        for (int64_t r = 0; r < m; r++)
            widen_bf16_pairs(widened + r * k, bf16_words(xc) + r * k, k);
        xf = widened;
    }
    auto run = [&](auto* y, const auto* w, const auto* b) {
        at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
            few_rows_product(y, xf, w, b, m, begin, end, k, n);
        });
    };
    if (dtype == at::kFloat)
        run(out.data_ptr<float>(), weight.data_ptr<float>(), bias_data<float>(bias));
    else
        run(reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), bf16_words(weight),
            bias_data<uint16_t>(bias));
    return out;
}

std::string vector_isa_op() { return vector_isa(); }

// The batch-1 projection's row order as the CPU platform measured it (linear.h,
// rows_side_by_side): 1 rows side by side, 0 one stream, -1 the vendor rule again.
void set_rows_side_by_side(int64_t choice) {
    TORCH_CHECK(choice >= -1 && choice <= 1, "set_rows_side_by_side: -1, 0 or 1; got ", choice);
    rows_side_by_side_choice().store(static_cast<int>(choice));
}

// Whether the batch-1 projection reads rows of k values (bf16 ones where bf16) side by
// side, as things stand.
bool rows_side_by_side_op(int64_t k, bool bf16) { return rows_side_by_side(k, bf16); }

void cpu_allocator_install(int64_t cap_bytes) {
    TORCH_CHECK(cap_bytes >= 0, "cpu_allocator_install: cap_bytes must not be negative");
    CachingCpuAllocator::instance().install(cap_bytes);
}

// [installed, cached bytes, hits, misses, uncached (empty or above the largest class)]
std::vector<int64_t> cpu_allocator_stats() {
    auto& a = CachingCpuAllocator::instance();
    const auto s = a.stats();
    return {a.installed() ? 1 : 0, s.cached_bytes, s.hits, s.misses, s.uncached};
}

void cpu_allocator_trim() { CachingCpuAllocator::instance().trim(); }

// `borrowed`: the module's entry that borrows its input handles, or 0 (`impl` takes them).
int64_t graph_entry_make(const std::vector<at::Tensor>& inputs, int64_t impl,
                         int64_t num_outputs, int64_t borrowed) {
    TORCH_CHECK(impl != 0 && num_outputs >= 0, "graph_entry_make: no entry, or outputs < 0");
    auto* e = new GraphEntry{reinterpret_cast<GraphEntry::Impl>(borrowed != 0 ? borrowed : impl),
                             {}, num_outputs};
    e->inputs.reserve(inputs.size());
    for (const auto& t : inputs) {
        TORCH_CHECK(t.defined() && t.has_storage(), "graph_entry_make: an input has no storage");
        e->inputs.push_back(alias_of(t));
    }
    if (borrowed != 0) {
        e->lends = true;
        e->lend();
    }
    return reinterpret_cast<int64_t>(e);
}

int64_t graph_entry_binder() { return reinterpret_cast<int64_t>(&decodegraph_graph_entry_bind); }

std::string graph_error_op(const std::string& what) { return graph_error(what.c_str()); }

}  // namespace

TORCH_LIBRARY(decodegraph_cpu, m) {
    // The vector code the library was built with: avx512, avx2, neon or scalar.
    m.def("vector_isa() -> str", &vector_isa_op);
    m.def("set_rows_side_by_side(int choice) -> ()", &set_rows_side_by_side);
    m.def("rows_side_by_side(int k, bool bf16=False) -> bool", &rows_side_by_side_op);
    m.def("cpu_allocator_install(int cap_bytes) -> ()", &cpu_allocator_install);
    m.def("cpu_allocator_stats() -> int[]", &cpu_allocator_stats);
    m.def("cpu_allocator_trim() -> ()", &cpu_allocator_trim);
    m.def("graph_entry_make(Tensor[] inputs, int impl, int num_outputs, int borrowed=0) -> int",
          &graph_entry_make);
    m.def("graph_entry_binder() -> int", &graph_entry_binder);
    // A compiled graph's error with the reason its failed shim call stored (graph_entry.h).
    m.def("graph_error(str what) -> str", &graph_error_op);
    m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
    m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> "
          "(Tensor, Tensor)");
    m.def("rotary_embedding(Tensor x, Tensor cos, Tensor sin) -> Tensor");
    m.def("silu_and_mul(Tensor x) -> Tensor");
    m.def("argmax_rows(Tensor x) -> Tensor");
    m.def("linear_one_row(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
    m.def("linear_few_rows(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
    m.def("paged_attention(Tensor query, Tensor key, Tensor value, Tensor k_cache, "
          "Tensor v_cache, Tensor slot_mapping, Tensor block_tables, Tensor query_start_loc, "
          "Tensor seq_lens, Tensor num_reqs, float scale, Tensor workspace) -> Tensor");
    // With a sliding window (0: none) and logit soft-capping (0: none).
    m.def("paged_attention_windowed_capped(Tensor query, Tensor key, Tensor value, "
          "Tensor k_cache, Tensor v_cache, Tensor slot_mapping, Tensor block_tables, "
          "Tensor query_start_loc, Tensor seq_lens, Tensor num_reqs, float scale, "
          "Tensor workspace, int sliding_window, float logits_soft_cap) -> Tensor");
    // The same, into a given output (what a piecewise graph's eager attention calls).
    m.def("paged_attention_out(Tensor query, Tensor key, Tensor value, Tensor k_cache, "
          "Tensor v_cache, Tensor slot_mapping, Tensor block_tables, Tensor query_start_loc, "
          "Tensor seq_lens, Tensor num_reqs, float scale, Tensor workspace, "
          "int sliding_window, float logits_soft_cap, Tensor(a!) out) -> ()");
    m.def("shm_all_reduce(Tensor x, int handle) -> Tensor");
    m.def("shm_all_gather(Tensor x, int handle, int world_size) -> Tensor");
    m.def("shm_segment_open(str name, int rank, int world_size, int slot_bytes, "
          "float timeout_s) -> int",
          &decodegraph::shm_segment_open);
    m.def("shm_segment_unlink(str name) -> ()", &decodegraph::shm_segment_unlink);
    m.def("shm_segment_close(int handle) -> ()", &decodegraph::shm_segment_close);
    m.def("shm_segment_slot_bytes(int handle) -> int", &decodegraph::shm_segment_slot_bytes);
}

TORCH_LIBRARY_IMPL(decodegraph_cpu, CPU, m) {
    m.impl("paged_attention", &paged_attention);
    m.impl("paged_attention_windowed_capped", &paged_attention_windowed_capped);
    m.impl("paged_attention_out", &paged_attention_out);
    m.impl("rms_norm", &rms_norm);
    m.impl("fused_add_rms_norm", &fused_add_rms_norm);
    m.impl("rotary_embedding", &rotary_embedding);
    m.impl("silu_and_mul", &silu_and_mul);
    m.impl("argmax_rows", &argmax_rows);
    m.impl("linear_one_row", &linear_one_row);
    m.impl("linear_few_rows", &linear_few_rows);
    m.impl("shm_all_reduce", &decodegraph::shm_all_reduce);
    m.impl("shm_all_gather", &decodegraph::shm_all_gather);
}

// The C shims (see the top of this file): each returns AOTI_TORCH_SUCCESS with a new
// handle in *ret0, or AOTI_TORCH_FAILURE with the error logged, as torch's own shims do.
namespace {

const at::Tensor& of(AtenTensorHandle h) {
    return *torch::aot_inductor::tensor_handle_to_tensor_pointer(h);
}

}  // namespace

extern "C" {

AOTITorchError decodegraph_shim_paged_attention(
    AtenTensorHandle query, AtenTensorHandle key, AtenTensorHandle value,
    AtenTensorHandle k_cache, AtenTensorHandle v_cache, AtenTensorHandle slot_mapping,
    AtenTensorHandle block_tables, AtenTensorHandle query_start_loc, AtenTensorHandle seq_lens,
    AtenTensorHandle num_reqs, double scale, AtenTensorHandle workspace,
    AtenTensorHandle* ret0) {
    AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
        *ret0 = torch::aot_inductor::new_tensor_handle(paged_attention(
            of(query), of(key), of(value), of(k_cache), of(v_cache), of(slot_mapping),
            of(block_tables), of(query_start_loc), of(seq_lens), of(num_reqs), scale,
            of(workspace)));
    });
}

AOTITorchError decodegraph_shim_paged_attention_windowed_capped(
    AtenTensorHandle query, AtenTensorHandle key, AtenTensorHandle value,
    AtenTensorHandle k_cache, AtenTensorHandle v_cache, AtenTensorHandle slot_mapping,
    AtenTensorHandle block_tables, AtenTensorHandle query_start_loc, AtenTensorHandle seq_lens,
    AtenTensorHandle num_reqs, double scale, AtenTensorHandle workspace, int64_t sliding_window,
    double logits_soft_cap, AtenTensorHandle* ret0) {
    AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
        *ret0 = torch::aot_inductor::new_tensor_handle(paged_attention_windowed_capped(
            of(query), of(key), of(value), of(k_cache), of(v_cache), of(slot_mapping),
            of(block_tables), of(query_start_loc), of(seq_lens), of(num_reqs), scale,
            of(workspace), sliding_window, logits_soft_cap));
    });
}

AOTITorchError decodegraph_shim_rms_norm(AtenTensorHandle x, AtenTensorHandle weight, double eps,
                                         AtenTensorHandle* ret0) {
    AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE(
        { *ret0 = torch::aot_inductor::new_tensor_handle(rms_norm(of(x), of(weight), eps)); });
}

AOTITorchError decodegraph_shim_fused_add_rms_norm(AtenTensorHandle x, AtenTensorHandle residual,
                                                   AtenTensorHandle weight, double eps,
                                                   AtenTensorHandle* ret0, AtenTensorHandle* ret1) {
    AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
        auto [out, res] = fused_add_rms_norm(of(x), of(residual), of(weight), eps);
        *ret0 = torch::aot_inductor::new_tensor_handle(std::move(out));
        *ret1 = torch::aot_inductor::new_tensor_handle(std::move(res));
    });
}

AOTITorchError decodegraph_shim_rotary_embedding(AtenTensorHandle x, AtenTensorHandle cos,
                                                 AtenTensorHandle sin, AtenTensorHandle* ret0) {
    AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
        *ret0 = torch::aot_inductor::new_tensor_handle(rotary_embedding(of(x), of(cos), of(sin)));
    });
}

AOTITorchError decodegraph_shim_silu_and_mul(AtenTensorHandle x, AtenTensorHandle* ret0) {
    AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE(
        { *ret0 = torch::aot_inductor::new_tensor_handle(silu_and_mul(of(x))); });
}

AOTITorchError decodegraph_shim_linear_one_row(AtenTensorHandle x, AtenTensorHandle weight,
                                               AtenTensorHandle* bias, AtenTensorHandle* ret0) {
    AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
        const std::optional<at::Tensor> b =
            bias == nullptr ? std::nullopt : std::optional<at::Tensor>(of(*bias));
        *ret0 = torch::aot_inductor::new_tensor_handle(linear_one_row(of(x), of(weight), b));
    });
}

AOTITorchError decodegraph_shim_linear_few_rows(AtenTensorHandle x, AtenTensorHandle weight,
                                                AtenTensorHandle* bias, AtenTensorHandle* ret0) {
    AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
        const std::optional<at::Tensor> b =
            bias == nullptr ? std::nullopt : std::optional<at::Tensor>(of(*bias));
        *ret0 = torch::aot_inductor::new_tensor_handle(linear_few_rows(of(x), of(weight), b));
    });
}

AOTITorchError decodegraph_shim_shm_all_reduce(AtenTensorHandle x, int64_t handle,
                                               AtenTensorHandle* ret0) {
    AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
        *ret0 = torch::aot_inductor::new_tensor_handle(decodegraph::shm_all_reduce(of(x), handle));
    });
}

AOTITorchError decodegraph_shim_shm_all_gather(AtenTensorHandle x, int64_t handle,
                                               int64_t world_size, AtenTensorHandle* ret0) {
    AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
        *ret0 = torch::aot_inductor::new_tensor_handle(
            decodegraph::shm_all_gather(of(x), handle, world_size));
    });
}

}  // extern "C"
