// A CUDA launch emulated on the CPU (backends/cuda/emulator.py): the generated kernel's source is
// compiled as C++ after this header. A block at a time; its threads are fibers (ucontext) on the
// calling OS thread, switched at __syncthreads, __syncwarp and the shuffles, which are barriers of the
// block's and the warp's threads; a shuffle is a write of each lane's value to its warp's slots, a
// barrier, a read, a barrier. One OS thread, whatever the block's width: no limit on processes or
// threads to meet, no data races, the same interleaving every run. __shared__ arrays are function
// statics: one block runs at a time, so they are the block's. A thread that returns leaves its
// barriers, as exited threads leave bar.sync. Only the kernels' float and double paths (no half
// types); the sm_80 / sm_90 inline assembly stays behind __CUDA_ARCH__, undefined here.
#if defined(__APPLE__) && !defined(_XOPEN_SOURCE)
#define _XOPEN_SOURCE 600  // macOS declares ucontext only for X/Open
#endif
#include <math.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

struct ssmc_dim3 { unsigned x = 1, y = 1, z = 1; };

namespace ssmc_emu {
// per OS thread: two Python threads may each run a launch
inline thread_local ssmc_dim3 thread_idx, block_idx, block_dim, grid_dim;

// Each emulated thread's stack: mapped once per OS thread and width, reused by every block and launch.
// Pages are committed as touched; a guard page below each one turns an overflow into a fault, not a
// write into the next thread's stack.
constexpr size_t STACK_BYTES = size_t(1) << 20;

struct Stacks {
    char* base = nullptr;
    size_t count = 0, stride = 0;
    char* get(unsigned threads) {
        if (threads > count) {
            release();
            stride = STACK_BYTES + (size_t)sysconf(_SC_PAGESIZE);
            void* p = mmap(nullptr, stride * threads, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (p == MAP_FAILED) return nullptr;
            base = (char*)p;
            count = threads;
            for (unsigned t = 0; t < threads; ++t) mprotect(base + t * stride, stride - STACK_BYTES, PROT_NONE);
        }
        return base;
    }
    char* stack(unsigned t) const { return base + t * stride + (stride - STACK_BYTES); }
    void release() {
        if (base) munmap(base, stride * count);
        base = nullptr;
        count = 0;
    }
    ~Stacks() { release(); }
};
inline thread_local Stacks stacks;

enum State : unsigned char { READY, AT_BLOCK, AT_WARP, AT_NAMED, DONE };
constexpr unsigned NAMED_BARRIERS = 16;  // bar.sync's ids

// a thread in yield_now, and what it polls for
struct Poll {
    bool on = false;
    bool (*ready)(const void*, int) = nullptr;
    const void* what = nullptr;
    int arg = 0;
};

// One block's threads and barriers. A barrier's last arrival releases the others and goes on; a
// thread that waits switches to the next ready thread, or back to the launch loop where none is
// (every thread left waits at a barrier that not all of them reach: the block is stuck).
struct Block {
    ucontext_t loop;
    std::vector<ucontext_t> ctx;
    std::vector<State> state;
    std::vector<unsigned> warp_live, warp_waiting;
    std::vector<unsigned> named_waiting, named_of;  // arrivals a named barrier; the id a thread waits at
    std::vector<Poll> polling;  // threads in yield_now
    std::vector<unsigned long long> slots;  // a shuffle's values, 32 a warp
    unsigned current = 0, live = 0, at_block = 0, done = 0;
    void (*call)(void*) = nullptr;
    void* kernel = nullptr;
    std::chrono::steady_clock::time_point until;
    unsigned long switches = 0;
    bool late = false;  // past the block's time: unwinding to the launch loop
};
inline thread_local Block* block = nullptr;

inline void release(State waiting, unsigned first, unsigned last) {
    for (unsigned t = first; t < last; ++t)
        if (block->state[t] == waiting) block->state[t] = READY;
}

// from thread `current` (waiting or done) to the next ready thread, else to the launch loop
inline void switch_away() {
    Block& b = *block;
    const unsigned n = (unsigned)b.ctx.size(), from = b.current;
    // a kernel that loops through barriers forever would never come back: its time is checked now and then
    if ((++b.switches & 4095) == 0 && std::chrono::steady_clock::now() > b.until) b.late = true;
    for (unsigned i = 1; i <= n && !b.late; ++i) {
        const unsigned t = (from + i) % n;
        if (b.state[t] == READY) {
            b.current = t;
            thread_idx = {t, 1, 1};
            swapcontext(&b.ctx[from], &b.ctx[t]);
            return;
        }
    }
    swapcontext(&b.ctx[from], &b.loop);  // stuck: never resumed
}

inline void wait_block() {
    Block& b = *block;
    if (++b.at_block == b.live) {
        b.at_block = 0;
        release(AT_BLOCK, 0, (unsigned)b.ctx.size());
        return;
    }
    b.state[b.current] = AT_BLOCK;
    switch_away();
}

// bar.sync `id`, `count`: a barrier of the first `count` threads to arrive (the others of the block go on)
inline void wait_named(unsigned id, unsigned count) {
    Block& b = *block;
    if (++b.named_waiting[id] == count) {
        b.named_waiting[id] = 0;
        for (unsigned t = 0; t < (unsigned)b.ctx.size(); ++t)
            if (b.state[t] == AT_NAMED && b.named_of[t] == id) b.state[t] = READY;
        return;
    }
    b.state[b.current] = AT_NAMED;
    b.named_of[b.current] = id;
    switch_away();
}

// a thread that polls (an mbarrier's phase) lets the others run; where none of them can (every other thread
// done or at a barrier), nothing it polls can change: the block is stuck. `ready(what, arg)`, where given, says
// whether what it polls for has come (`others_run` asks it)
using Ready = bool (*)(const void*, int);
inline void yield_now(Ready ready = nullptr, const void* what = nullptr, int arg = 0) {
    Block& b = *block;
    const unsigned me = b.current;
    for (unsigned t = 0; t < (unsigned)b.ctx.size(); ++t) {
        if (t != me && b.state[t] == READY) {
            b.polling[me] = {true, ready, what, arg};
            switch_away();
            b.polling[me].on = false;
            return;
        }
    }
    b.late = true;
    swapcontext(&b.ctx[me], &b.loop);  // stuck: never resumed
}

// whether a thread other than this one could run on (ready, and not polling for what has not come)
inline bool others_run() {
    Block& b = *block;
    for (unsigned t = 0; t < (unsigned)b.ctx.size(); ++t) {
        if (t == b.current || b.state[t] != READY) continue;
        const Poll& p = b.polling[t];
        if (!p.on || (p.ready != nullptr && p.ready(p.what, p.arg))) return true;
    }
    return false;
}

// this thread waits until every other thread has run as far as it can (to a barrier, a poll or its end): the
// slowest schedule the hardware may pick, for a kernel to put where another thread's missing wait would show
inline void lag() {
    while (others_run()) yield_now();
}

inline void wait_warp() {
    Block& b = *block;
    const unsigned w = b.current / 32;
    if (++b.warp_waiting[w] == b.warp_live[w]) {
        b.warp_waiting[w] = 0;
        release(AT_WARP, 32 * w, std::min(32 * w + 32, (unsigned)b.ctx.size()));
        return;
    }
    b.state[b.current] = AT_WARP;
    switch_away();
}

// a thread's whole life: the kernel, then it leaves its barriers (completing them where the others
// all wait) and gives the OS thread to the next
inline void thread_main() {
    Block& b = *block;
    b.call(b.kernel);
    const unsigned t = b.current, w = t / 32;
    b.state[t] = DONE;
    ++b.done;
    --b.live;
    --b.warp_live[w];
    if (b.at_block && b.at_block == b.live) {
        b.at_block = 0;
        release(AT_BLOCK, 0, (unsigned)b.ctx.size());
    }
    if (b.warp_waiting[w] && b.warp_waiting[w] == b.warp_live[w]) {
        b.warp_waiting[w] = 0;
        release(AT_WARP, 32 * w, std::min(32 * w + 32, (unsigned)b.ctx.size()));
    }
    switch_away();
}

// What `thread_local` is to a real thread, for the emulated ones (the fibers share their OS thread's):
// a T per thread of the block, value-initialised when it first asks within a block.
inline thread_local unsigned long block_serial = 0;  // one more at each block's start

template <class T> class PerThread {
    std::vector<std::pair<unsigned long, T>> slots_;

  public:
    T& get() {
        if (slots_.size() < block_dim.x) slots_.resize(block_dim.x);
        auto& slot = slots_[thread_idx.x];
        if (slot.first != block_serial) slot = {block_serial, T{}};
        return slot.second;
    }
    T* operator->() { return &get(); }
    T& operator*() { return get(); }
};

// every lane's `v` to the warp's slots; returns lane `src`'s where `valid`, else `v`
template <class T> T exchange(T v, int src, bool valid) {
    static_assert(sizeof(T) <= 8, "a shuffle moves at most 8 bytes");
    unsigned long long* slot = block->slots.data() + 32 * (thread_idx.x / 32);
    unsigned long long bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    slot[thread_idx.x % 32] = bits;
    wait_warp();
    T out = v;
    if (valid) std::memcpy(&out, &slot[src], sizeof(T));
    wait_warp();  // no lane writes the slots again before every lane has read them
    return out;
}

// `kernel()` run by `threads` threads in each of `grid` blocks, a block at a time; the index of the
// first block that did not finish (its threads wait at barriers not all of them reach, or it ran past
// `timeout` seconds), -2 where the threads' stacks could not be mapped, else -1. A stuck block's
// threads are abandoned where they wait (their stacks are reused by the next launch).
template <class Kernel> long run(unsigned grid, unsigned threads, double timeout, Kernel&& kernel) {
    block_dim = {threads, 1, 1};
    grid_dim = {grid, 1, 1};
    if (!stacks.get(threads)) return -2;
    Block b;
    b.ctx.resize(threads);
    b.state.resize(threads);
    b.warp_live.resize((threads + 31) / 32);
    b.warp_waiting.resize(b.warp_live.size());
    b.slots.resize(32 * b.warp_live.size());
    b.named_of.resize(threads);
    b.polling.resize(threads);
    b.call = [](void* k) { (*static_cast<std::remove_reference_t<Kernel>*>(k))(); };
    b.kernel = (void*)&kernel;
    Block* outer = block;
    block = &b;
    long stuck = -1;
    for (unsigned g = 0; g < grid && stuck < 0; ++g) {
        block_idx = {g, 1, 1};
        ++block_serial;
        b.current = b.at_block = b.done = 0;
        b.live = threads;
        b.late = false;
        b.until = std::chrono::steady_clock::now() +
                  std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(timeout));
        b.named_waiting.assign(NAMED_BARRIERS, 0);
        std::fill(b.polling.begin(), b.polling.end(), Poll{});
        for (unsigned w = 0; w < b.warp_live.size(); ++w) {
            b.warp_live[w] = std::min(32u, threads - 32 * w);
            b.warp_waiting[w] = 0;
        }
        for (unsigned t = 0; t < threads; ++t) {
            getcontext(&b.ctx[t]);
            b.ctx[t].uc_stack.ss_sp = stacks.stack(t);
            b.ctx[t].uc_stack.ss_size = STACK_BYTES;
            b.ctx[t].uc_link = nullptr;
            makecontext(&b.ctx[t], thread_main, 0);
            b.state[t] = READY;
        }
        thread_idx = {0, 1, 1};
        swapcontext(&b.loop, &b.ctx[0]);
        if (b.done != threads) stuck = (long)g;
    }
    block = outer;
    return stuck;
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

inline void __syncthreads() { ssmc_emu::wait_block(); }
inline void __syncwarp(unsigned = 0xffffffffu) { ssmc_emu::wait_warp(); }
// one OS thread runs the block: a fence orders nothing the fibers could see out of order
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
