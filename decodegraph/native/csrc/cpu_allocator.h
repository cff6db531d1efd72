// A caching allocator for small and mid-size CPU tensors, installed in front of c10's
// default one (c10::SetCPUAllocator).
//
// Why: a replayed CPU graph allocates every intermediate buffer afresh (Inductor's C++
// wrapper calls empty_strided per buffer, and our operators allocate their outputs), a
// few dozen buffers per decode step. c10's default allocator asks glibc for each one
// with posix_memalign (64-byte alignment), which never uses glibc's per-thread cache:
// every allocation and free takes the arena lock, and a request of 1 KiB or more first
// consolidates the fast bins: a large share of a small model's batch-1 replay
// (docs/performance.md). Here a freed block goes on a free list of its size class and
// the next request of that class takes it back (a push or a pop under one spin lock).
//
// Blocks: a 64-byte header, then the data (64-byte aligned, as c10's own allocator
// gives). The header holds the class and the free-list link. Every block has one, those
// above kMaxBlock too (their class kUncached: freed to the system, never cached), and an
// empty request gets no block (a null pointer, which release takes): c10's raw_deallocate
// (torch's oneDNN integration frees its buffers with it) calls raw_deleter() on the bare
// pointer, so release must take every pointer this allocator gave out. A block freed
// while the cache holds its cap goes back to the system. Classes: multiples of 64 bytes
// up to 1 KiB, then four per power of two (at most 25 % over the request).
#ifndef DECODEGRAPH_CPU_ALLOCATOR_H
#define DECODEGRAPH_CPU_ALLOCATOR_H

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <pthread.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <thread>

namespace decodegraph {

class CachingCpuAllocator final : public c10::Allocator {
   public:
    static constexpr size_t kHeader = 64, kMaxBlock = size_t{4} << 20;
    static constexpr int kSmall = 16;                                // 64 .. 1024 bytes
    static constexpr int kClasses = kSmall + 4 * (22 - 10);          // then up to 4 MiB
    static constexpr int kUncached = kClasses;                       // above kMaxBlock
    static constexpr uint32_t kMagic = 0x64674361;                   // "dgCa"

    // The size class of an n-byte request (n <= kMaxBlock), and the bytes it holds.
    static int size_class(size_t n) {
        if (n <= 1024)
            return n == 0 ? 0 : static_cast<int>((n + 63) / 64) - 1;
        const int p = 63 - __builtin_clzll(static_cast<unsigned long long>(n - 1));  // 2^p < n
        const size_t step = size_t{1} << (p - 2);
        return kSmall + (p - 10) * 4 + static_cast<int>((n + step - 1) / step) - 5;
    }
    static size_t class_bytes(int c) {
        if (c < kSmall)
            return static_cast<size_t>(c + 1) * 64;
        const int p = 10 + (c - kSmall) / 4;
        return (size_t{1} << (p - 2)) * static_cast<size_t>((c - kSmall) % 4 + 5);
    }

    struct Stats {
        int64_t cached_bytes, hits, misses, uncached;
    };

    static CachingCpuAllocator& instance() {
        static CachingCpuAllocator* a = new CachingCpuAllocator();  // never destroyed:
        return *a;  // tensors it made may outlive everything else
    }

    // Put this allocator in front of the current CPU allocator, with at most `cap` bytes
    // of free blocks kept; again: only the cap changes. cap 0: uninstall (the previous
    // allocator back, every cached block freed; blocks still in use are freed when
    // their tensors go).
    void install(int64_t cap) {
        if (cap <= 0) {
            cap_.store(0);
            if (installed_) {
                c10::SetCPUAllocator(previous_, kPriority);
                installed_ = false;
            }
            trim();
            return;
        }
        cap_.store(cap);
        if (!installed_) {
            previous_ = c10::GetCPUAllocator();
            c10::SetCPUAllocator(this, kPriority);
            installed_ = true;
        }
    }
    bool installed() const { return installed_; }

    c10::DataPtr allocate(size_t n) override {
        if (n == 0) {
            uncached_.fetch_add(1, std::memory_order_relaxed);
            return {nullptr, nullptr, &release, c10::Device(c10::DeviceType::CPU)};
        }
        if (n > kMaxBlock) {
            uncached_.fetch_add(1, std::memory_order_relaxed);
            return data_ptr(new_block(kUncached, n));
        }
        const int c = size_class(n);
        Header* h = nullptr;
        {
            Lock lock(spin_);
            h = free_[c];
            if (h != nullptr) {
                free_[c] = h->next;
                cached_bytes_ -= static_cast<int64_t>(class_bytes(c));
            }
        }
        if (h != nullptr) {
            hits_.fetch_add(1, std::memory_order_relaxed);
        } else {
            misses_.fetch_add(1, std::memory_order_relaxed);
            h = new_block(c, class_bytes(c));
        }
        h->next = nullptr;
        return data_ptr(h);
    }

    c10::DeleterFnPtr raw_deleter() const override { return &release; }

    void copy_data(void* dest, const void* src, std::size_t count) const override {
        default_copy_data(dest, src, count);
    }

    // Free every cached block.
    void trim() {
        for (int c = 0; c < kClasses; c++) {
            Header* h;
            {
                Lock lock(spin_);
                h = free_[c];
                free_[c] = nullptr;
                for (Header* x = h; x != nullptr; x = x->next)
                    cached_bytes_ -= static_cast<int64_t>(class_bytes(c));
            }
            while (h != nullptr) {
                Header* next = h->next;
                c10::free_cpu(h);
                h = next;
            }
        }
    }

    Stats stats() {
        Lock lock(spin_);
        return {cached_bytes_, hits_.load(), misses_.load(), uncached_.load()};
    }

   private:
    // Above c10's own registration (priority 0), so that a later default registration
    // does not displace it.
    static constexpr uint8_t kPriority = 1;

    struct Header {
        Header* next;
        uint32_t cls, magic;
        size_t bytes;  // the data's: the class's, or an uncached block's request
    };
    static_assert(sizeof(Header) <= kHeader, "header too large");

    // A block from the system: its header, then `bytes` of data.
    static Header* new_block(int cls, size_t bytes) {
        Header* h = static_cast<Header*>(c10::alloc_cpu(kHeader + bytes));
        h->next = nullptr;
        h->cls = static_cast<uint32_t>(cls);
        h->magic = kMagic;
        h->bytes = bytes;
        return h;
    }

    static c10::DataPtr data_ptr(Header* h) {
        void* data = reinterpret_cast<char*>(h) + kHeader;
        if (c10::memoryProfilingEnabled())
            c10::reportMemoryUsageToProfiler(data, static_cast<int64_t>(h->bytes), 0, 0,
                                             c10::Device(c10::DeviceType::CPU));
        return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
    }

    // A spin lock (held for a push or a pop), released in a forked child: a thread of the
    // parent may have held it at the fork.
    struct Lock {
        explicit Lock(std::atomic<bool>& f) : flag(f) {
            for (int spins = 0; flag.exchange(true, std::memory_order_acquire); spins++)
                if (spins > 64)
                    std::this_thread::yield();
        }
        ~Lock() { flag.store(false, std::memory_order_release); }
        std::atomic<bool>& flag;
    };

    CachingCpuAllocator() {
        pthread_atfork(nullptr, nullptr, [] { instance().spin_.store(false); });
    }

    static void release(void* data) {
        if (data == nullptr)  // an empty request's
            return;
        auto& self = instance();
        Header* h = reinterpret_cast<Header*>(static_cast<char*>(data) - kHeader);
        const int c = static_cast<int>(h->cls);
        TORCH_CHECK(h->magic == kMagic && c <= kUncached, "decodegraph CPU allocator: a "
                    "block freed that it did not allocate, or a corrupted header");
        const int64_t bytes = static_cast<int64_t>(h->bytes);
        if (c10::memoryProfilingEnabled())
            c10::reportMemoryUsageToProfiler(data, -bytes, 0, 0,
                                             c10::Device(c10::DeviceType::CPU));
        if (c == kUncached) {
            c10::free_cpu(h);
            return;
        }
        {
            Lock lock(self.spin_);
            if (self.cached_bytes_ + bytes <= self.cap_.load(std::memory_order_relaxed)) {
                h->next = self.free_[c];
                self.free_[c] = h;
                self.cached_bytes_ += bytes;
                return;
            }
        }
        c10::free_cpu(h);
    }

    std::atomic<bool> spin_{false};
    std::atomic<int64_t> cap_{0};
    Header* free_[kClasses] = {};
    int64_t cached_bytes_ = 0;
    std::atomic<int64_t> hits_{0}, misses_{0}, uncached_{0};
    c10::Allocator* previous_ = nullptr;
    bool installed_ = false;
};

}  // namespace decodegraph

#endif
