// Host emulation of the small part of the CUDA execution model that kernels/*.cu use, so their
// logic can be checked against the NumPy oracle on machines without a GPU (CI).
//
// One std::thread per CUDA thread; blocks run one after another, so a single buffer serves as a
// block's shared memory. __syncthreads is a barrier over the block, __syncwarp and the shuffles a
// barrier over the warp (the kernels only call them warp-uniformly, as the full mask requires).
// Dynamic shared memory starts filled with NaN so that a read of a word no thread wrote shows up
// in the result, and is followed by guard words whose overwrite is reported (emu_shared_overrun):
// the launcher's shared-memory size must cover the kernel's carve-up. The emulation says nothing about races the hardware could expose, performance,
// or compiler-specific behaviour; it checks indexing and arithmetic.
//
// Asynchronous copies (cp.async, kernels/common.cuh) are deferred: cp_async records the copy in the
// calling thread's open group, cp_async_commit closes the group, and cp_async_wait<N> performs, in
// order, the copies of every committed group but the newest N -- the latest moment the hardware
// guarantees them. A kernel that reads a buffer before the wait covering its copy therefore reads
// what was there before (NaN, zero or an older tile), and a thread that ends with copies not yet
// waited for is reported (emu_copy_errors), as is a copy whose addresses are not aligned to its
// size (the hardware faults on those).
//
// Used by subspace_ref_cupy/_emulation.py, which also rewrites `extern __shared__` and
// `__shared__` in the kernel source (see there).
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#include <math.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cstdint>
#include <deque>
#include <cstddef>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __launch_bounds__
#undef __restrict__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict

using std::max;
using std::min;

namespace emu {

struct Dim3 {
    unsigned x = 1, y = 1, z = 1;
};

struct Block {
    std::unique_ptr<std::barrier<>> block_barrier;
    std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
    std::vector<float> exchange;  // one slot per thread, for the shuffles
    std::vector<float> shared;    // dynamic shared memory
};

inline thread_local Dim3 thread_idx, block_idx, block_dim, grid_dim;
inline thread_local Block* block = nullptr;
// Set when a block wrote past the dynamic shared memory it was launched with.
inline int shared_overrun = 0;
// 256 KiB: more than any GPU grants one block, so even a kernel launched with far too little
// shared memory writes into the guard and not past the buffer.
constexpr std::size_t kGuardWords = 64 * 1024;
constexpr unsigned kGuardBits = 0x7fc0dead;

struct PendingCopy {
    void* dst;
    const void* src;
    std::size_t bytes;
};
struct CopyQueue {
    std::vector<PendingCopy> open;
    std::deque<std::vector<PendingCopy>> committed;
    bool empty() const {
        if (!open.empty()) return false;
        for (const auto& g : committed) {
            if (!g.empty()) return false;
        }
        return true;
    }
};
inline thread_local CopyQueue copies;
// Threads that ended with copies never waited for, and misaligned copies, since the last check.
inline std::atomic<int> copy_errors{0};

inline float* dynamic_smem() { return block->shared.data(); }

inline std::barrier<>& warp_barrier() { return *block->warp_barriers[thread_idx.x / 32]; }

template <class Body>
void launch(Dim3 grid, Dim3 threads, std::size_t shared_bytes, Body body) {
    const unsigned n = threads.x;  // the kernels use 1-D blocks of whole warps
    for (unsigned z = 0; z < grid.z; ++z) {
        for (unsigned y = 0; y < grid.y; ++y) {
            for (unsigned x = 0; x < grid.x; ++x) {
                Block b;
                b.block_barrier = std::make_unique<std::barrier<>>(n);
                for (unsigned w = 0; w < n / 32; ++w) {
                    b.warp_barriers.push_back(std::make_unique<std::barrier<>>(32));
                }
                b.exchange.assign(n, 0.0f);
                const std::size_t words = (shared_bytes + sizeof(float) - 1) / sizeof(float);
                b.shared.assign(words + kGuardWords, std::numeric_limits<float>::quiet_NaN());
                for (std::size_t i = words; i < b.shared.size(); ++i) {
                    std::memcpy(&b.shared[i], &kGuardBits, sizeof(float));
                }
                std::vector<std::thread> pool;
                for (unsigned t = 0; t < n; ++t) {
                    pool.emplace_back([&, t] {
                        thread_idx = Dim3{t, 0, 0};
                        block_idx = Dim3{x, y, z};
                        block_dim = threads;
                        grid_dim = grid;
                        block = &b;
                        copies = CopyQueue{};
                        body();
                        if (!copies.empty()) {
                            ++copy_errors;
                        }
                        copies = CopyQueue{};
                    });
                }
                for (auto& th : pool) {
                    th.join();
                }
                for (std::size_t i = words; i < b.shared.size(); ++i) {
                    unsigned bits;
                    std::memcpy(&bits, &b.shared[i], sizeof(float));
                    shared_overrun |= bits != kGuardBits;
                }
            }
        }
    }
}

}  // namespace emu

#define SUBSPACE_HOST_EMULATION 1

namespace subspace {

template <int kBytes>
inline void cp_async(void* dst_shared, const void* src_global) {
    static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "cp.async copies 4, 8 or 16 bytes");
    if (reinterpret_cast<std::uintptr_t>(dst_shared) % kBytes || reinterpret_cast<std::uintptr_t>(src_global) % kBytes) {
        ++emu::copy_errors;
    }
    emu::copies.open.push_back(emu::PendingCopy{dst_shared, src_global, static_cast<std::size_t>(kBytes)});
}

inline void cp_async_commit() {
    emu::copies.committed.push_back(std::move(emu::copies.open));
    emu::copies.open.clear();
}

template <int kPending>
inline void cp_async_wait() {
    auto& groups = emu::copies.committed;
    while (groups.size() > static_cast<std::size_t>(kPending)) {
        for (const auto& c : groups.front()) {
            std::memcpy(c.dst, c.src, c.bytes);
        }
        groups.pop_front();
    }
}

}  // namespace subspace

#define threadIdx (emu::thread_idx)
#define blockIdx (emu::block_idx)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)

inline void __syncthreads() { emu::block->block_barrier->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::warp_barrier().arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
    float* slots = emu::block->exchange.data() + (emu::thread_idx.x / 32) * 32;
    const unsigned lane = emu::thread_idx.x % 32;
    slots[lane] = v;
    emu::warp_barrier().arrive_and_wait();
    const float out = slots[lane ^ static_cast<unsigned>(lane_mask)];
    emu::warp_barrier().arrive_and_wait();
    return out;
}
