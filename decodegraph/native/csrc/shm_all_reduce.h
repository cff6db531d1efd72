// All-reduce and all-gather between the tensor-parallel ranks of one host, through one
// POSIX shared-memory segment per group instead of gloo's loopback TCP: a gloo
// all-reduce of one decode row costs 1.5-2 ms on two cores, this a few microseconds.
//
// The segment (rank 0 creates it, the others map it by name, rank 0 unlinks it once all
// have: decodegraph/distributed/shm_all_reduce.py) holds a header, then per rank one
// cache line with that rank's call counter, then per rank two data slots:
//
//   [header | counter 0 | counter 1 | ... | slot 0.even | slot 0.odd | slot 1.even | ...]
//
// Call n of a rank copies its input into its slot of parity n % 2, stores n into its
// counter (release), waits until every other counter reached n (acquire loads: spin, then
// sched_yield), and reads every rank's slot of that parity. One wait per call suffices
// because of the two parities: a rank writes slot parity (n + 1) % 2 only after call n's
// wait, and parity n % 2 again (call n + 2) only after every rank published n + 1, that is
// after every rank finished reading call n. Sums run in rank order on every rank, so all
// ranks hold the same bits (bfloat16 sums in float32, rounded once).
//
// A peer that never arrives (it died, or hangs) makes the call throw, naming that rank,
// after the segment's timeout instead of spinning forever.
#ifndef DECODEGRAPH_SHM_ALL_REDUCE_H
#define DECODEGRAPH_SHM_ALL_REDUCE_H

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>

#include "vec.h"

namespace decodegraph {

static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "the counters must be lock-free atomics to work across processes");

constexpr uint64_t kShmMagic = 0x6463677368617231ull;  // "dcgshar1"
constexpr int64_t kLine = 64;                           // one counter per cache line

struct ShmHeader {
    uint64_t magic;
    int64_t world_size;
    int64_t slot_bytes;
};

struct alignas(kLine) ShmCounter {
    std::atomic<uint64_t> seq;
};

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#elif defined(__aarch64__)
    asm volatile("yield" ::: "memory");
#endif
}

// This process's view of one group's segment.
class ShmSegment {
   public:
    ShmSegment(const std::string& name, int64_t rank, int64_t world_size, int64_t slot_bytes,
               double timeout_s)
        : name_(name), rank_(rank), world_(world_size), timeout_s_(timeout_s) {
        TORCH_CHECK(world_size >= 2 && rank >= 0 && rank < world_size,
                    "shm segment: rank ", rank, " outside a world of ", world_size);
        slot_bytes_ = (slot_bytes + kLine - 1) / kLine * kLine;
        TORCH_CHECK(slot_bytes_ > 0, "shm segment: slot size must be positive");
        size_ = static_cast<size_t>(kLine * (1 + world_) + 2 * world_ * slot_bytes_);
        const bool create = rank == 0;
        const int fd = create ? shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600)
                              : shm_open(name.c_str(), O_RDWR, 0600);
        TORCH_CHECK(fd >= 0, "shm segment: shm_open(", name, ") failed: ", std::strerror(errno));
        // Allocated now, not on first touch: a /dev/shm too small for the segment is an
        // error here (and the group keeps gloo) rather than a SIGBUS mid-step.
        const int alloc_err =
            create ? posix_fallocate(fd, 0, static_cast<off_t>(size_)) : 0;
        if (alloc_err != 0) {
            close(fd);
            shm_unlink(name.c_str());
            TORCH_CHECK(false, "shm segment: cannot allocate ", size_, " bytes for ", name,
                        ": ", std::strerror(alloc_err));
        }
        struct stat st {};
        const bool sized = fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) == size_;
        void* p = sized ? mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                        : MAP_FAILED;
        const int err = errno;
        close(fd);
        if (p == MAP_FAILED && create)
            shm_unlink(name.c_str());
        TORCH_CHECK(sized, "shm segment: ", name, " is not of ", size_, " bytes");
        TORCH_CHECK(p != MAP_FAILED, "shm segment: mmap(", name, ") failed: ", std::strerror(err));
        base_ = static_cast<char*>(p);
        auto* header = reinterpret_cast<ShmHeader*>(base_);
        if (create) {
            *header = {kShmMagic, world_, slot_bytes_};
            for (int64_t r = 0; r < world_; r++)
                new (counter(r)) ShmCounter{{0}};
        } else if (header->magic != kShmMagic || header->world_size != world_ ||
                   header->slot_bytes != slot_bytes_) {
            munmap(base_, size_);
            TORCH_CHECK(false, "shm segment: ", name, " was made for another group");
        }
    }

    ~ShmSegment() { munmap(base_, size_); }

    ShmSegment(const ShmSegment&) = delete;
    ShmSegment& operator=(const ShmSegment&) = delete;

    int64_t slot_bytes() const { return slot_bytes_; }
    int64_t world_size() const { return world_; }
    int64_t rank() const { return rank_; }

    // One collective call: `write(slot)` fills this rank's slot, then, once every rank
    // has written, `read(slots)` gets every rank's slot of this call in rank order.
    template <class Write, class Read>
    void exchange(const char* what, const Write& write, const Read& read) {
        const uint64_t n = ++seq_;
        const int64_t parity = static_cast<int64_t>(n & 1);
        write(slot(rank_, parity));
        counter(rank_)->seq.store(n, std::memory_order_release);
        for (int64_t r = 0; r < world_; r++)
            if (r != rank_)
                wait_for(what, r, n);
        const char* slots[64];
        TORCH_CHECK(world_ <= 64, what, ": at most 64 ranks");
        for (int64_t r = 0; r < world_; r++)
            slots[r] = slot(r, parity);
        read(slots);
    }

   private:
    ShmCounter* counter(int64_t r) const {
        return reinterpret_cast<ShmCounter*>(base_ + kLine * (1 + r));
    }
    char* slot(int64_t r, int64_t parity) const {
        return base_ + kLine * (1 + world_) + (2 * r + parity) * slot_bytes_;
    }

    // Until rank r published call n: spin (a peer a few microseconds behind), then yield
    // the core (a peer descheduled, or still computing), checking the clock now and then.
    void wait_for(const char* what, int64_t r, uint64_t n) const {
        std::atomic<uint64_t>& seq = counter(r)->seq;
        for (int i = 0; i < 4096; i++) {
            if (seq.load(std::memory_order_acquire) >= n)
                return;
            cpu_relax();
        }
        const auto start = std::chrono::steady_clock::now();
        for (uint64_t i = 1;; i++) {
            if (seq.load(std::memory_order_acquire) >= n)
                return;
            sched_yield();
            if (i % 1024 == 0) {
                const std::chrono::duration<double> waited = std::chrono::steady_clock::now() - start;
                TORCH_CHECK(waited.count() < timeout_s_, what, ": rank ", r,
                            " did not reach call ", n, " within ", timeout_s_,
                            " s (it died or hangs); this is rank ", rank_, ", segment ", name_);
            }
        }
    }

    std::string name_;
    int64_t rank_, world_, slot_bytes_ = 0;
    double timeout_s_;
    size_t size_ = 0;
    char* base_ = nullptr;
    uint64_t seq_ = 0;  // this rank's calls so far
};

// The segments this process has mapped, by handle (never reused: a graph that outlived
// its group finds no segment rather than another group's).
class ShmRegistry {
   public:
    static ShmRegistry& get() {
        static ShmRegistry registry;
        return registry;
    }
    int64_t add(std::unique_ptr<ShmSegment> s) {
        std::lock_guard<std::mutex> lock(mutex_);
        segments_[next_] = std::move(s);
        return next_++;
    }
    ShmSegment& at(int64_t handle) {
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = segments_.find(handle);
        TORCH_CHECK(it != segments_.end(), "no shm segment with handle ", handle,
                    " (its group was destroyed?)");
        return *it->second;
    }
    void remove(int64_t handle) {
        std::lock_guard<std::mutex> lock(mutex_);
        segments_.erase(handle);
    }

   private:
    std::mutex mutex_;
    std::map<int64_t, std::unique_ptr<ShmSegment>> segments_;
    int64_t next_ = 1;
};

inline int64_t shm_segment_open(const std::string& name, int64_t rank, int64_t world_size,
                                int64_t slot_bytes, double timeout_s) {
    return ShmRegistry::get().add(
        std::make_unique<ShmSegment>(name, rank, world_size, slot_bytes, timeout_s));
}

inline void shm_segment_unlink(const std::string& name) { shm_unlink(name.c_str()); }

inline void shm_segment_close(int64_t handle) { ShmRegistry::get().remove(handle); }

inline int64_t shm_segment_slot_bytes(int64_t handle) {
    return ShmRegistry::get().at(handle).slot_bytes();
}

// Values per thread below which splitting a sum over threads costs more than it saves.
constexpr int64_t kShmGrain = 32768;

// out[i] = sum over r in rank order of in[r][i], float32.
inline void sum_f32(float* out, const char* const* in, int64_t world, int64_t b, int64_t e) {
    const auto* s0 = reinterpret_cast<const float*>(in[0]);
    int64_t i = b;
    for (; i + kLanes <= e; i += kLanes) {
        Vec acc = Vec::loadu(s0 + i);
        for (int64_t r = 1; r < world; r++)
            acc = acc + Vec::loadu(reinterpret_cast<const float*>(in[r]) + i);
        acc.store(out + i);
    }
    for (; i < e; i++) {
        float acc = s0[i];
        for (int64_t r = 1; r < world; r++)
            acc += reinterpret_cast<const float*>(in[r])[i];
        out[i] = acc;
    }
}

// The same for bfloat16: summed in float32, rounded once.
inline void sum_bf16(uint16_t* out, const char* const* in, int64_t world, int64_t b,
                     int64_t e) {
    for (int64_t i = b; i < e; i++) {
        float acc = bf16_to_f32(reinterpret_cast<const uint16_t*>(in[0])[i]);
        for (int64_t r = 1; r < world; r++)
            acc += bf16_to_f32(reinterpret_cast<const uint16_t*>(in[r])[i]);
        out[i] = f32_to_bf16(acc);
    }
}

inline at::Tensor shm_all_reduce(const at::Tensor& x, int64_t handle) {
    ShmSegment& seg = ShmRegistry::get().at(handle);
    const auto dtype = x.scalar_type();
    TORCH_CHECK(x.device().is_cpu() && (dtype == at::kFloat || dtype == at::kBFloat16),
                "shm_all_reduce: float32 or bfloat16 CPU tensors only");
    const at::Tensor in = x.contiguous();
    const int64_t n = in.numel(), bytes = n * static_cast<int64_t>(in.element_size());
    TORCH_CHECK(bytes <= seg.slot_bytes(), "shm_all_reduce: ", bytes,
                " bytes exceed the slot's ", seg.slot_bytes());
    at::Tensor out = at::empty(in.sizes(), in.options());
    const int64_t world = seg.world_size();
    seg.exchange(
        "shm_all_reduce", [&](char* slot) { std::memcpy(slot, in.data_ptr(), bytes); },
        [&](const char* const* slots) {
            at::parallel_for(0, n, kShmGrain, [&](int64_t b, int64_t e) {
                if (dtype == at::kFloat)
                    sum_f32(out.data_ptr<float>(), slots, world, b, e);
                else
                    sum_bf16(reinterpret_cast<uint16_t*>(out.data_ptr()), slots, world, b, e);
            });
        });
    return out;
}

// Every rank's x stacked along dim 0 in rank order (all_gather_into_tensor's layout).
inline at::Tensor shm_all_gather(const at::Tensor& x, int64_t handle, int64_t world_size) {
    ShmSegment& seg = ShmRegistry::get().at(handle);
    TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1, "shm_all_gather: CPU tensors of dim >= 1");
    TORCH_CHECK(world_size == seg.world_size(), "shm_all_gather: world size ", world_size,
                " is not the segment's ", seg.world_size());
    const at::Tensor in = x.contiguous();
    const int64_t bytes = in.numel() * static_cast<int64_t>(in.element_size());
    TORCH_CHECK(bytes <= seg.slot_bytes(), "shm_all_gather: ", bytes,
                " bytes exceed the slot's ", seg.slot_bytes());
    auto sizes = in.sizes().vec();
    sizes[0] *= world_size;
    at::Tensor out = at::empty(sizes, in.options());
    char* o = static_cast<char*>(out.data_ptr());
    seg.exchange(
        "shm_all_gather", [&](char* slot) { std::memcpy(slot, in.data_ptr(), bytes); },
        [&](const char* const* slots) {
            for (int64_t r = 0; r < world_size; r++)
                std::memcpy(o + r * bytes, slots[r], bytes);
        });
    return out;
}

}  // namespace decodegraph

#endif  // DECODEGRAPH_SHM_ALL_REDUCE_H
