// The CPU executor of the CUDA kernels ("cuda-sim"): grids of blocks of threads, barriers, warp exchanges,
// shared memory, and the checks (bounds, shared-memory races, warp divergence).
//
// Design. One launch runs its blocks one after another on the calling OS thread (in grid order, or reversed
// or shuffled with the thread order, see below). The threads of a block
// are cooperative fibers, each on its own small stack (with a guard page), switched by a hand-written
// x86-64 context switch (the six callee-saved registers and the stack pointer; the floating-point control
// state is one for all fibers, and kernel code never changes it); other architectures use ucontext, which
// is correct but makes a system call per switch. A fiber runs
// until it reaches a synchronisation point (__syncthreads, a warp operation) or ends; the scheduler then
// runs the next runnable fiber in its current order (forward, reverse, or a seeded shuffle drawn anew at
// every pass, i.e. at every barrier), so each thread's code between two synchronisation points runs
// without interruption and the orders of those segments vary between runs.
//   * __syncthreads completes when every thread of the block has arrived at the same call (the site is the
//     return address into the kernel); a thread that ends, or waits at another site, while others wait is
//     a divergence error.
//   * A warp operation (shuffle, ballot, __syncwarp) completes when every lane named by its mask has
//     arrived at the same call; the exchange then happens in lock step: each lane reads the value its source
//     lane deposited. A named lane that ended, waits at a barrier or at another call is a divergence error.
//   * Shared memory is the kernel library's thread-local segment (cuda_sim.h), poisoned at every block
//     start with a byte chosen by the caller (runs with different poison make reads of unwritten shared
//     memory visible as differing outputs).
//
// Memory checks. The kernel library is compiled with -fsanitize=thread: every load and store the compiler
// could not prove local calls __tsan_readN / __tsan_writeN (defined here) with the address. The address is
// classified: the running fiber's stack (ignored); shared memory (the static array it falls in, or the
// dynamic array, bounded by this launch's dynamic size; then the race check); a buffer of the launch (the
// arrays passed as arguments: the access must lie inside one). Anything else is an out-of-bounds access,
// reported against the nearest argument with its element index. The device allocates every array with
// red zones around it, so an access just past an argument lands in no other argument.
// Races: a shadow record per shared byte holds the last writer and up to two readers with the barrier
// generation and warp epoch of their access; two accesses of one generation by different threads, one a
// write, not ordered by a warp synchronisation of their common warp, are a race. In global memory the
// bytes a launch writes are recorded (global_race): another block touching them, or another thread of the
// block without a barrier between, is a race.
//
// The first error stops the launch: the fiber that found it is abandoned before the access happens (kernel
// code holds no resources), and dg_sim_launch returns 1 with the message in dg_sim_last_error().

#include <dlfcn.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <mutex>
#include <string>
#include <vector>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

struct uint3 { unsigned int x, y, z; };
struct dim3 { unsigned int x, y, z; };

extern "C" {
struct DgBuffer {
    uint64_t lo;        // address of the argument's first byte
    uint64_t size;      // bytes
    int itemsize;       // bytes per element
    const char* name;   // parameter name
};
struct DgShared {
    uint64_t offset;    // in the thread-local segment
    uint64_t size;      // bytes (capacity for a dynamic array)
    int dynamic;        // 1: an extern __shared__ array (bounded by the launch's dynamic size)
    const char* name;
};
struct DgLaunchDesc {
    const char* kernel;
    void (*tramp)(void**);
    void** argv;
    unsigned grid[3];
    unsigned block[3];
    uint64_t dynamic_shared;            // bytes of this launch
    unsigned char* (*anchor)(void);     // address of shared[anchor_index] for this OS thread
    int anchor_index;
    const DgShared* shared;
    int n_shared;
    uint64_t tls_size;                  // bytes of the library's thread-local segment
    const DgBuffer* buffers;
    int n_buffers;
    int checks;                         // bit 0 bounds, bit 1 races, bit 2 divergence
    int schedule;                       // 0 forward, 1 reverse, 2 seeded shuffle
    uint64_t seed;
    int poison;                         // byte value written into shared memory at each block start
    uint64_t lib_base;                  // load address of the kernel library (for call sites)
};
}

namespace {

enum State { RUNNABLE = 0, AT_BARRIER = 1, AT_WARP = 2, EXITED = 3 };
const char* const kWarpNames[] = {"__shfl_sync", "__shfl_up_sync", "__shfl_down_sync", "__shfl_xor_sync",
                                  "__ballot_sync", "__any_sync", "__all_sync", "__syncwarp"};
const size_t kStack = 128 * 1024;

struct Fiber {
    void* sp = nullptr;
    char* stack_lo = nullptr;           // usable stack (above the guard page)
    size_t stack_size = 0;
    int state = EXITED;
    int lin = 0;                        // linear thread index
    uint3 tid{0, 0, 0};
    void* site = nullptr;               // call site of the pending barrier / warp operation
    int wkind = 0, wsize = 0, warg = 0, wwidth = 32;
    unsigned wmask = 0;
    uint64_t wbits = 0, wresult = 0;
#if !defined(__x86_64__)
    ucontext_t ctx;
#endif
};

struct Shadow {                         // one byte of shared memory
    uint32_t wgen, rgen;
    uint32_t wwe, r1we, r2we;
    uint16_t wtid, r1, r2;
};
const uint16_t kNone = 0xffff;

std::mutex g_mutex;
std::string g_error;
const DgLaunchDesc* g_desc = nullptr;
std::vector<Fiber> g_fibers;
std::vector<uint32_t> g_warp_epoch;
std::vector<int> g_warp_arrived;         // lanes of each warp waiting at a warp operation
std::vector<Shadow> g_shadow;
std::vector<uint8_t> g_owner;            // per byte of the shared segment: index of its shared array, or 255
const DgShared* g_owner_table = nullptr;
Fiber* g_cur = nullptr;
void* g_sched_sp = nullptr;
#if !defined(__x86_64__)
ucontext_t g_sched_ctx;
#endif
bool g_abort = false;
uint3 g_block{0, 0, 0};
int g_nthreads = 0, g_arrived = 0, g_exited = 0;
void* g_barrier_site = nullptr;
uint32_t g_gen = 1;
uintptr_t g_sh_lo = 0, g_sh_size = 0;
int g_last_buffer = 0;

}  // namespace

// ------------------------------------------------------------------------------------------------ switching
#if defined(__x86_64__)
extern "C" void dg_sim_switch(void** save_sp, void* new_sp);
asm(R"(
.text
.p2align 4
.globl dg_sim_switch
.hidden dg_sim_switch
.type dg_sim_switch,@function
dg_sim_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
.size dg_sim_switch, .-dg_sim_switch
)");
#endif

namespace {

void fiber_entry();

void to_scheduler(Fiber* f) {
#if defined(__x86_64__)
    dg_sim_switch(&f->sp, g_sched_sp);
#else
    swapcontext(&f->ctx, &g_sched_ctx);
#endif
}

void run_fiber(Fiber* f) {
    g_cur = f;
#if defined(__x86_64__)
    dg_sim_switch(&g_sched_sp, f->sp);
#else
    swapcontext(&g_sched_ctx, &f->ctx);
#endif
    g_cur = nullptr;
}

void start_fiber(Fiber* f) {
    if (!f->stack_lo) {
        const size_t page = (size_t)sysconf(_SC_PAGESIZE);
        void* mem = mmap(nullptr, kStack + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (mem == MAP_FAILED) abort();
        mprotect(mem, page, PROT_NONE);  // guard page below the stack
        f->stack_lo = (char*)mem + page;
        f->stack_size = kStack;
    }
#if defined(__x86_64__)
    uintptr_t top = ((uintptr_t)(f->stack_lo + f->stack_size)) & ~(uintptr_t)15;
    uint64_t* sp = (uint64_t*)(top - 16);
    sp[0] = (uint64_t)(uintptr_t)&fiber_entry;  // popped by `ret`: rsp is then 8 mod 16, as after a call
    sp[1] = 0;
    sp -= 6;                                     // rbp rbx r12 r13 r14 r15, zero
    memset(sp, 0, 6 * sizeof(uint64_t));
    f->sp = sp;
#else
    getcontext(&f->ctx);
    f->ctx.uc_stack.ss_sp = f->stack_lo;
    f->ctx.uc_stack.ss_size = f->stack_size;
    f->ctx.uc_link = nullptr;
    makecontext(&f->ctx, (void (*)())fiber_entry, 0);
#endif
    f->state = RUNNABLE;
}

// ------------------------------------------------------------------------------------------------ messages
std::string fmt(const char* format, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, format);
    vsnprintf(buf, sizeof buf, format, ap);
    va_end(ap);
    return buf;
}

std::string dims(uint3 v) { return fmt("(%u, %u, %u)", v.x, v.y, v.z); }

std::string site(void* address) {
    uintptr_t a = (uintptr_t)address;
    return g_desc && a >= g_desc->lib_base ? fmt("{site:0x%lx}", (unsigned long)(a - g_desc->lib_base))
                                           : fmt("{addr:0x%lx}", (unsigned long)a);
}

std::string who(const Fiber* f) { return fmt("block %s thread %s", dims(g_block).c_str(), dims(f->tid).c_str()); }

std::string lanes(const std::vector<int>& list) {  // "0-15, 17"
    std::string out;
    for (size_t i = 0; i < list.size();) {
        size_t j = i;
        while (j + 1 < list.size() && list[j + 1] == list[j] + 1) ++j;
        if (!out.empty()) out += ", ";
        out += j == i ? fmt("%d", list[i]) : fmt("%d-%d", list[i], list[j]);
        i = j + 1;
    }
    return out.empty() ? "none" : out;
}

const char* state_name(const Fiber& f) {
    switch (f.state) {
        case AT_BARRIER: return "waits at __syncthreads";
        case AT_WARP: return "waits at another warp operation";
        case EXITED: return "has ended";
        default: return "runs";
    }
}

// Record the first error and leave the fiber for good (it is never resumed).
[[noreturn]] void fail(Fiber* f, const std::string& kind, const std::string& message) {
    if (!g_abort) {
        g_abort = true;
        g_error = kind + ": " + g_desc->kernel + ": " + message;
    }
    to_scheduler(f);
    abort();  // not reached
}

void fail_outside(const std::string& kind, const std::string& message) {  // from the scheduler
    if (!g_abort) {
        g_abort = true;
        g_error = kind + ": " + g_desc->kernel + ": " + message;
    }
}

// ------------------------------------------------------------------------------------------------ memory
inline bool ordered(uint16_t other, uint32_t other_epoch, const Fiber* f) {
    // same warp, and that warp synchronised since the other access
    return (other >> 5) == (f->lin >> 5) && other_epoch < g_warp_epoch[f->lin >> 5];
}

std::string tname(uint16_t t) {
    const unsigned bx = g_desc->block[0], by = g_desc->block[1];
    return dims(uint3{t % bx, (t / bx) % by, t / (bx * by)});
}

const DgShared* shared_var(uintptr_t off, unsigned n, const DgShared** nearest) {
    const uint8_t owner = g_owner[off];
    if (owner != 255 && g_owner[off + n - 1] == owner) return &g_desc->shared[owner];
    const DgShared* best = nullptr;
    uint64_t best_d = UINT64_MAX;
    for (int i = 0; i < g_desc->n_shared; ++i) {
        const DgShared& s = g_desc->shared[i];
        uint64_t d = off < s.offset ? s.offset - off : off - (s.offset + s.size) + 1;
        if (d < best_d) { best_d = d; best = &s; }
    }
    *nearest = best;
    return nullptr;
}

void shared_access(Fiber* f, uintptr_t p, unsigned n, bool write, void* at) {
    const uintptr_t off = p - g_sh_lo;
    const int checks = g_desc->checks;
    if (checks & 1) {
        const DgShared* near = nullptr;
        const DgShared* s = shared_var(off, n, &near);
        if (!s) {
            fail(f, "bounds", fmt("%s of %u bytes at shared offset %lu, outside every shared array (nearest: %s, "
                                  "%ld bytes from its start); %s %s", write ? "write" : "read", n,
                                  (unsigned long)off, near ? near->name : "none",
                                  near ? (long)(off - near->offset) : 0L, who(f).c_str(), site(at).c_str()));
        }
        if (s->dynamic && off + n > s->offset + g_desc->dynamic_shared) {
            fail(f, "bounds", fmt("%s of %u bytes at byte %lu of the dynamic shared array %s, but the launch gave "
                                  "it %lu bytes; %s %s", write ? "write" : "read", n, (unsigned long)(off - s->offset),
                                  s->name, (unsigned long)g_desc->dynamic_shared, who(f).c_str(), site(at).c_str()));
        }
    }
    if (!(checks & 2)) return;
    const uint16_t t = (uint16_t)f->lin;
    const uint32_t we = g_warp_epoch[f->lin >> 5];
    for (unsigned i = 0; i < n; ++i) {
        Shadow& sh = g_shadow[off + i];
        const char* other_kind = nullptr;
        uint16_t other = kNone;
        if (sh.wgen == g_gen && sh.wtid != t && !ordered(sh.wtid, sh.wwe, f)) {
            other_kind = "wrote";
            other = sh.wtid;
        } else if (write && sh.rgen == g_gen) {
            if (sh.r1 != t && sh.r1 != kNone && !ordered(sh.r1, sh.r1we, f)) { other_kind = "read"; other = sh.r1; }
            else if (sh.r2 != t && sh.r2 != kNone && !ordered(sh.r2, sh.r2we, f)) { other_kind = "read"; other = sh.r2; }
        }
        if (other_kind) {
            const DgShared* near = nullptr;
            const DgShared* s = shared_var(off + i, 1, &near);
            if (!s) s = near;
            fail(f, "race", fmt("shared-memory race on %s byte %lu: thread %s %s it and thread %s %s it with no "
                                "__syncthreads between (block %s) %s", s ? s->name : "?",
                                (unsigned long)(off + i - (s ? s->offset : 0)), tname(other).c_str(), other_kind,
                                dims(f->tid).c_str(), write ? "wrote" : "read", dims(g_block).c_str(),
                                site(at).c_str()));
        }
        if (write) {
            sh.wgen = g_gen; sh.wtid = t; sh.wwe = we;
        } else if (sh.rgen != g_gen) {
            sh.rgen = g_gen; sh.r1 = t; sh.r1we = we; sh.r2 = kNone;
        } else if (sh.r1 == t) {
            sh.r1we = we;
        } else if (sh.r2 == kNone || sh.r2 == t) {
            sh.r2 = t; sh.r2we = we;
        }
    }
}

// Global memory: a hash table of the bytes this launch wrote (address -> block, thread, barrier generation,
// warp epoch). A byte written by one block and read or written by another is a race (blocks of one launch
// are not ordered); within a block the shared-memory rule applies (a barrier or a warp synchronisation
// must separate the two threads' accesses). Reads of bytes nobody wrote in this launch are not recorded,
// so a read followed by another thread's write is not seen here (the schedule check covers it).
struct GlobalEntry {
    uint64_t addr;
    uint32_t stamp, block, gen, we;
    uint16_t tid;
};
std::vector<GlobalEntry> g_global;
uint64_t g_global_used = 0;
uint32_t g_stamp = 0;
uint32_t g_block_serial = 0;

inline uint64_t mix(uint64_t a) {
    a ^= a >> 33; a *= 0xff51afd7ed558ccdull; a ^= a >> 33;
    return a;
}

GlobalEntry* global_slot(uint64_t addr, bool insert) {
    if (insert && (g_global.empty() || g_global_used * 2 >= g_global.size())) {
        std::vector<GlobalEntry> old;
        old.swap(g_global);
        g_global.assign(old.empty() ? (1u << 16) : old.size() * 2, GlobalEntry{0, 0, 0, 0, 0, 0});
        g_global_used = 0;
        for (const GlobalEntry& e : old)
            if (e.stamp == g_stamp) { *global_slot(e.addr, true) = e; ++g_global_used; }
    }
    if (g_global.empty()) return nullptr;
    const uint64_t mask = g_global.size() - 1;
    for (uint64_t i = mix(addr) & mask;; i = (i + 1) & mask) {
        GlobalEntry& e = g_global[i];
        if (e.stamp != g_stamp) return insert ? &e : nullptr;
        if (e.addr == addr) return &e;
    }
}

void global_race(Fiber* f, uintptr_t p, unsigned n, bool write, void* at, const DgBuffer& buf) {
    const uint16_t t = (uint16_t)f->lin;
    const uint32_t we = g_warp_epoch[f->lin >> 5];
    for (unsigned i = 0; i < n; ++i) {
        GlobalEntry* e = global_slot(p + i, false);
        if (e) {
            const bool other_block = e->block != g_block_serial;
            if (other_block || (e->gen == g_gen && e->tid != t && !ordered(e->tid, e->we, f))) {
                const long long index = (long long)(p + i - buf.lo) / buf.itemsize;
                const unsigned gx = g_desc->grid[0], gy = g_desc->grid[1];
                const uint3 ob{e->block % gx, (e->block / gx) % gy, e->block / (gx * gy)};
                fail(f, "race", fmt("global-memory race on argument %s index %lld: block %s thread %s wrote it and "
                                    "%s thread %s %s it%s %s", buf.name, index, dims(ob).c_str(), tname(e->tid).c_str(),
                                    other_block ? ("block " + dims(g_block)).c_str() : "its",
                                    dims(f->tid).c_str(), write ? "wrote" : "read",
                                    other_block ? " (the blocks of a launch are not ordered)"
                                                : " with no __syncthreads between",
                                    site(at).c_str()));
            }
        }
        if (write) {
            if (!e) { e = global_slot(p + i, true); ++g_global_used; }
            *e = GlobalEntry{p + i, g_stamp, g_block_serial, g_gen, we, t};
        }
    }
}

void access(uintptr_t p, unsigned n, bool write, void* at) {
    Fiber* f = g_cur;
    if (!f || g_abort) return;
    if (p - (uintptr_t)f->stack_lo < f->stack_size) return;
    if (p - g_sh_lo < g_sh_size) {
        shared_access(f, p, n, write, at);
        return;
    }
    if (!(g_desc->checks & 1)) return;
    const int nb = g_desc->n_buffers;
    const DgBuffer* b = g_desc->buffers;
    if (nb) {
        const DgBuffer& last = b[g_last_buffer];
        if (p - last.lo < last.size && p + n - last.lo <= last.size) {
            if (g_desc->checks & 2) global_race(f, p, n, write, at, last);
            return;
        }
        for (int i = 0; i < nb; ++i)
            if (p - b[i].lo < b[i].size && p + n - b[i].lo <= b[i].size) {
                g_last_buffer = i;
                if (g_desc->checks & 2) global_race(f, p, n, write, at, b[i]);
                return;
            }
    }
    // out of bounds: report against the nearest argument
    const DgBuffer* near = nullptr;
    uint64_t best = UINT64_MAX;
    for (int i = 0; i < nb; ++i) {
        uint64_t d = p < b[i].lo ? b[i].lo - p : p - (b[i].lo + b[i].size) + 1;
        if (d < best) { best = d; near = &b[i]; }
    }
    if (p < 65536) {
        fail(f, "bounds", fmt("%s of %u bytes through a NULL pointer (address %lu); %s %s", write ? "write" : "read",
                              n, (unsigned long)p, who(f).c_str(), site(at).c_str()));
    }
    if (!near) fail(f, "bounds", fmt("%s of %u bytes at an address of no argument; %s %s",
                                     write ? "write" : "read", n, who(f).c_str(), site(at).c_str()));
    const long long byte = (long long)(p - near->lo);
    const long long index = byte >= 0 ? byte / near->itemsize : -((-byte + near->itemsize - 1) / near->itemsize);
    fail(f, "bounds", fmt("%s of %u bytes outside argument %s: index %lld of %llu elements (byte offset %lld); %s %s",
                          write ? "write" : "read", n, near->name, index,
                          (unsigned long long)(near->size / near->itemsize), byte, who(f).c_str(), site(at).c_str()));
}

// ------------------------------------------------------------------------------------------------ sync
void release_barrier() {
    for (int i = 0; i < g_nthreads; ++i)
        if (g_fibers[i].state == AT_BARRIER) g_fibers[i].state = RUNNABLE;
    g_arrived = 0;
    g_barrier_site = nullptr;
    ++g_gen;
}

void check_barrier_complete(Fiber* f) {
    if (g_arrived == 0 || g_arrived + g_exited < g_nthreads) return;
    if (g_exited > 0 && (g_desc->checks & 4)) {
        std::vector<int> ended, waiting;
        for (int i = 0; i < g_nthreads; ++i) (g_fibers[i].state == EXITED ? ended : waiting).push_back(i);
        std::string msg = fmt("warp divergence: __syncthreads %s reached by threads %s of block %s, but threads %s "
                              "ended without reaching it", site(g_barrier_site).c_str(), lanes(waiting).c_str(),
                              dims(g_block).c_str(), lanes(ended).c_str());
        if (f) fail(f, "divergence", msg);
        fail_outside("divergence", msg);
        return;
    }
    release_barrier();
}

// a thread waits at a barrier or a warp operation, or ended: can the warp operations of its warp still finish?
void check_warp(Fiber* f) {
    const int w = f->lin >> 5, base = w << 5;
    if (g_warp_arrived[w] == 0) return;  // no lane of this warp waits at a warp operation
    const int end = base + 32 < g_nthreads ? base + 32 : g_nthreads;
    for (int i = base; i < end; ++i) {
        Fiber& g = g_fibers[i];
        if (g.state != AT_WARP) continue;
        const int lane = f->lin - base;
        if (!(g.wmask >> lane & 1u) || &g == f) continue;
        // g waits for f (named in its mask), and f is not at g's call
        if (f->state == AT_WARP && f->site == g.site && f->wkind == g.wkind) continue;
        if (!(g_desc->checks & 4)) continue;
        std::vector<int> arrived, missing;
        for (int j = base; j < end; ++j) {
            if (!(g.wmask >> (j - base) & 1u)) continue;
            const Fiber& h = g_fibers[j];
            (h.state == AT_WARP && h.site == g.site ? arrived : missing).push_back(j - base);
        }
        fail(f, "divergence", fmt("warp divergence: %s %s in block %s, warp %d: lanes %s arrived, but lane %d %s "
                                  "(lanes not there: %s)", kWarpNames[g.wkind], site(g.site).c_str(),
                                  dims(g_block).c_str(), w, lanes(arrived).c_str(), lane,
                                  f->state == EXITED ? "has ended"
                                  : f->state == AT_BARRIER ? "waits at __syncthreads"
                                                           : fmt("is at another call %s", site(f->site).c_str()).c_str(),
                                  lanes(missing).c_str()));
    }
}

void try_complete_warp(Fiber* f) {
    const int w = f->lin >> 5, base = w << 5;
    const int end = base + 32 < g_nthreads ? base + 32 : g_nthreads;
    const unsigned mask = f->wmask;
    const bool check = g_desc->checks & 4;
    // fast path: not every named lane can be here yet (the full scan below runs once per operation)
    if (++g_warp_arrived[w] < (mask == 0xffffffffu ? 32 : __builtin_popcount(mask))) return;
    if (check) {
        if (!(mask >> (f->lin - base) & 1u))
            fail(f, "divergence", fmt("%s: the mask 0x%08x does not name the calling lane %d; %s %s",
                                      kWarpNames[f->wkind], mask, f->lin - base, who(f).c_str(), site(f->site).c_str()));
        if (end - base < 32 && (mask >> (end - base)))
            fail(f, "divergence", fmt("%s: the mask 0x%08x names lanes beyond the block's %d threads; %s %s",
                                      kWarpNames[f->wkind], mask, g_nthreads, who(f).c_str(), site(f->site).c_str()));
        if (f->wwidth < 1 || f->wwidth > 32 || (f->wwidth & (f->wwidth - 1)))
            fail(f, "divergence", fmt("%s: width %d is not a power of two <= 32; %s", kWarpNames[f->wkind], f->wwidth,
                                      who(f).c_str()));
    }
    for (int i = base; i < end; ++i) {
        if (!(mask >> (i - base) & 1u)) continue;
        const Fiber& g = g_fibers[i];
        if (g.state == RUNNABLE) return;  // not there yet
        if (g.state != AT_WARP || g.site != f->site || g.wkind != f->wkind || g.wmask != mask) {
            if (!check) return;
            std::vector<int> arrived, missing;
            for (int j = base; j < end; ++j) {
                if (!(mask >> (j - base) & 1u)) continue;
                const Fiber& h = g_fibers[j];
                (h.state == AT_WARP && h.site == f->site ? arrived : missing).push_back(j - base);
            }
            fail(f, "divergence", fmt("warp divergence: %s %s in block %s, warp %d: lanes %s arrived, but lane %d %s "
                                      "(lanes not there: %s)", kWarpNames[f->wkind], site(f->site).c_str(),
                                      dims(g_block).c_str(), w, lanes(arrived).c_str(), i - base,
                                      g.state == AT_WARP ? fmt("is at another call %s", site(g.site).c_str()).c_str()
                                                         : state_name(g),
                                      lanes(missing).c_str()));
        }
    }
    // everyone named is here: exchange in lock step
    uint64_t ballot = 0;
    for (int i = base; i < end; ++i)
        if (mask >> (i - base) & 1u) ballot |= (uint64_t)(g_fibers[i].wbits != 0) << (i - base);
    for (int i = base; i < end; ++i) {
        if (!(mask >> (i - base) & 1u)) continue;
        Fiber& g = g_fibers[i];
        const int lane = i - base, width = g.wwidth, seg = lane & ~(width - 1);
        int src = lane;
        switch (g.wkind) {
            case 0: src = seg + (g.warg & (width - 1)); break;
            case 1: src = lane - g.warg; if (src < seg) src = lane; break;
            case 2: src = lane + g.warg; if (src >= seg + width) src = lane; break;
            case 3: src = lane ^ g.warg; if (src < seg || src >= seg + width) src = lane; break;
            default: break;
        }
        if (g.wkind <= 3) {
            if (check && (src < 0 || src >= end - base || !(mask >> src & 1u)))
                fail(f, "divergence", fmt("%s: lane %d reads lane %d, which is not named by the mask 0x%08x "
                                          "(block %s, warp %d) %s", kWarpNames[g.wkind], lane, src, mask,
                                          dims(g_block).c_str(), w, site(g.site).c_str()));
            g.wresult = g_fibers[base + src].wbits;
        } else if (g.wkind == 4) {
            g.wresult = ballot;
        } else if (g.wkind == 5) {
            g.wresult = ballot != 0;
        } else if (g.wkind == 6) {
            g.wresult = ballot == (uint64_t)mask;
        } else {
            g.wresult = 0;
        }
    }
    for (int i = base; i < end; ++i)
        if (mask >> (i - base) & 1u) g_fibers[i].state = RUNNABLE;
    g_warp_arrived[w] -= mask == 0xffffffffu ? 32 : __builtin_popcount(mask);
    ++g_warp_epoch[w];
}

void on_exit(Fiber* f) {
    ++g_exited;
    check_warp(f);
    check_barrier_complete(f);
}

void fiber_entry() {
    g_desc->tramp(g_desc->argv);
    Fiber* f = g_cur;
    f->state = EXITED;
    on_exit(f);
    to_scheduler(f);
    abort();  // an ended fiber is never resumed
}

uint64_t splitmix(uint64_t& s) {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

bool run_block(const DgLaunchDesc* d, uint64_t block_serial) {
    const int n = g_nthreads;
    for (int i = 0; i < n; ++i) {
        Fiber& f = g_fibers[i];
        f.lin = i;
        f.tid = uint3{i % d->block[0], (i / d->block[0]) % d->block[1], i / (d->block[0] * d->block[1])};
        f.site = nullptr;
        start_fiber(&f);
    }
    for (auto& e : g_warp_epoch) e = 0;
    for (auto& e : g_warp_arrived) e = 0;
    g_arrived = g_exited = 0;
    g_barrier_site = nullptr;
    ++g_gen;
    // poison the block's shared memory (static arrays, and the part of the dynamic one this launch uses)
    for (int i = 0; i < d->n_shared; ++i) {
        const DgShared& s = d->shared[i];
        memset((void*)(g_sh_lo + s.offset), d->poison, s.dynamic ? (d->dynamic_shared < s.size ? d->dynamic_shared : s.size)
                                                                  : s.size);
    }
    std::vector<int> order(n);
    uint64_t rng = d->seed * 0x2545f4914f6cdd1dull + block_serial;
    while (true) {
        for (int i = 0; i < n; ++i) order[i] = d->schedule == 1 ? n - 1 - i : i;
        if (d->schedule == 2)
            for (int i = n - 1; i > 0; --i) {
                int j = (int)(splitmix(rng) % (uint64_t)(i + 1));
                int t = order[i]; order[i] = order[j]; order[j] = t;
            }
        bool ran = false;
        for (int k = 0; k < n; ++k) {
            Fiber* f = &g_fibers[order[k]];
            if (f->state != RUNNABLE) continue;
            run_fiber(f);
            ran = true;
            if (g_abort) return false;
        }
        if (g_exited == n) return true;
        if (!ran) {  // nothing can run and not all ended: a deadlock the eager checks did not name
            std::vector<int> barrier, warp, ended;
            for (int i = 0; i < n; ++i)
                (g_fibers[i].state == AT_BARRIER ? barrier : g_fibers[i].state == AT_WARP ? warp : ended).push_back(i);
            fail_outside("divergence", fmt("deadlock in block %s: threads %s wait at __syncthreads, threads %s at warp "
                                           "operations, threads %s ended", dims(g_block).c_str(), lanes(barrier).c_str(),
                                           lanes(warp).c_str(), lanes(ended).c_str()));
            return false;
        }
    }
}

}  // namespace

// ------------------------------------------------------------------------------------------------ kernel side
#ifndef DG_SIM_RUNTIME_HASH
#define DG_SIM_RUNTIME_HASH "unknown"
#endif
extern "C" {
__attribute__((visibility("default"))) uint3 dg_sim_thread_idx(void) { return g_cur ? g_cur->tid : uint3{0, 0, 0}; }
__attribute__((visibility("default"))) uint3 dg_sim_block_idx(void) { return g_block; }
__attribute__((visibility("default"))) dim3 dg_sim_block_dim(void) {
    return dim3{g_desc->block[0], g_desc->block[1], g_desc->block[2]};
}
__attribute__((visibility("default"))) dim3 dg_sim_grid_dim(void) {
    return dim3{g_desc->grid[0], g_desc->grid[1], g_desc->grid[2]};
}

__attribute__((visibility("default"))) void dg_sim_syncthreads(void) {
    Fiber* f = g_cur;
    void* at = __builtin_return_address(0);
    if (g_barrier_site && at != g_barrier_site && (g_desc->checks & 4)) {
        std::vector<int> waiting;
        for (int i = 0; i < g_nthreads; ++i)
            if (g_fibers[i].state == AT_BARRIER) waiting.push_back(i);
        fail(f, "divergence", fmt("warp divergence: threads %s of block %s wait at __syncthreads %s, but thread %s "
                                  "reached another __syncthreads %s", lanes(waiting).c_str(), dims(g_block).c_str(),
                                  site(g_barrier_site).c_str(), dims(f->tid).c_str(), site(at).c_str()));
    }
    if (!g_barrier_site) g_barrier_site = at;
    f->state = AT_BARRIER;
    f->site = at;
    ++g_arrived;
    check_warp(f);
    check_barrier_complete(f);
    to_scheduler(f);
}

__attribute__((visibility("default"))) uint64_t dg_sim_warp_op(int kind, unsigned mask, uint64_t bits, int size,
                                                              int arg, int width) {
    Fiber* f = g_cur;
    f->state = AT_WARP;
    f->site = __builtin_return_address(0);
    f->wkind = kind; f->wmask = mask; f->wbits = bits; f->wsize = size; f->warg = arg; f->wwidth = width;
    try_complete_warp(f);
    to_scheduler(f);
    return f->wresult;
}

__attribute__((visibility("default"))) uint64_t dg_sim_atomic(int op, int type, void* address, uint64_t value,
                                                             uint64_t compare) {
    const unsigned size = type == 2 || type == 4 ? 8 : 4;
    Fiber* f = g_cur;
    const int checks = g_desc->checks;
    const_cast<DgLaunchDesc*>(g_desc)->checks = checks & ~2;  // atomics do not race with each other
    access((uintptr_t)address, size, true, __builtin_return_address(0));
    const_cast<DgLaunchDesc*>(g_desc)->checks = checks;
    (void)f;
    uint64_t old = 0;
    memcpy(&old, address, size);
    uint64_t out = old;
    auto apply = [&](auto a, auto v) -> decltype(a) {
        switch (op) {
            case 0: return a + v;
            case 1: return a > v ? a : v;
            case 2: return a < v ? a : v;
            default: return v;
        }
    };
    switch (type) {
        case 0: { int32_t a, v; memcpy(&a, &old, 4); memcpy(&v, &value, 4); a = apply(a, v); memcpy(&out, &a, 4); break; }
        case 1: { uint32_t a, v; memcpy(&a, &old, 4); memcpy(&v, &value, 4); a = apply(a, v); memcpy(&out, &a, 4); break; }
        case 2: { uint64_t a = old, v = value; out = apply(a, v); break; }
        case 3: { float a, v; memcpy(&a, &old, 4); memcpy(&v, &value, 4); a = apply(a, v); memcpy(&out, &a, 4); break; }
        default: { double a, v; memcpy(&a, &old, 8); memcpy(&v, &value, 8); a = apply(a, v); memcpy(&out, &a, 8); break; }
    }
    if (op == 4) out = (memcmp(&old, &compare, size) == 0) ? value : old;
    memcpy(address, &out, size);
    return old;
}

// The compiler's instrumentation calls (-fsanitize=thread), answered by the checks above.
#define DG_HOOKS(n)                                                                                              \
    __attribute__((visibility("default"))) void __tsan_read##n(void* p) {                                       \
        access((uintptr_t)p, n, false, __builtin_return_address(0));                                             \
    }                                                                                                            \
    __attribute__((visibility("default"))) void __tsan_write##n(void* p) {                                      \
        access((uintptr_t)p, n, true, __builtin_return_address(0));                                              \
    }                                                                                                            \
    __attribute__((visibility("default"))) void __tsan_unaligned_read##n(void* p) {                             \
        access((uintptr_t)p, n, false, __builtin_return_address(0));                                             \
    }                                                                                                            \
    __attribute__((visibility("default"))) void __tsan_unaligned_write##n(void* p) {                            \
        access((uintptr_t)p, n, true, __builtin_return_address(0));                                              \
    }
DG_HOOKS(1)
DG_HOOKS(2)
DG_HOOKS(4)
DG_HOOKS(8)
DG_HOOKS(16)
__attribute__((visibility("default"))) void __tsan_read_range(void* p, unsigned long n) {
    access((uintptr_t)p, (unsigned)n, false, __builtin_return_address(0));
}
__attribute__((visibility("default"))) void __tsan_write_range(void* p, unsigned long n) {
    access((uintptr_t)p, (unsigned)n, true, __builtin_return_address(0));
}
__attribute__((visibility("default"))) void __tsan_func_entry(void*) {}
__attribute__((visibility("default"))) void __tsan_func_exit(void) {}
__attribute__((visibility("default"))) void __tsan_init(void) {}
__attribute__((visibility("default"))) void __tsan_vptr_update(void*, void*) {}
__attribute__((visibility("default"))) void __tsan_vptr_read(void*) {}

// ------------------------------------------------------------------------------------------------ host side
__attribute__((visibility("default"))) extern const char dg_sim_runtime_hash[] = DG_SIM_RUNTIME_HASH;
__attribute__((visibility("default"))) const char* dg_sim_last_error(void) { return g_error.c_str(); }

// Load address of the shared library that holds `symbol` (call sites are reported relative to it).
__attribute__((visibility("default"))) uint64_t dg_sim_library_base(void* symbol) {
    Dl_info info;
    return dladdr(symbol, &info) ? (uint64_t)(uintptr_t)info.dli_fbase : 0;
}

__attribute__((visibility("default"))) int dg_sim_launch(const DgLaunchDesc* d) {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_error.clear();
    g_abort = false;
    g_desc = d;
    g_last_buffer = 0;
    g_nthreads = (int)(d->block[0] * d->block[1] * d->block[2]);
    if (++g_stamp == 0) {  // stamp wrap: forget the global table
        g_global.clear();
        g_stamp = 1;
    }
    g_global_used = 0;
    if ((int)g_fibers.size() < g_nthreads) g_fibers.resize(g_nthreads);
    g_warp_epoch.assign((g_nthreads + 31) / 32, 0);
    g_warp_arrived.assign((g_nthreads + 31) / 32, 0);
    unsigned char* anchor = d->anchor();
    g_sh_lo = (uintptr_t)anchor - d->shared[d->anchor_index].offset;
    g_sh_size = d->tls_size;
    if (g_shadow.size() < g_sh_size) g_shadow.assign(g_sh_size, Shadow{0, 0, 0, 0, 0, kNone, kNone, kNone});
    if (g_owner_table != d->shared || g_owner.size() != g_sh_size + 16) {  // a new library: its layout
        g_owner.assign(g_sh_size + 16, 255);
        for (int i = 0; i < d->n_shared && i < 255; ++i)
            memset(&g_owner[d->shared[i].offset], i, d->shared[i].size);
        g_owner_table = d->shared;
    }
    // blocks run one after another, in the schedule's order too (forward, reverse, or shuffled), so that an
    // output that depends on the order of the blocks differs between the runs of a checked launch
    const uint64_t gx = d->grid[0], gy = d->grid[1], n_blocks = gx * gy * d->grid[2];
    std::vector<uint64_t> blocks(n_blocks);
    for (uint64_t i = 0; i < n_blocks; ++i) blocks[i] = d->schedule == 1 ? n_blocks - 1 - i : i;
    if (d->schedule == 2) {
        uint64_t rng = d->seed ^ 0x5851f42d4c957f2dull;
        for (uint64_t i = n_blocks; i > 1; --i) {
            const uint64_t j = splitmix(rng) % i;
            const uint64_t t = blocks[i - 1]; blocks[i - 1] = blocks[j]; blocks[j] = t;
        }
    }
    bool ok = true;
    for (uint64_t k = 0; k < n_blocks && ok; ++k) {
        const uint64_t b = blocks[k];
        g_block = uint3{(unsigned)(b % gx), (unsigned)((b / gx) % gy), (unsigned)(b / (gx * gy))};
        g_block_serial = (uint32_t)b;
        ok = run_block(d, b);
        if (g_gen > 0xf0000000u) {  // generation wrap: forget the shadow
            g_gen = 1;
            for (auto& s : g_shadow) s = Shadow{0, 0, 0, 0, 0, kNone, kNone, kNone};
        }
    }
    g_cur = nullptr;
    g_desc = nullptr;
    return ok ? 0 : 1;
}
}
