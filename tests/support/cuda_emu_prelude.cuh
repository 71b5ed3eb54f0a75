// cuda_emu_prelude.cuh -- a small CPU SIMT emulator for the kernels_cuda sources.
// For the tests: never used by the runtime.  tests/support/cuda_emu.py compiles a
// .cu file with g++ and this prelude (-include), then launches kernels
// through ctypes.
//
// Model: the blocks of a grid run one after another; the threads of a block
// are cooperative fibers that switch only at __syncthreads and at
// warp-level operations (shuffles).  On x86-64 a fiber switch saves and loads
// the callee-saved registers and the FP control words only (glibc's
// swapcontext also makes a sigprocmask system call per switch, which took most
// of an emulated launch's time); elsewhere it is ucontext's.  Scheduling orders (`order` argument):
//   0 forward, 1 reverse, 2 random: passes over all READY fibers in that order
//     (warps advance nearly in lockstep);
//   3 greedy, 4 greedy_reverse: always resume the lowest- (highest-) numbered
//     READY thread, so one warp runs ahead until it blocks at __syncthreads
//     while the others have not started -- the adversarial case for a missing
//     barrier between a shared-memory write and a read by another warp.
// A missing __syncthreads therefore shows up as a wrong result (or a NaN from
// never-written shared memory) under some order.  Errors
// reported (the launch returns 1 and emu_error() says why):
//   * deadlock (some threads wait at a barrier the others never reach),
//   * __syncthreads reached from different source lines in one phase,
//   * __syncthreads or a shuffle after some threads of the block / lanes of
//     the warp have exited (undefined behaviour on the GPU),
//   * shuffles with a mask other than 0xffffffff or in a partial warp,
//   * writes past the dynamic shared memory size (guard bytes),
//   * invalid memory accesses (SIGSEGV / SIGBUS inside a kernel thread; the
//     Python side places every tensor argument right before a PROT_NONE page),
//   * invalid launch configurations.
// Dynamic shared memory is filled with 0xff bytes (float NaN) before each
// block, so reads of never-written shared memory surface as NaN.
// Atomics are trivially atomic (one OS thread, switches only at barriers).

#pragma once

#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>

#include <functional>
#include <string>
#include <vector>

#define MINIRUN_EMU 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __shared__ static

struct dim3 {
    unsigned int x, y, z;
};

namespace emu {

enum State { READY = 0, WAIT_BLOCK = 1, WAIT_WARP = 2, DONE = 3 };

// ---- fiber contexts ------------------------------------------------------------------------------
#if defined(__x86_64__)
struct FiberCtx {
    void* sp;
};

// Saves the callee-saved registers, MXCSR and the x87 control word on the current stack, stores the
// stack pointer in *save, then loads `load` (a stack saved here, or made by ctx_make) and returns
// there.
__attribute__((naked, noinline)) static void emu_switch(void** save, void* load) {
    asm volatile(
        "pushq %rbp\n\tpushq %rbx\n\tpushq %r12\n\tpushq %r13\n\tpushq %r14\n\tpushq %r15\n\t"
        "subq $16, %rsp\n\tstmxcsr 8(%rsp)\n\tfnstcw (%rsp)\n\t"
        "movq %rsp, (%rdi)\n\tmovq %rsi, %rsp\n\t"
        "fldcw (%rsp)\n\tldmxcsr 8(%rsp)\n\taddq $16, %rsp\n\t"
        "popq %r15\n\tpopq %r14\n\tpopq %r13\n\tpopq %r12\n\tpopq %rbx\n\tpopq %rbp\n\tret\n\t");
}

inline void ctx_switch(FiberCtx* save, FiberCtx* load) { emu_switch(&save->sp, load->sp); }

// A stack whose first switch enters `entry` as if called (rsp = 8 mod 16 there), with the
// scheduler's MXCSR and x87 control word.
inline void ctx_make(FiberCtx* c, char* stack, size_t size, void (*entry)()) {
    uintptr_t top = ((uintptr_t)(stack + size)) & ~(uintptr_t)15;
    void** sp = (void**)top;
    *--sp = nullptr;             // entry's return address: it never returns
    *--sp = (void*)entry;        // popped by emu_switch's ret
    for (int i = 0; i < 6; ++i) *--sp = nullptr;   // rbp rbx r12 r13 r14 r15
    sp -= 2;
    asm volatile("stmxcsr 8(%0)\n\tfnstcw (%0)" : : "r"(sp) : "memory");
    c->sp = sp;
}
#else
struct FiberCtx {
    ucontext_t uc;
};

inline void ctx_switch(FiberCtx* save, FiberCtx* load) { swapcontext(&save->uc, &load->uc); }

inline void ctx_make(FiberCtx* c, char* stack, size_t size, void (*entry)()) {
    getcontext(&c->uc);
    c->uc.uc_stack.ss_sp = stack;
    c->uc.uc_stack.ss_size = size;
    c->uc.uc_link = nullptr;     // entry switches back to the scheduler itself
    makecontext(&c->uc, entry, 0);
}
#endif

struct Fiber {
    FiberCtx ctx;
    int state;
    int linear;
    dim3 tid;
};

struct WarpSync {
    int nlanes;
    int arrived;
    int line;
    int exited;
    int parity;
    uint64_t buf[2][32];
};

static const size_t kStack = 128 * 1024;
static const size_t kSmemGuard = 256;

struct Ctx {
    std::vector<Fiber> fibers;
    std::vector<char*> stacks;
    std::vector<WarpSync> warps;
    FiberCtx sched;
    dim3 blockIdx, blockDim, gridDim;
    int nthreads = 0;
    int block_arrived = 0;
    int block_line = -1;
    int exited = 0;
    Fiber* cur = nullptr;
    std::string error;
    const std::function<void()>* body = nullptr;
    bool in_fiber = false;
    unsigned char* smem = nullptr;
    size_t smem_bytes = 0;
    unsigned rng = 1;
};

inline Ctx g;

[[noreturn]] inline void fail(const std::string& msg) {
    if (g.error.empty()) {
        char where[160];
        snprintf(where, sizeof where, " [block (%u,%u,%u) thread (%u,%u,%u)]", g.blockIdx.x, g.blockIdx.y,
                 g.blockIdx.z, g.cur ? g.cur->tid.x : 0u, g.cur ? g.cur->tid.y : 0u, g.cur ? g.cur->tid.z : 0u);
        g.error = msg + where;
    }
    g.cur->state = DONE;
    ctx_switch(&g.cur->ctx, &g.sched);
    abort();  // never resumed
}

inline void block_barrier(int line) {
    if (g.exited > 0) {
        char b[160];
        snprintf(b, sizeof b, "__syncthreads (line %d) after %d thread(s) of the block exited", line, g.exited);
        fail(b);
    }
    if (g.block_arrived == 0) {
        g.block_line = line;
    } else if (g.block_line != line) {
        char b[160];
        snprintf(b, sizeof b, "divergent __syncthreads: line %d while others wait at line %d", line, g.block_line);
        fail(b);
    }
    if (++g.block_arrived == g.nthreads) {
        g.block_arrived = 0;
        for (int i = 0; i < g.nthreads; ++i)
            if (g.fibers[i].state == WAIT_BLOCK) g.fibers[i].state = READY;
        return;
    }
    g.cur->state = WAIT_BLOCK;
    ctx_switch(&g.cur->ctx, &g.sched);
}

inline WarpSync& warp_of_cur(unsigned mask, int line) {
    WarpSync& ws = g.warps[g.cur->linear / 32];
    char b[160];
    if (mask != 0xffffffffu) {
        snprintf(b, sizeof b, "warp op (line %d) with mask 0x%08x (only full masks are used here)", line, mask);
        fail(b);
    }
    if (ws.nlanes != 32) {
        snprintf(b, sizeof b, "warp op (line %d) in a partial warp of %d lanes", line, ws.nlanes);
        fail(b);
    }
    if (ws.exited) {
        snprintf(b, sizeof b, "warp op (line %d) after %d lane(s) exited", line, ws.exited);
        fail(b);
    }
    return ws;
}

inline void warp_barrier(WarpSync& ws, int line) {
    if (ws.arrived == 0) {
        ws.line = line;
    } else if (ws.line != line) {
        char b[160];
        snprintf(b, sizeof b, "divergent warp op: line %d while other lanes wait at line %d", line, ws.line);
        fail(b);
    }
    if (++ws.arrived == 32) {
        ws.arrived = 0;
        ws.parity ^= 1;
        const int w0 = (g.cur->linear / 32) * 32;
        for (int i = w0; i < w0 + 32; ++i)
            if (g.fibers[i].state == WAIT_WARP) g.fibers[i].state = READY;
        return;
    }
    g.cur->state = WAIT_WARP;
    ctx_switch(&g.cur->ctx, &g.sched);
}

template <class T>
inline T shfl(unsigned mask, T v, int kind, int arg, int line) {
    static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
    WarpSync& ws = warp_of_cur(mask, line);
    const int lane = g.cur->linear % 32;
    // Double buffering: the buffer written by shuffle k+2 cannot be the one a
    // slow lane still reads for shuffle k (everyone passed barrier k+1).
    const int p = ws.parity;
    uint64_t bits = 0;
    memcpy(&bits, &v, sizeof(T));
    ws.buf[p][lane] = bits;
    warp_barrier(ws, line);
    int src = lane;
    if (kind == 0) src = lane ^ arg;
    else if (kind == 1) src = (lane - arg >= 0) ? lane - arg : lane;
    else if (kind == 2) src = (lane + arg < 32) ? lane + arg : lane;
    else src = arg & 31;
    if (src < 0 || src > 31) src = lane;
    T r;
    memcpy(&r, &ws.buf[p][src], sizeof(T));
    return r;
}

inline unsigned ballot(unsigned mask, int pred, int line) {
    WarpSync& ws = warp_of_cur(mask, line);
    const int lane = g.cur->linear % 32;
    const int p = ws.parity;
    ws.buf[p][lane] = pred ? 1u : 0u;
    warp_barrier(ws, line);
    unsigned r = 0;
    for (int i = 0; i < 32; ++i)
        if (ws.buf[p][i]) r |= 1u << i;
    return r;
}

// __match_any_sync: the lanes holding the same value as this one; __syncwarp: a warp barrier.
inline unsigned match_any(unsigned mask, unsigned v, int line) {
    WarpSync& ws = warp_of_cur(mask, line);
    const int lane = g.cur->linear % 32;
    const int p = ws.parity;
    ws.buf[p][lane] = v;
    warp_barrier(ws, line);
    unsigned r = 0;
    for (int i = 0; i < 32; ++i)
        if (ws.buf[p][i] == v) r |= 1u << i;
    return r;
}

inline void syncwarp(int line) {
    WarpSync& ws = warp_of_cur(0xffffffffu, line);
    warp_barrier(ws, line);
}

// A fault inside a kernel thread ends the launch with an error (the fault is
// synchronous and in our own code, so leaving the handler with a switch to the
// scheduler is safe in practice; the signal, blocked while its handler runs, is
// unblocked first, or the next fault would kill the process).
inline void on_fault(int sig, siginfo_t* si, void*) {
    if (!g.in_fiber || g.cur == nullptr) {
        signal(sig, SIG_DFL);
        raise(sig);
        return;
    }
    if (g.error.empty()) {
        char b[200];
        snprintf(b, sizeof b, "invalid memory access at %p (signal %d) [block (%u,%u,%u) thread (%u,%u,%u)]",
                 si->si_addr, sig, g.blockIdx.x, g.blockIdx.y, g.blockIdx.z, g.cur->tid.x, g.cur->tid.y,
                 g.cur->tid.z);
        g.error = b;
    }
    g.cur->state = DONE;
    g.in_fiber = false;
    sigset_t faults;
    sigemptyset(&faults);
    sigaddset(&faults, SIGSEGV);
    sigaddset(&faults, SIGBUS);
    sigprocmask(SIG_UNBLOCK, &faults, nullptr);
    FiberCtx dead;   // (this fiber is never resumed)
    ctx_switch(&dead, &g.sched);
}

inline void fiber_main() {
    (*g.body)();
    Fiber* f = g.cur;
    g.exited++;
    g.warps[f->linear / 32].exited++;
    if (g.block_arrived > 0) {
        char b[160];
        snprintf(b, sizeof b, "thread exited while %d thread(s) wait at __syncthreads (line %d)", g.block_arrived,
                 g.block_line);
        fail(b);
    }
    if (g.warps[f->linear / 32].arrived > 0) fail("lane exited while other lanes wait in a warp op");
    f->state = DONE;
    ctx_switch(&f->ctx, &g.sched);   // never resumed
    abort();
}

inline unsigned next_rand() {
    g.rng = g.rng * 1103515245u + 12345u;
    return g.rng >> 8;
}

inline int run_block(int order) {
    const int n = g.nthreads;
    const unsigned bx = g.blockDim.x, by = g.blockDim.y;
    for (int i = 0; i < n; ++i) {
        Fiber& f = g.fibers[i];
        f.state = READY;
        f.linear = i;
        f.tid.x = i % bx;
        f.tid.y = (i / bx) % by;
        f.tid.z = i / (bx * by);
        ctx_make(&f.ctx, g.stacks[i], kStack, fiber_main);
    }
    const int nw = (n + 31) / 32;
    g.warps.assign(nw, WarpSync{});
    for (int w = 0; w < nw; ++w) g.warps[w].nlanes = (n - w * 32) < 32 ? (n - w * 32) : 32;
    g.block_arrived = 0;
    g.block_line = -1;
    g.exited = 0;
    if (g.smem) memset(g.smem, 0xff, g.smem_bytes + kSmemGuard);
    std::vector<int> perm(n);
    for (int i = 0; i < n; ++i) perm[i] = (order == 1 || order == 4) ? n - 1 - i : i;
    for (;;) {
        if (order == 2)
            for (int i = n - 1; i > 0; --i) {
                const int j = (int)(next_rand() % (unsigned)(i + 1));
                const int t = perm[i];
                perm[i] = perm[j];
                perm[j] = t;
            }
        bool ran = false;
        int done = 0;
        for (int k = 0; k < n; ++k) {
            Fiber& f = g.fibers[perm[k]];
            if (f.state == READY) {
                g.cur = &f;
                g.in_fiber = true;
                ctx_switch(&g.sched, &f.ctx);
                g.in_fiber = false;
                ran = true;
                if (!g.error.empty()) return 1;
                if (order >= 3) break;  // greedy: rescan from the highest-priority thread
            }
        }
        int wb = 0, ww = 0;
        for (int i = 0; i < n; ++i) {
            const Fiber& f = g.fibers[i];
            if (f.state == DONE) ++done;
            else if (f.state == WAIT_BLOCK) ++wb;
            else if (f.state == WAIT_WARP) ++ww;
        }
        if (done == n) break;
        if (!ran) {
            char b[200];
            snprintf(b, sizeof b,
                     "deadlock in block (%u,%u,%u): %d thread(s) at __syncthreads (line %d), %d in warp ops, %d exited",
                     g.blockIdx.x, g.blockIdx.y, g.blockIdx.z, wb, g.block_line, ww, done);
            g.error = b;
            return 1;
        }
    }
    if (g.smem) {
        for (size_t i = 0; i < kSmemGuard; ++i)
            if (g.smem[g.smem_bytes + i] != 0xff) {
                char b[160];
                snprintf(b, sizeof b, "write past the %zu bytes of dynamic shared memory in block (%u,%u,%u)",
                         g.smem_bytes, g.blockIdx.x, g.blockIdx.y, g.blockIdx.z);
                g.error = b;
                return 1;
            }
    }
    return 0;
}

inline int launch(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                  unsigned long long smem_bytes, int order, unsigned seed, const std::function<void()>& body) {
    g.error.clear();
    g.cur = nullptr;
    const unsigned long long nt = (unsigned long long)bx * by * bz;
    if (nt == 0 || nt > 1024 || bz > 64) {
        g.error = "invalid block dimensions";
        return 1;
    }
    if (gx == 0 || gy == 0 || gz == 0 || gx > 2147483647u || gy > 65535u || gz > 65535u) {
        char b[120];
        snprintf(b, sizeof b, "invalid grid (%u, %u, %u)", gx, gy, gz);
        g.error = b;
        return 1;
    }
    if (smem_bytes > 227ull * 1024) {
        g.error = "dynamic shared memory above 227 KiB";
        return 1;
    }
    g.nthreads = (int)nt;
    g.blockDim = dim3{bx, by, bz};
    g.gridDim = dim3{gx, gy, gz};
    g.body = &body;
    g.rng = seed * 2654435761u + 1u;
    if (g.fibers.size() < nt) g.fibers.resize(nt);
    while (g.stacks.size() < nt) g.stacks.push_back((char*)malloc(kStack));
    g.smem_bytes = (size_t)smem_bytes;
    g.smem = (unsigned char*)aligned_alloc(128, ((g.smem_bytes + kSmemGuard + 127) / 128) * 128);
    struct sigaction sa, old_segv, old_bus;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &old_segv);
    sigaction(SIGBUS, &sa, &old_bus);
    int rc = 0;
    for (unsigned z = 0; z < gz && !rc; ++z)
        for (unsigned y = 0; y < gy && !rc; ++y)
            for (unsigned x = 0; x < gx && !rc; ++x) {
                g.blockIdx = dim3{x, y, z};
                rc = run_block(order);
            }
    sigaction(SIGSEGV, &old_segv, nullptr);
    sigaction(SIGBUS, &old_bus, nullptr);
    free(g.smem);
    g.smem = nullptr;
    return rc;
}

}  // namespace emu

#define threadIdx (emu::g.cur->tid)
#define blockIdx (emu::g.blockIdx)
#define blockDim (emu::g.blockDim)
#define gridDim (emu::g.gridDim)

#define MR_DYN_SMEM(name) float* name = reinterpret_cast<float*>(emu::g.smem)
#define __syncthreads() emu::block_barrier(__LINE__)
#define __shfl_xor_sync(m, v, o) emu::shfl((m), (v), 0, (o), __LINE__)
#define __shfl_up_sync(m, v, o) emu::shfl((m), (v), 1, (o), __LINE__)
#define __shfl_down_sync(m, v, o) emu::shfl((m), (v), 2, (o), __LINE__)
#define __shfl_sync(m, v, o) emu::shfl((m), (v), 3, (o), __LINE__)
#define __ballot_sync(m, p) emu::ballot((m), (p), __LINE__)
#define __match_any_sync(m, v) emu::match_any((m), (unsigned)(v), __LINE__)
#define __syncwarp(...) emu::syncwarp(__LINE__)

inline float __int_as_float(int i) {
    float f;
    memcpy(&f, &i, 4);
    return f;
}
inline int __float_as_int(float f) {
    int i;
    memcpy(&i, &f, 4);
    return i;
}
inline float __uint_as_float(unsigned int u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    memcpy(&u, &f, 4);
    return u;
}
inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }

inline float atomicAdd(float* p, float v) {
    const float o = *p;
    *p = o + v;
    return o;
}
inline int atomicAdd(int* p, int v) {
    const int o = *p;
    *p = o + v;
    return o;
}
inline unsigned int atomicAdd(unsigned int* p, unsigned int v) {
    const unsigned int o = *p;
    *p = o + v;
    return o;
}
inline int atomicMin(int* p, int v) {
    const int o = *p;
    if (v < o) *p = v;
    return o;
}
inline int atomicMax(int* p, int v) {
    const int o = *p;
    if (v > o) *p = v;
    return o;
}

// IEEE binary16 bits -> float32 (exact).
inline float emu_half_to_float(unsigned short h) {
    const unsigned sign = (h >> 15) & 1u, ex = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    float f;
    if (ex == 0) f = ldexpf((float)mant, -24);
    else if (ex == 31) f = mant ? __uint_as_float(0x7fc00000u) : __uint_as_float(0x7f800000u);
    else f = ldexpf((float)(mant | 0x400u), (int)ex - 25);
    return sign ? -f : f;
}
