// A CUDA launch emulated on the CPU (backends/cuda/emulator.py): the generated kernel's source is
// compiled as C++ after this header. A block at a time; its threads are OS threads; __syncthreads and
// __syncwarp are barriers of the block's and the warp's threads; a shuffle is a write of each lane's
// value to its warp's slots, a barrier, a read, a barrier. __shared__ arrays are function statics:
// one block runs at a time, so they are the block's. A thread that returns leaves its barriers
// (`arrive_and_drop`), as exited threads leave bar.sync. Only the kernels' float and double paths
// (no half types); the sm_80 / sm_90 inline assembly stays behind __CUDA_ARCH__, undefined here.
// For tests at tiny sizes: every barrier wakes every thread of the block.
#include <math.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <bit>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

struct ssmc_dim3 { unsigned x = 1, y = 1, z = 1; };

namespace ssmc_emu {
inline thread_local ssmc_dim3 thread_idx, block_idx;
inline ssmc_dim3 block_dim, grid_dim;
struct Warp {
    std::unique_ptr<std::barrier<>> bar;
    unsigned long long slot[32];
};
inline std::barrier<>* block_bar = nullptr;
inline Warp* warps = nullptr;

inline Warp& warp() { return warps[thread_idx.x / 32]; }

// every lane's `v` to the warp's slots; returns lane `src`'s where `valid`, else `v`
template <class T> T exchange(T v, int src, bool valid) {
    static_assert(sizeof(T) <= 8, "a shuffle moves at most 8 bytes");
    Warp& w = warp();
    unsigned long long bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    w.slot[thread_idx.x % 32] = bits;
    w.bar->arrive_and_wait();
    T out = v;
    if (valid) std::memcpy(&out, &w.slot[src], sizeof(T));
    w.bar->arrive_and_wait();  // no lane writes the slots again before every lane has read them
    return out;
}

// One block's barriers and its count of finished threads, held by its threads and the launch loop (its
// threads, detached, keep it where the block does not finish in time: they still wait on its barriers).
struct Block {
    std::barrier<> bar;
    std::vector<Warp> warps;
    std::mutex mutex;
    std::condition_variable all_done;
    unsigned done = 0;
    Block(unsigned threads, unsigned count) : bar((std::ptrdiff_t)threads), warps(count) {}
};

// A thread of the block, started where the machine lets it: another process's threads (test workers
// side by side under a limit on processes and threads) may hold the last ones a while; false where
// none could be started within `timeout` seconds.
template <class Body> bool start(Body&& body, double timeout) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout);
    for (;;) {
        try {
            std::thread(body).detach();
            return true;
        } catch (const std::system_error&) {
            if (std::chrono::steady_clock::now() > until) return false;
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
    }
}

// `kernel()` run by `block` threads in each of `grid` blocks, a block at a time; the index of the
// first block not finished within `timeout` seconds (its threads wait on a barrier that not all
// of them reach: a kernel bug, or a divergence the emulator cannot follow), -2 - that index where
// its threads could not be started (no thread left), else -1. The block is shared by its threads
// and this loop: freed by the last of them (a thread may still be leaving its lock when the loop
// sees the count complete).
template <class Kernel> long run(unsigned grid, unsigned block, double timeout, Kernel&& kernel) {
    block_dim = {block, 1, 1};
    grid_dim = {grid, 1, 1};
    const unsigned count = (block + 31) / 32;
    for (unsigned b = 0; b < grid; ++b) {
        auto blk = std::make_shared<Block>(block, count);
        for (unsigned w = 0; w < count; ++w)
            blk->warps[w].bar = std::make_unique<std::barrier<>>((std::ptrdiff_t)std::min(32u, block - 32 * w));
        block_bar = &blk->bar;
        warps = blk->warps.data();
        for (unsigned t = 0; t < block; ++t) {
            const bool started = start([&kernel, blk, t, b] {
                thread_idx = {t, 1, 1};
                block_idx = {b, 1, 1};
                kernel();
                blk->warps[t / 32].bar->arrive_and_drop();
                blk->bar.arrive_and_drop();
                std::lock_guard<std::mutex> lock(blk->mutex);
                ++blk->done;
                blk->all_done.notify_one();
            }, timeout);
            if (!started) return -2 - (long)b;  // the threads started wait on its barriers: `blk` stays
        }
        std::unique_lock<std::mutex> lock(blk->mutex);
        const bool finished = blk->all_done.wait_for(lock, std::chrono::duration<double>(timeout),
                                                     [&] { return blk->done == block; });
        if (!finished) return (long)b;  // its threads hold `blk`
    }
    return -1;
}
}  // namespace ssmc_emu

#define threadIdx ssmc_emu::thread_idx
#define blockIdx ssmc_emu::block_idx
#define blockDim ssmc_emu::block_dim
#define gridDim ssmc_emu::grid_dim
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

inline void __syncthreads() { ssmc_emu::block_bar->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { ssmc_emu::warp().bar->arrive_and_wait(); }
// one block runs at a time: a fence orders this thread's writes before its later ones (atomics)
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }

// lanes in segments of `width` (a power of two), as CUDA's shuffles
template <class T> T __shfl_sync(unsigned, T v, int src, int width = 32) {
    const int lane = (int)(threadIdx.x % 32);
    return ssmc_emu::exchange(v, (lane & ~(width - 1)) + (src & (width - 1)), true);
}
template <class T> T __shfl_up_sync(unsigned, T v, unsigned delta, int width = 32) {
    const int lane = (int)(threadIdx.x % 32);
    return ssmc_emu::exchange(v, lane - (int)delta, (lane & (width - 1)) >= (int)delta);
}
template <class T> T __shfl_down_sync(unsigned, T v, unsigned delta, int width = 32) {
    const int lane = (int)(threadIdx.x % 32);
    return ssmc_emu::exchange(v, lane + (int)delta, (lane & (width - 1)) + (int)delta < width);
}
template <class T> T __shfl_xor_sync(unsigned, T v, int mask, int width = 32) {
    const int lane = (int)(threadIdx.x % 32);
    const int src = lane ^ mask;
    return ssmc_emu::exchange(v, src, (src & ~(width - 1)) == (lane & ~(width - 1)));
}
inline unsigned __ballot_sync(unsigned, int predicate) {
    unsigned bits = 0;
    for (int lane = 0; lane < 32; ++lane) {  // every lane reads every slot: one exchange per lane
        const int p = ssmc_emu::exchange(predicate ? 1 : 0, lane, true);
        bits |= (unsigned)(p != 0) << lane;
    }
    return bits;
}
inline int __popc(unsigned x) { return std::popcount(x); }

template <class T> T atomicAdd(T* p, T v) { return std::atomic_ref<T>(*p).fetch_add(v); }

inline float __fdividef(float a, float b) { return a / b; }
inline float __expf(float x) { return expf(x); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __int_as_float(int x) { return std::bit_cast<float>(x); }
inline int __float_as_int(float x) { return std::bit_cast<int>(x); }
inline unsigned __float_as_uint(float x) { return std::bit_cast<unsigned>(x); }
inline float __uint_as_float(unsigned x) { return std::bit_cast<float>(x); }
inline int __float2int_rn(float x) { return (int)nearbyintf(x); }  // the default rounding: to nearest even

// CUDA's min / max overloads for the integer types the kernels index with
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }

struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
