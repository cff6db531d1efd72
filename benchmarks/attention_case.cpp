// One decode step's attention, layer by layer, through decodegraph's native kernel
// (paged_attention.h of whichever tree's csrc/ is on the include path), for
// bench_attention.py. Built as a shared library per tree with hidden symbols, so that two
// trees' kernels load side by side in one process and each calls its own code.
//
// A case: `batch` decode requests of `context` positions, `heads` query heads over
// `kv_heads`, head size `head_size`, block size 16, `layers` layers each with caches of
// their own (a step's working set, as the engine's), float32. Blocks are a random
// permutation, as a long-running block pool hands them out, or with `lockstep` in the
// order a fresh pool gives requests that started together (block k of request r is
// 1 + k * batch + r: bench_decode.py's batched workload), on transparent huge pages as
// the engine's KV cache is. Every value comes from one fixed seed: two builds of this
// file make the same inputs, so their outputs can be compared bit for bit.
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <vector>

#include "paged_attention.h"

namespace {

// float32 storage on 2 MiB pages where the kernel allows (the engine's KV cache is).
float* huge_floats(int64_t n) {
    constexpr size_t kHuge = size_t{2} << 20;
    const size_t bytes = (static_cast<size_t>(n) * sizeof(float) + kHuge - 1) / kHuge * kHuge;
    void* p = std::aligned_alloc(kHuge, bytes);
    if (p != nullptr)
        madvise(p, bytes, MADV_HUGEPAGE);
    return static_cast<float*>(p);
}

struct Case {
    int64_t batch, context, heads, kv_heads, head_size, layers, blocks_per_req, num_blocks;
    std::vector<float*> k_caches, v_caches;
    std::vector<int32_t> block_tables, seq_lens, query_start_loc;
    std::vector<int64_t> slots;
    std::vector<float> q, k, v, out, work;
};

constexpr int64_t kBlock = 16;

decodegraph::paged_attention_step step_of(Case* c, int64_t layer) {
    decodegraph::paged_attention_step a{};
    a.q = c->q.data();
    a.k = c->k.data();
    a.v = c->v.data();
    a.out = c->out.data();
    a.k_cache = c->k_caches[layer];
    a.v_cache = c->v_caches[layer];
    a.slot_mapping = c->slots.data();
    a.block_tables = c->block_tables.data();
    a.query_start_loc = c->query_start_loc.data();
    a.seq_lens = c->seq_lens.data();
    a.bt_stride = c->blocks_per_req;
    a.num_reqs = a.num_rows = c->batch;
    a.q_stride = c->heads * c->head_size;
    a.k_stride = a.v_stride = c->kv_heads * c->head_size;
    a.num_heads = c->heads;
    a.num_kv_heads = c->kv_heads;
    a.head_size = c->head_size;
    a.block_size = kBlock;
    a.scale = 1.f / std::sqrt(static_cast<float>(c->head_size));
    a.num_blocks = c->num_blocks;
    a.bt_cols = c->blocks_per_req;
    a.max_len = c->blocks_per_req * kBlock;
    return a;
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) void* dg_case_new(int64_t batch, int64_t context,
                                                         int64_t heads, int64_t kv_heads,
                                                         int64_t head_size, int64_t layers,
                                                         int64_t lockstep) {
    auto* c = new Case{};
    c->batch = batch;
    c->context = context;
    c->heads = heads;
    c->kv_heads = kv_heads;
    c->head_size = head_size;
    c->layers = layers;
    c->blocks_per_req = (context + kBlock - 1) / kBlock;
    c->num_blocks = batch * c->blocks_per_req + 1;
    std::mt19937 rng(0);
    std::uniform_real_distribution<float> uniform(-2.f, 2.f);
    const int64_t cache = c->num_blocks * kv_heads * head_size * kBlock;
    for (int64_t l = 0; l < layers; l++) {
        for (auto* caches : {&c->k_caches, &c->v_caches}) {
            float* p = huge_floats(cache);
            for (int64_t i = 0; i < cache; i++)
                p[i] = uniform(rng);
            caches->push_back(p);
        }
    }
    std::vector<int32_t> ids(c->num_blocks - 1);
    for (int64_t i = 0; i < c->num_blocks - 1; i++)
        ids[i] = static_cast<int32_t>(i + 1);
    if (lockstep)
        for (int64_t r = 0; r < batch; r++)
            for (int64_t k = 0; k < c->blocks_per_req; k++)
                ids[r * c->blocks_per_req + k] = static_cast<int32_t>(1 + k * batch + r);
    else
        std::shuffle(ids.begin(), ids.end(), rng);
    c->block_tables = ids;
    c->seq_lens.assign(batch, static_cast<int32_t>(context));
    for (int64_t r = 0; r <= batch; r++)
        c->query_start_loc.push_back(static_cast<int32_t>(r));
    for (int64_t r = 0; r < batch; r++)  // each new token at its request's last position
        c->slots.push_back(int64_t{ids[r * c->blocks_per_req + c->blocks_per_req - 1]} * kBlock +
                           (context - 1) % kBlock);
    for (auto* x : {&c->q, &c->k, &c->v}) {
        x->resize(batch * (x == &c->q ? heads : kv_heads) * head_size);
        for (auto& f : *x)
            f = uniform(rng);
    }
    c->out.resize(batch * heads * head_size);
    c->work.resize((heads / kv_heads) * c->blocks_per_req * kBlock + (head_size + 1) * kBlock);
    return c;
}

// Microseconds per step (every layer once) over `reps` steps; -1 if a step is refused.
__attribute__((visibility("default"))) double dg_case_time(void* handle, int64_t reps) {
    auto* c = static_cast<Case*>(handle);
    const auto start = std::chrono::steady_clock::now();
    for (int64_t rep = 0; rep < reps; rep++) {
        for (int64_t l = 0; l < c->layers; l++) {
            const decodegraph::paged_attention_step a = step_of(c, l);
            if (decodegraph::paged_attention_begin(&a) != 0)
                return -1.0;
            decodegraph::paged_attention_requests(&a, 0, c->batch, c->work.data());
        }
    }
    const std::chrono::duration<double, std::micro> took = std::chrono::steady_clock::now() - start;
    return took.count() / static_cast<double>(reps);
}

// The last layer's output of the last step: batch * heads * head_size floats.
__attribute__((visibility("default"))) const float* dg_case_out(void* handle) {
    return static_cast<Case*>(handle)->out.data();
}

__attribute__((visibility("default"))) void dg_case_free(void* handle) {
    auto* c = static_cast<Case*>(handle);
    for (auto* caches : {&c->k_caches, &c->v_caches})
        for (float* p : *caches)
            std::free(p);
    delete c;
}

}  // extern "C"
