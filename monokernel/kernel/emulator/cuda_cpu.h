// cuda_cpu.h: runs an unchanged CUDA source file on the CPU.
//
// g++ force-includes this header before the .cu file (see build.py). What it provides:
//   - one OS thread per CUDA block, all started together, so blocks that spin-wait on each
//     other's global-memory counters always make progress;
//   - the block's CUDA threads as fibers on that OS thread (hand-written x86-64 context switch,
//     ucontext elsewhere), scheduled round-robin in threadIdx order, so runs are deterministic;
//   - __shared__ as `static thread_local` (the block's OS thread owns it);
//   - __syncthreads as a generation barrier, warp collectives through a per-warp exchange buffer;
//   - errors instead of hangs: divergent barriers, warp lanes that never arrive, deadlocks inside a
//     block, trap/assert, and a host timeout that unwinds every fiber at its next yield point.
// Device-only code (inline PTX) stays behind `#ifdef __CUDA_ARCH__`, which g++ never defines.
#pragma once
#ifdef __CUDA_ARCH__
#error "cuda_cpu.h is the CPU emulator's shim; nvcc and NVRTC must not see it"
#endif

// Every standard header a kernel might include comes first: the qualifier macros below
// (__noinline__ in particular) would otherwise break libstdc++ headers included later.
#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cassert>
#include <cfloat>
#include <chrono>
#include <climits>
#include <cmath>
#include <condition_variable>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define EMU_ASAN 1
#endif
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#define MONOKERNEL_EMULATOR 1

// ===================================================================================== qualifiers
#define __global__
#define __device__
#define __host__
#define __constant__
#define __managed__
#define __grid_constant__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#ifdef EMU_STRICT
// Strict mode gives each CUDA thread its own OS thread, so thread_local storage cannot be the
// block's: strict.py rewrites every `__shared__ T name[dims];` into EMU_SHARED(T, name, [dims])
// (cuda_cpu_strict.h). One left over is an error, not silently per-thread memory.
#define __shared__ _Pragma("GCC error \"__shared__ needs strict.py's EMU_SHARED rewrite in EMU_STRICT builds\"")
#else
#define __shared__ static thread_local
#endif
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))

// ================================================================================= vector types
#define EMU_VEC2(T, N, A)                                   \
  struct __attribute__((aligned(A))) N { T x, y; };         \
  inline N make_##N(T x, T y) { return N{x, y}; }
#define EMU_VEC3(T, N)                                      \
  struct N { T x, y, z; };                                  \
  inline N make_##N(T x, T y, T z) { return N{x, y, z}; }
#define EMU_VEC4(T, N, A)                                   \
  struct __attribute__((aligned(A))) N { T x, y, z, w; };   \
  inline N make_##N(T x, T y, T z, T w) { return N{x, y, z, w}; }

EMU_VEC2(int, int2, 8)
EMU_VEC3(int, int3)
EMU_VEC4(int, int4, 16)
EMU_VEC2(unsigned int, uint2, 8)
EMU_VEC3(unsigned int, uint3)
EMU_VEC4(unsigned int, uint4, 16)
EMU_VEC2(float, float2, 8)
EMU_VEC3(float, float3)
EMU_VEC4(float, float4, 16)
EMU_VEC2(double, double2, 16)
EMU_VEC2(short, short2, 4)
EMU_VEC4(short, short4, 8)
EMU_VEC2(unsigned short, ushort2, 4)
EMU_VEC4(unsigned short, ushort4, 8)
EMU_VEC4(signed char, char4, 4)
EMU_VEC4(unsigned char, uchar4, 4)
EMU_VEC2(long long, longlong2, 16)
EMU_VEC2(unsigned long long, ulonglong2, 16)
#undef EMU_VEC2
#undef EMU_VEC3
#undef EMU_VEC4

struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
  constexpr operator uint3() const { return uint3{x, y, z}; }
};

constexpr int warpSize = 32;

#include "cuda_cpu_common.h"

// ================================================================================== intrinsics
inline unsigned int __float_as_uint(float f) { return std::bit_cast<unsigned int>(f); }
inline float __uint_as_float(unsigned int u) { return std::bit_cast<float>(u); }
inline int __float_as_int(float f) { return std::bit_cast<int>(f); }
inline float __int_as_float(int i) { return std::bit_cast<float>(i); }
inline long long __double_as_longlong(double d) { return std::bit_cast<long long>(d); }
inline double __longlong_as_double(long long i) { return std::bit_cast<double>(i); }

inline float __expf(float x) { return expf(x); }
inline float __exp2f(float x) { return exp2f(x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline void __sincosf(float x, float* s, float* c) { *s = sinf(x); *c = cosf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float __frsqrt_rn(float x) { return 1.0f / sqrtf(x); }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
inline int __float2int_rn(float x) { return static_cast<int>(nearbyintf(x)); }
inline int __float2int_rz(float x) { return static_cast<int>(x); }
inline unsigned int __float2uint_rn(float x) { return static_cast<unsigned int>(nearbyintf(x)); }
inline float __int2float_rn(int x) { return static_cast<float>(x); }
inline float __uint2float_rn(unsigned int x) { return static_cast<float>(x); }

inline int __popc(unsigned int x) { return std::popcount(x); }
inline int __popcll(unsigned long long x) { return std::popcount(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline int __clz(int x) { return std::countl_zero(static_cast<unsigned int>(x)); }
inline int __clzll(long long x) { return std::countl_zero(static_cast<unsigned long long>(x)); }
inline unsigned int __brev(unsigned int x) {
  x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
  x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
  x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
  return __builtin_bswap32(x);
}

// min/max overloads as CUDA declares them (mixed signed/unsigned promote to unsigned).
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }
inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }
inline unsigned int min(int a, unsigned int b) { return min(static_cast<unsigned int>(a), b); }
inline unsigned int max(int a, unsigned int b) { return max(static_cast<unsigned int>(a), b); }
inline unsigned int min(unsigned int a, int b) { return min(a, static_cast<unsigned int>(b)); }
inline unsigned int max(unsigned int a, int b) { return max(a, static_cast<unsigned int>(b)); }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }
inline double min(float a, double b) { return fmin(a, b); }
inline double max(float a, double b) { return fmax(a, b); }
inline double min(double a, float b) { return fmin(a, b); }
inline double max(double a, float b) { return fmax(a, b); }

// Cache-hinted loads and stores are plain accesses on the CPU.
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldca(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }
template <class T> inline T __ldcs(const T* p) { return *p; }
template <class T> inline T __ldlu(const T* p) { return *p; }
template <class T> inline T __ldcv(const T* p) { return *p; }
template <class T> inline void __stwb(T* p, T v) { *p = v; }
template <class T> inline void __stcg(T* p, T v) { *p = v; }
template <class T> inline void __stcs(T* p, T v) { *p = v; }
template <class T> inline void __stwt(T* p, T v) { *p = v; }

#ifdef EMU_STRICT
#include "cuda_cpu_strict.h"
#else
// ===================================================================================== runtime
namespace emu {
namespace detail {

#ifdef EMU_ASAN
constexpr std::size_t kStackBytes = 512 * 1024;  // ASan redzones make frames several times larger
#else
constexpr std::size_t kStackBytes = 64 * 1024;
#endif

enum class Wait : std::uint8_t { Runnable, Spin, Barrier, WarpFull, WarpFree, Done };

struct Block;

struct Fiber {
  void* sp = nullptr;            // saved stack pointer while switched out
  void* stack = nullptr;         // lowest usable byte of the pooled stack (a guard page sits below)
  ::uint3 tid{0, 0, 0};
  Wait wait = Wait::Runnable;
  Wait resumed_from = Wait::Runnable;  // what it waited for when last resumed (idle detection)
  unsigned int wait_token = 0;   // barrier generation or warp collective sequence it waits on
  unsigned int wait_mask = 0;    // mask of the warp collective it waits at
  const char* where = "";        // what it waits at, for error messages
  Block* block = nullptr;
  AsyncCopies copies;  // its cp.async copies not landed yet
#if !defined(__x86_64__)
  ucontext_t uc;
#endif
};

// One host thread per block.
struct Launch : LaunchRecord {
  using LaunchRecord::LaunchRecord;

  // First error wins; every block unwinds at its next yield point.
  void fail(int c, const std::string& msg) {
    record_error(c, msg);
    abort.store(true, std::memory_order_release);
  }
};

struct Block : BarrierState {
  Launch* launch = nullptr;
  const std::atomic<bool>* abort = nullptr;  // &launch->abort, read at every yield point
  Fiber** current = nullptr;                 // &tl_fiber of this OS thread: TLS looked up once
  ::uint3 idx{0, 0, 0};
  ::dim3 dim, grid;
  std::unique_ptr<Fiber[]> fibers;
  std::unique_ptr<Warp[]> warps;
  int nthreads = 0, nwarps = 0;
  int live = 0, exited = 0;
  void* sched_sp = nullptr;
  bool pass_aborting = false;        // the current scheduling pass resumes every fiber to unwind
  int resumed = 0, progressed = 0;   // fibers resumed in this pass / resumed for a reason not a spin
  std::size_t dyn_smem_handed = 0;  // bytes of dynamic shared memory handed out in this launch
  std::uint64_t serial = 0;         // next_block_serial(): this block of this launch
#if !defined(__x86_64__)
  ucontext_t sched_uc;
#endif
#ifdef EMU_ASAN
  const void* sched_stack_bottom = nullptr;
  std::size_t sched_stack_size = 0;
#endif
};

inline thread_local Block* tl_block = nullptr;
inline thread_local Fiber* tl_fiber = nullptr;

// build.py compiles with TLS descriptors (-mtls-dialect=gnu2) so that g++ hoists the address of
// a __shared__ (thread_local) array out of loops. g++ assumes a descriptor call preserves every
// register, but glibc before 2.40 clobbers xmm registers on the slow path, taken on a thread's
// first access to the module's TLS (glibc BZ #31372). So every thread that runs emulator code
// calls this first, from a real call with nothing live; later accesses take the fast path.
__attribute__((noipa)) inline void warm_up_tls() {
  asm volatile("" : : "r"(&tl_fiber), "r"(&tl_block), "r"(&tl_last_error) : "memory");
}

// "0-31, 40, 45-63": compact list of the thread ids for which pred holds.
template <class Pred>
inline std::string thread_ranges(const Block* b, Pred pred) {
  std::string out;
  int start = -1;
  for (int t = 0; t <= b->nthreads; ++t) {
    bool in = t < b->nthreads && pred(b->fibers[t]);
    if (in && start < 0) start = t;
    if (!in && start >= 0) {
      if (!out.empty()) out += ", ";
      out += start == t - 1 ? std::to_string(start) : std::to_string(start) + "-" + std::to_string(t - 1);
      start = -1;
    }
  }
  return out.empty() ? "none" : out;
}

inline std::string describe_wait(const Fiber& f) {
  switch (f.wait) {
    case Wait::Runnable: return "runs";
    case Wait::Spin: return "spins in __nanosleep";
    case Wait::Barrier: return "waits at __syncthreads";
    case Wait::WarpFull:
    case Wait::WarpFree: return fmt("waits at %s with mask 0x%08x", f.where, f.wait_mask);
    case Wait::Done: return "exited";
  }
  return "?";
}

inline bool fiber_ready(const Block* b, const Fiber& f) {
  switch (f.wait) {
    case Wait::Runnable:
    case Wait::Spin: return true;
    case Wait::Barrier: return b->bar_gen != f.wait_token;
    case Wait::WarpFull:
    case Wait::WarpFree: return b->warps[f.tid.x >> 5].seq != f.wait_token;
    case Wait::Done: return false;
  }
  return false;
}

// ============================================================================ context switching
#if defined(__x86_64__)
// Saves the callee-saved registers and rsp of the running context into *save_sp and resumes the
// context whose stack pointer is load_sp. Kernels must not change the FP control words.
// noipa (here and on resume/suspend): g++ must treat a switch as an opaque call that may read and
// write any memory, or it keeps shared-memory values and loop state in registers across it.
__attribute__((naked, noipa)) static void ctx_switch(void** /*save_sp*/, void* /*load_sp*/) {
  asm("pushq %rbp\n\t"
      "pushq %rbx\n\t"
      "pushq %r12\n\t"
      "pushq %r13\n\t"
      "pushq %r14\n\t"
      "pushq %r15\n\t"
      "movq %rsp, (%rdi)\n\t"
      "movq %rsi, %rsp\n\t"
      "popq %r15\n\t"
      "popq %r14\n\t"
      "popq %r13\n\t"
      "popq %r12\n\t"
      "popq %rbx\n\t"
      "popq %rbp\n\t"
      "ret\n\t");
}
#endif

[[noreturn]] inline void fiber_entry();

#if !defined(__x86_64__)
inline void fiber_entry_uc() { fiber_entry(); }
#endif

inline void prepare_fiber(Fiber* f) {
#if defined(__x86_64__)
  // Layout consumed by ctx_switch: r15 r14 r13 r12 rbx rbp, then the return address. After `ret`
  // rsp is 8 mod 16, as at any function entry. A zero above it ends backtraces.
  // Stagger the stack tops across cache sets: at the same page offset, the hot top frames of
  // hundreds of fibers would fight over one L1 set and 1/64 of L2, tripling the switch cost.
  auto top = reinterpret_cast<std::uintptr_t>(f->stack) + kStackBytes - 64 * (f->tid.x % 64);
  auto* slot = reinterpret_cast<std::uintptr_t*>(top - 16);
  slot[1] = 0;
  slot[0] = reinterpret_cast<std::uintptr_t>(&fiber_entry);
  std::uintptr_t* sp = slot - 6;
  for (int i = 0; i < 6; ++i) sp[i] = 0;
  f->sp = sp;
#else
  getcontext(&f->uc);
  f->uc.uc_stack.ss_sp = f->stack;
  f->uc.uc_stack.ss_size = kStackBytes;
  f->uc.uc_link = nullptr;
  makecontext(&f->uc, fiber_entry_uc, 0);
#endif
}

// Saves the running context (fiber `from`, or the scheduler when null) and resumes `to` (a fiber,
// or the scheduler when null). Other fibers write shared and global memory meanwhile: the switch
// must be a compiler barrier (noipa + "memory" clobbers). A dying fiber never comes back.
__attribute__((noipa)) inline void switch_fibers(Block* b, Fiber* from, Fiber* to, bool dying) {
  *b->current = to;
  asm volatile("" ::: "memory");
#ifdef EMU_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(dying ? nullptr : &fake, to ? to->stack : b->sched_stack_bottom,
                                 to ? kStackBytes : b->sched_stack_size);
#else
  (void)dying;
#endif
#if defined(__x86_64__)
  ctx_switch(from ? &from->sp : &b->sched_sp, to ? to->sp : b->sched_sp);
#else
  swapcontext(from ? &from->uc : &b->sched_uc, to ? &to->uc : &b->sched_uc);
#endif
#ifdef EMU_ASAN
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
  asm volatile("" ::: "memory");
}

inline void mark_resumed(Block* b, Fiber* g) {
  g->resumed_from = g->wait;
  g->wait = Wait::Runnable;
  ++b->resumed;
}

// A fiber stops running (it waits, spins or returned): resume the next ready fiber of this pass
// in threadIdx order directly, or the scheduler once the pass reaches the last thread. Switching
// fiber to fiber halves the switches of a pass through the scheduler, in the same order.
inline void yield_fiber(Fiber* f, bool dying) {
  Block* b = f->block;
  b->progressed += dying || f->resumed_from != Wait::Spin || f->wait != Wait::Spin;
  for (int t = static_cast<int>(f->tid.x) + 1; t < b->nthreads; ++t) {
    Fiber* g = &b->fibers[t];
    if (g->wait == Wait::Done || (!b->pass_aborting && !fiber_ready(b, *g))) continue;
    mark_resumed(b, g);
    switch_fibers(b, f, g, dying);
    return;
  }
  switch_fibers(b, f, nullptr, dying);
}

// ============================================================================== stack pool
// Fiber stacks outlive launches: mapping and guarding thousands of stacks per launch cost ~10 ms.
struct StackPool {
  std::mutex mu;
  std::vector<void*> free_stacks;

  bool take(std::size_t n, std::vector<void*>& out) {
    std::lock_guard<std::mutex> lk(mu);
    static const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    while (out.size() < n) {
      if (!free_stacks.empty()) {
        out.push_back(free_stacks.back());
        free_stacks.pop_back();
        continue;
      }
      void* base = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
      if (base == MAP_FAILED) return false;
      mprotect(base, page, PROT_NONE);  // guard page: an overflow faults instead of corrupting
      out.push_back(static_cast<char*>(base) + page);
    }
    return true;
  }
  void give(const std::vector<void*>& stacks) {
    std::lock_guard<std::mutex> lk(mu);
    free_stacks.insert(free_stacks.end(), stacks.begin(), stacks.end());
  }
};

// One pool per process and stack size, not one per module: every emulator .so has its own copy
// of this header's statics (-fno-gnu-unique), and each pooled stack is two memory mappings (its
// guard page splits it), so a test session's dozens of modules, each keeping its last launch's
// stacks, ran out of the kernel's 65530 mappings per process (mmap: ENOMEM, seen in CI). The
// loader (build.py) hands each new module the first module's pool before its first launch
// (emu_stack_pool / emu_adopt_stack_pool in the generated driver).
inline StackPool*& stack_pool_slot() {
  static StackPool* pool = new StackPool;  // never destroyed: detached block threads may use it
  return pool;
}
inline StackPool& stack_pool() { return *stack_pool_slot(); }

// ============================================================================ yield points
inline Fiber* current_fiber() {
  Fiber* f = tl_fiber;
  if (f == nullptr) {
    std::fprintf(stderr, "emu: a device function that needs a CUDA thread was called outside a launch\n");
    std::abort();
  }
  return f;
}

inline AsyncCopies& async_copies() { return current_fiber()->copies; }

inline void check_abort(const Block* b) {
  if (b->abort->load(std::memory_order_relaxed)) throw LaunchAborted{};
}

[[noreturn]] inline void fail_here(int code, const std::string& msg) {
  tl_block->launch->fail(code, msg);
  throw LaunchAborted{};
}

inline void block_on(Fiber* f, Wait w, unsigned int token, const char* where, unsigned int mask = 0) {
  f->wait = w;
  f->wait_token = token;
  f->where = where;
  f->wait_mask = mask;
  yield_fiber(f, false);
  check_abort(f->block);
}

inline std::string divergent_barrier_message(const Block* b, const Fiber* arriving) {
  return fmt("divergent barrier: block %u threads %s wait at __syncthreads while threads %s exited",
             b->idx.x,
             thread_ranges(b, [&](const Fiber& f) { return f.wait == Wait::Barrier || &f == arriving; }).c_str(),
             thread_ranges(b, [](const Fiber& f) { return f.wait == Wait::Done; }).c_str());
}

// Generation barrier over the block's live fibers; also computes __syncthreads_count/and/or.
inline void barrier(int pred, int* count, int* all, int* any) {
  Fiber* f = current_fiber();
  Block* b = f->block;
  check_abort(b);
  const unsigned int gen = b->bar_gen;
  const int s = gen & 1;
  b->deposit(s, pred);
  if (++b->bar_arrived == b->live) {
    if (b->exited > 0) fail_here(kDivergentBarrier, divergent_barrier_message(b, f));
    b->complete(s);
  } else {
    do block_on(f, Wait::Barrier, gen, "__syncthreads");
    while (b->bar_gen == gen);
  }
  b->results(s, count, all, any);
}

inline std::string missing_lane_message(const Block* b, int warp, const Warp& w, unsigned int missing,
                                        const char* op) {
  std::string states;
  for (int l = 0; l < 32; ++l) {
    if (!(missing >> l & 1u)) continue;
    const Fiber& m = b->fibers[warp * 32 + l];
    states += fmt("%slane %d %s", states.empty() ? "" : "; ", l, describe_wait(m).c_str());
  }
  return fmt("warp %d of block %u: lane%s %s named in mask 0x%08x never reached %s (%s)", warp, b->idx.x,
             __builtin_popcount(missing) > 1 ? "s" : "", lane_list(missing).c_str(), w.mask, op,
             states.c_str());
}

// One warp collective: every lane named in `mask` deposits (deposit(warp, lane): true when it
// was the last lane, which then computed every lane's result), waits until all have, and returns
// collect(warp, lane). `whole_warp`: the collective needs all 32 lanes to exist (mma, ldmatrix).
template <class Deposit, class Collect>
inline auto warp_rendezvous(const char* op, unsigned int mask, bool whole_warp, Deposit deposit, Collect collect) {
  Fiber* f = current_fiber();
  Block* b = f->block;
  check_abort(b);
  const int warp = static_cast<int>(f->tid.x) >> 5;
  const unsigned int lane = f->tid.x & 31u, bit = 1u << lane;
  Warp& w = b->warps[warp];
  if (!(mask & bit))
    fail_here(kWarpError, not_in_mask_message(warp, b->idx.x, lane, op, mask));
  if (whole_warp && w.exists != ~0u)
    fail_here(kWarpError, partial_warp_message(warp, b->idx.x, op, w.exists));
  // Lanes past the end of a partial last warp do not exist; they are not waited for.
  const unsigned int need = mask & w.exists;
  for (;;) {
    if (!w.open) {
      if (need & w.exited) {
        w.mask = need;
        w.op = op;
        fail_here(kWarpError, missing_lane_message(b, warp, w, need & w.exited, op));
      }
      w.begin(need, op);
      break;
    }
    if (w.mask == need && !(w.arrived & bit)) {
      if (w.op != op && std::strcmp(w.op, op) != 0)
        fail_here(kWarpError, other_collective_message(warp, b->idx.x, lane, op, w));
      break;
    }
    block_on(f, Wait::WarpFree, w.seq, op, mask);  // another collective (other mask) is open
  }
  if (!deposit(w, lane)) {
    const unsigned int seq = w.seq;
    do block_on(f, Wait::WarpFull, seq, op, mask);
    while (w.seq == seq);
  }
  return collect(w, lane);
}

// A shuffle, vote or reduction: `val` (and its shuffle argument and width) in, and
// `compute(warp, lane)` out, evaluated for all lanes by the lane that arrives last.
inline std::uint64_t warp_collective(const char* op, unsigned int mask, std::uint64_t val, int arg, int width,
                                     WarpCompute compute) {
  return warp_rendezvous(
      op, mask, false, [&](Warp& w, unsigned int lane) { return w.deposit(lane, val, arg, width, compute); },
      [](const Warp& w, unsigned int lane) { return w.results[lane]; });
}

// A wide exchange of the whole warp (mask 0xffffffff): `in_bytes` from `in` per lane; the last
// lane runs compute(warp) for all; `out_bytes` of this lane's result land in `out`.
inline void warp_exchange(const char* op, const void* in, std::size_t in_bytes, void* out, std::size_t out_bytes,
                          WarpComputeAll compute) {
  warp_rendezvous(
      op, ~0u, true, [&](Warp& w, unsigned int lane) { return w.deposit_wide(lane, in, in_bytes, compute); },
      [&](const Warp& w, unsigned int lane) {
        std::memcpy(out, w.wide_out[lane], out_bytes);
        return 0;
      });
}

// ============================================================================ fiber lifecycle
inline void on_fiber_exit(Fiber* f) {
  Block* b = f->block;
  const int warp = static_cast<int>(f->tid.x) >> 5;
  const unsigned int bit = 1u << (f->tid.x & 31u);
  Warp& w = b->warps[warp];
  f->wait = Wait::Done;
  f->copies.clear();  // copies it never waited for: nothing may read them (they never land)
  --b->live;
  ++b->exited;
  w.exited |= bit;
  if (b->launch->abort.load(std::memory_order_relaxed)) return;
  if (w.open && (w.mask & bit) && !(w.arrived & bit)) {
    b->launch->fail(kWarpError, missing_lane_message(b, warp, w, w.mask & ~w.arrived & w.exited, w.op));
  } else if (b->bar_arrived > 0 && b->bar_arrived == b->live) {
    b->launch->fail(kDivergentBarrier, divergent_barrier_message(b, nullptr));
  }
}

[[noreturn]] inline void fiber_entry() {
  Fiber* f = tl_fiber;
  Block* b = f->block;
#ifdef EMU_ASAN
  // The first fiber to start is always entered from the scheduler: learn its stack bounds then.
  if (b->sched_stack_bottom == nullptr)
    __sanitizer_finish_switch_fiber(nullptr, &b->sched_stack_bottom, &b->sched_stack_size);
  else
    __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
  run_kernel(b->launch, b->idx.x, f->tid.x);
  on_fiber_exit(f);
  yield_fiber(f, true);
  __builtin_unreachable();
}


inline std::string deadlock_message(const Block* b) {
  // A warp collective with absent lanes explains most deadlocks; name it first.
  for (int wi = 0; wi < b->nwarps; ++wi) {
    const Warp& w = b->warps[wi];
    if (w.open && w.arrived != w.mask) return missing_lane_message(b, wi, w, w.mask & ~w.arrived, w.op);
  }
  std::string states;
  for (Wait kind : {Wait::Barrier, Wait::WarpFull, Wait::WarpFree}) {
    std::string r = thread_ranges(b, [&](const Fiber& f) { return f.wait == kind; });
    if (r == "none") continue;
    const Fiber* any = nullptr;
    for (int t = 0; t < b->nthreads && !any; ++t)
      if (b->fibers[t].wait == kind) any = &b->fibers[t];
    states += fmt("%sthreads %s %s", states.empty() ? "" : "; ", r.c_str(), describe_wait(*any).c_str());
  }
  return fmt("deadlock in block %u: %s", b->idx.x, states.c_str());
}

// Round-robin passes over the block's fibers in threadIdx order until all have returned. A pass
// starts here with the first ready fiber; the fibers hand over to each other (yield_fiber).
inline void schedule(Block* b) {
  int idle_passes = 0;
  while (b->live > 0) {
    b->pass_aborting = b->abort->load(std::memory_order_relaxed);
    b->resumed = b->progressed = 0;
    for (int t = 0; t < b->nthreads; ++t) {
      Fiber* g = &b->fibers[t];
      if (g->wait == Wait::Done || (!b->pass_aborting && !fiber_ready(b, *g))) continue;
      mark_resumed(b, g);
      switch_fibers(b, nullptr, g, false);
      break;
    }
    if (b->resumed == 0) {
      if (!b->pass_aborting) b->launch->fail(kDeadlock, deadlock_message(b));
      continue;  // the next pass resumes every fiber, which then unwinds
    }
    if (b->progressed > 0) {
      idle_passes = 0;
    } else if (++idle_passes < 256) {
      sched_yield();  // every fiber spins on another block: let that block's OS thread run
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
}

inline void run_block(Launch* L, int bidx) {
  Block b;
  b.launch = L;
  b.abort = &L->abort;
  b.current = &tl_fiber;
  b.idx = ::uint3{static_cast<unsigned int>(bidx), 0, 0};
  b.dim = ::dim3(L->block, 1, 1);
  b.grid = ::dim3(L->grid, 1, 1);
  b.nthreads = L->block;
  b.nwarps = (L->block + 31) / 32;
  b.live = L->block;
  b.fibers.reset(new Fiber[b.nthreads]);
  b.warps.reset(new Warp[b.nwarps]);
  for (int wi = 0; wi < b.nwarps; ++wi) {
    const int lanes = std::min(32, b.nthreads - wi * 32);
    b.warps[wi].exists = lanes == 32 ? ~0u : (1u << lanes) - 1u;
  }
  std::vector<void*> stacks;
  stacks.reserve(b.nthreads);
  if (!stack_pool().take(b.nthreads, stacks)) {
    L->fail(kBadLaunch, fmt("block %d: cannot map %d fiber stacks", bidx, b.nthreads));
    stack_pool().give(stacks);
    return;
  }
  for (int t = 0; t < b.nthreads; ++t) {
    Fiber& f = b.fibers[t];
    f.tid = ::uint3{static_cast<unsigned int>(t), 0, 0};
    f.block = &b;
    f.stack = stacks[t];
#ifdef EMU_ASAN
    __asan_unpoison_memory_region(f.stack, kStackBytes);  // an abandoned fiber may have left poison
#endif
    prepare_fiber(&f);
  }
  b.serial = next_block_serial();
  tl_block = &b;
  schedule(&b);
  tl_block = nullptr;
  tl_fiber = nullptr;
  stack_pool().give(stacks);
}

}  // namespace detail

// ============================================================================ public device API
inline void trap() {
  detail::Fiber* f = detail::current_fiber();
  detail::fail_here(kTrap, detail::fmt("trap: block %u thread %u called __trap()", f->block->idx.x, f->tid.x));
}

// Acquire load of a counter written by other blocks; a yield point for the host timeout.
inline int load_acquire(const int* p) {
  if (detail::tl_block) detail::check_abort(detail::tl_block);
  return std::atomic_ref<int>(*const_cast<int*>(p)).load(std::memory_order_acquire);
}

// *p += v as a release read-modify-write (megakernel.cu red_add_release: red.release.gpu).
inline void red_add_release(int* p, int v) {
  if (detail::tl_block) detail::check_abort(detail::tl_block);
  std::atomic_ref<int>(*p).fetch_add(v, std::memory_order_release);
}

// Returns *p, then *p += v, as an acq_rel read-modify-write (megakernel.cu ticket_add:
// atom.acq_rel.gpu).
inline int atom_add_acq_rel(int* p, int v) {
  if (detail::tl_block) detail::check_abort(detail::tl_block);
  return std::atomic_ref<int>(*p).fetch_add(v, std::memory_order_acq_rel);
}

// Per-block buffer for what CUDA calls dynamic shared memory (extern __shared__). Every thread
// of a block gets the same pointer; the size may not grow within a launch.
inline void* dynamic_shared(std::size_t bytes) {
  struct Buffer {
    void* p = nullptr;
    std::size_t cap = 0;
    ~Buffer() { std::free(p); }
  };
  static thread_local Buffer buf;
  detail::Fiber* f = detail::current_fiber();
  detail::Block* b = f->block;
  if (bytes > buf.cap) {
    if (b->dyn_smem_handed > 0)
      detail::fail_here(kBadLaunch, detail::fmt("block %u thread %u: dynamic shared memory grew from %zu to %zu bytes "
                                                "within one launch", b->idx.x, f->tid.x, b->dyn_smem_handed, bytes));
    std::free(buf.p);
    buf.cap = (bytes + 127) & ~std::size_t{127};
    buf.p = std::aligned_alloc(128, buf.cap);
  }
  b->dyn_smem_handed = std::max(b->dyn_smem_handed, bytes);
  return buf.p;
}

// Runs kernel(params) on grid x block CUDA threads. Returns 0, or a Code with last_error() set.
inline int launch(void (*kernel)(const void*), int grid, int block, const void* params, double timeout_s) {
  using namespace detail;
  warm_up_tls();
  tl_last_error.clear();
  if (grid < 1 || block < 1 || block > 1024) {
    tl_last_error = fmt("bad launch configuration: grid %d, block %d (need grid >= 1, 1 <= block <= 1024)", grid, block);
    return kBadLaunch;
  }
  // Shared so that block threads which never stop (a spin without any yield point) can be
  // detached without leaving them a dangling launch record.
  auto L = std::make_shared<Launch>(kernel, params, grid, block);
  return run_host_threads(
      L, grid, timeout_s, "block threads",
      [L](int b) {
        warm_up_tls();
        run_block(L.get(), b);
      },
      [](int stuck, int n) {
        return fmt("; %d of %d blocks did not stop within 5 s of the abort (a spin loop without "
                   "__nanosleep or load_acquire?); their threads were detached", stuck, n);
      });
}

}  // namespace emu

// ============================================================================ CUDA built-ins
#define threadIdx (static_cast<const ::uint3&>(::emu::detail::current_fiber()->tid))
#define blockIdx (static_cast<const ::uint3&>(::emu::detail::tl_block->idx))
#define blockDim (static_cast<const ::dim3&>(::emu::detail::tl_block->dim))
#define gridDim (static_cast<const ::dim3&>(::emu::detail::tl_block->grid))

namespace emu::detail {
// The storage behind EMU_SHARED: the block's OS thread owns it (thread_local, as __shared__ was),
// and the first fiber of a block to reach the declaration poisons it (fibers switch only at
// yield points, so no other fiber of the block has used it yet). Trivial, so the thread_local
// needs no initialisation guard.
template <class T>
struct PoisonedShared {
  T value;
  std::uint64_t serial;
  T& get() {
    const std::uint64_t now = tl_block->serial;
    if (serial != now) {
      std::memset(static_cast<void*>(&value), kSharedPoison, sizeof(T));
      serial = now;
    }
    return value;
  }
};
}  // namespace emu::detail

// `__shared__ T NAME DIMS;` as rewritten by build.py: this OS thread's (this block's) instance,
// poisoned at the block's start.
#define EMU_SHARED(T, NAME, DIMS)                                           \
  static thread_local ::emu::detail::PoisonedShared<T DIMS> emu_shared_##NAME; \
  T(&NAME) DIMS = emu_shared_##NAME.get()

inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }

// Yields the fiber; when every fiber of the block spins, the scheduler yields the OS thread.
inline void __nanosleep(unsigned int /*ns*/) {
  using namespace emu::detail;
  Fiber* f = tl_fiber;
  if (f == nullptr) return;
  check_abort(f->block);
  block_on(f, Wait::Spin, 0, "__nanosleep");
}

// CUDA's atomics are relaxed; a fence before one is what orders the writes before it.
#define EMU_RMW_ORDER std::memory_order_relaxed
#endif  // EMU_STRICT

// ================================================================ built-ins of both runtimes
inline void __syncthreads() { emu::detail::barrier(0, nullptr, nullptr, nullptr); }
inline int __syncthreads_count(int pred) {
  int c;
  emu::detail::barrier(pred, &c, nullptr, nullptr);
  return c;
}
inline int __syncthreads_and(int pred) {
  int a;
  emu::detail::barrier(pred, nullptr, &a, nullptr);
  return a;
}
inline int __syncthreads_or(int pred) {
  int o;
  emu::detail::barrier(pred, nullptr, nullptr, &o);
  return o;
}

[[noreturn]] inline void __trap() {
  emu::trap();
  __builtin_unreachable();
}

inline long long clock64() { return static_cast<long long>(emu::global_timer_ns()); }

// ---- warp collectives (PTX shfl.sync semantics: a lane reads var of lane j, or its own value
// when j falls outside the allowed range; reading a lane outside the mask gives kPoison)
namespace emu::detail {
// Reading a lane outside the collective's mask is undefined on a GPU: return a loud pattern.
constexpr std::uint64_t kPoison = ~0ull;
inline std::uint64_t lane_value(const Warp& w, int j) { return (w.mask >> j & 1u) ? w.vals[j] : kPoison; }

template <class T>
inline std::uint64_t to_bits(const T& v) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "warp shuffles move at most 8 bytes");
  std::uint64_t u = 0;
  std::memcpy(&u, &v, sizeof(T));
  return u;
}
template <class T>
inline T from_bits(std::uint64_t u) {
  T v;
  std::memcpy(&v, &u, sizeof(T));
  return v;
}

inline void check_width(int width, const char* op) {
  if (width < 1 || width > 32 || (width & (width - 1)) != 0)
    fail_here(kWarpError, fmt("%s: width %d is not a power of two in 1..32", op, width));
}

inline std::uint64_t shfl_idx(const Warp& w, unsigned int lane) {
  const int width = w.widths[lane];
  const int j = static_cast<int>(lane & ~static_cast<unsigned int>(width - 1)) | (w.args[lane] & (width - 1));
  return lane_value(w, j);
}
inline std::uint64_t shfl_up(const Warp& w, unsigned int lane) {
  const int seg_start = static_cast<int>(lane & ~static_cast<unsigned int>(w.widths[lane] - 1));
  const long j = static_cast<long>(lane) - static_cast<unsigned int>(w.args[lane]);
  return j < seg_start ? w.vals[lane] : lane_value(w, static_cast<int>(j));
}
inline std::uint64_t shfl_down(const Warp& w, unsigned int lane) {
  const int seg_end = static_cast<int>(lane | static_cast<unsigned int>(w.widths[lane] - 1));
  const long j = static_cast<long>(lane) + static_cast<unsigned int>(w.args[lane]);
  return j > seg_end ? w.vals[lane] : lane_value(w, static_cast<int>(j));
}
inline std::uint64_t shfl_bfly(const Warp& w, unsigned int lane) {
  // A lane may read earlier segments, never later ones.
  const int seg_end = static_cast<int>(lane | static_cast<unsigned int>(w.widths[lane] - 1));
  const int j = static_cast<int>(lane) ^ (w.args[lane] & 31);
  return j > seg_end ? w.vals[lane] : lane_value(w, j);
}
inline std::uint64_t vote_ballot(const Warp& w, unsigned int) {
  std::uint64_t bits = 0;
  for (int l = 0; l < 32; ++l)
    if ((w.mask >> l & 1u) && w.vals[l]) bits |= 1ull << l;
  return bits;
}
inline std::uint64_t vote_any(const Warp& w, unsigned int lane) { return vote_ballot(w, lane) != 0; }
inline std::uint64_t vote_all(const Warp& w, unsigned int lane) { return vote_ballot(w, lane) == w.mask; }
inline std::uint64_t no_result(const Warp&, unsigned int) { return 0; }
}  // namespace emu::detail

template <class T>
inline T __shfl_sync(unsigned int mask, T var, int src_lane, int width = warpSize) {
  using namespace emu::detail;
  check_width(width, "__shfl_sync");
  return from_bits<T>(warp_collective("__shfl_sync", mask, to_bits(var), src_lane, width, shfl_idx));
}
template <class T>
inline T __shfl_up_sync(unsigned int mask, T var, unsigned int delta, int width = warpSize) {
  using namespace emu::detail;
  check_width(width, "__shfl_up_sync");
  return from_bits<T>(warp_collective("__shfl_up_sync", mask, to_bits(var), static_cast<int>(delta), width, shfl_up));
}
template <class T>
inline T __shfl_down_sync(unsigned int mask, T var, unsigned int delta, int width = warpSize) {
  using namespace emu::detail;
  check_width(width, "__shfl_down_sync");
  return from_bits<T>(warp_collective("__shfl_down_sync", mask, to_bits(var), static_cast<int>(delta), width, shfl_down));
}
template <class T>
inline T __shfl_xor_sync(unsigned int mask, T var, int lane_mask, int width = warpSize) {
  using namespace emu::detail;
  check_width(width, "__shfl_xor_sync");
  return from_bits<T>(warp_collective("__shfl_xor_sync", mask, to_bits(var), lane_mask, width, shfl_bfly));
}

inline unsigned int __ballot_sync(unsigned int mask, int pred) {
  return static_cast<unsigned int>(emu::detail::warp_collective("__ballot_sync", mask, pred != 0, 0, 32,
                                                                emu::detail::vote_ballot));
}
inline int __any_sync(unsigned int mask, int pred) {
  return static_cast<int>(emu::detail::warp_collective("__any_sync", mask, pred != 0, 0, 32, emu::detail::vote_any));
}
inline int __all_sync(unsigned int mask, int pred) {
  return static_cast<int>(emu::detail::warp_collective("__all_sync", mask, pred != 0, 0, 32, emu::detail::vote_all));
}
inline void __syncwarp(unsigned int mask = 0xffffffffu) {
  emu::detail::warp_collective("__syncwarp", mask, 0, 0, 32, emu::detail::no_result);
}
#ifndef EMU_STRICT
// The emulator cannot tell which lanes a GPU would have converged: it reports the live ones.
inline unsigned int __activemask() {
  using namespace emu::detail;
  Fiber* f = current_fiber();
  const Warp& w = f->block->warps[f->tid.x >> 5];
  return w.exists & ~w.exited;
}
#endif

#define EMU_WARP_REDUCE(NAME, T, INIT, OP)                                                          \
  inline T NAME(unsigned int mask, T value) {                                                      \
    using namespace emu::detail;                                                                   \
    return from_bits<T>(warp_collective(#NAME, mask, to_bits(value), 0, 32, [](const Warp& w, unsigned int) { \
      T acc = INIT;                                                                                \
      for (int l = 0; l < 32; ++l)                                                                 \
        if (w.mask >> l & 1u) {                                                                    \
          T v = from_bits<T>(w.vals[l]);                                                           \
          acc = OP;                                                                                \
        }                                                                                          \
      return to_bits(acc);                                                                         \
    }));                                                                                           \
  }
EMU_WARP_REDUCE(__reduce_add_sync, unsigned int, 0u, acc + v)
EMU_WARP_REDUCE(__reduce_add_sync, int, 0, static_cast<int>(static_cast<unsigned int>(acc) + static_cast<unsigned int>(v)))
EMU_WARP_REDUCE(__reduce_min_sync, unsigned int, ~0u, v < acc ? v : acc)
EMU_WARP_REDUCE(__reduce_min_sync, int, INT_MAX, v < acc ? v : acc)
EMU_WARP_REDUCE(__reduce_max_sync, unsigned int, 0u, v > acc ? v : acc)
EMU_WARP_REDUCE(__reduce_max_sync, int, INT_MIN, v > acc ? v : acc)
EMU_WARP_REDUCE(__reduce_and_sync, unsigned int, ~0u, acc & v)
EMU_WARP_REDUCE(__reduce_or_sync, unsigned int, 0u, acc | v)
EMU_WARP_REDUCE(__reduce_xor_sync, unsigned int, 0u, acc ^ v)
#undef EMU_WARP_REDUCE

// ---- atomics (global or shared memory alike)
template <class T>
inline std::atomic_ref<T> emu_atomic(T* p) { return std::atomic_ref<T>(*p); }

#define EMU_ATOMIC_RMW(T)                                                                          \
  inline T atomicAdd(T* p, T v) { return emu_atomic(p).fetch_add(v, EMU_RMW_ORDER); }              \
  inline T atomicExch(T* p, T v) { return emu_atomic(p).exchange(v, EMU_RMW_ORDER); }
EMU_ATOMIC_RMW(int)
EMU_ATOMIC_RMW(unsigned int)
EMU_ATOMIC_RMW(unsigned long long)
EMU_ATOMIC_RMW(float)
EMU_ATOMIC_RMW(double)
#undef EMU_ATOMIC_RMW

#define EMU_ATOMIC_INT(T)                                                                            \
  inline T atomicSub(T* p, T v) { return emu_atomic(p).fetch_sub(v, EMU_RMW_ORDER); }   \
  inline T atomicAnd(T* p, T v) { return emu_atomic(p).fetch_and(v, EMU_RMW_ORDER); }   \
  inline T atomicOr(T* p, T v) { return emu_atomic(p).fetch_or(v, EMU_RMW_ORDER); }     \
  inline T atomicXor(T* p, T v) { return emu_atomic(p).fetch_xor(v, EMU_RMW_ORDER); }   \
  inline T atomicCAS(T* p, T expected, T desired) {                                                  \
    emu_atomic(p).compare_exchange_strong(expected, desired, EMU_RMW_ORDER, std::memory_order_relaxed);             \
    return expected;                                                                                 \
  }                                                                                                  \
  inline T atomicMax(T* p, T v) {                                                                    \
    auto a = emu_atomic(p);                                                                          \
    const auto order = EMU_RMW_ORDER;                                                                \
    T old = a.load(std::memory_order_relaxed);                                                       \
    while (old < v && !a.compare_exchange_weak(old, v, order, std::memory_order_relaxed)) {}         \
    return old;                                                                                      \
  }                                                                                                  \
  inline T atomicMin(T* p, T v) {                                                                    \
    auto a = emu_atomic(p);                                                                          \
    const auto order = EMU_RMW_ORDER;                                                                \
    T old = a.load(std::memory_order_relaxed);                                                       \
    while (old > v && !a.compare_exchange_weak(old, v, order, std::memory_order_relaxed)) {}         \
    return old;                                                                                      \
  }
EMU_ATOMIC_INT(int)
EMU_ATOMIC_INT(unsigned int)
EMU_ATOMIC_INT(unsigned long long)
EMU_ATOMIC_INT(long long)
#undef EMU_ATOMIC_INT

// CUDA's wrapping increment/decrement: ((old >= limit) ? 0 : old + 1) and its mirror.
inline unsigned int atomicInc(unsigned int* p, unsigned int limit) {
  auto a = emu_atomic(p);
  const auto order = EMU_RMW_ORDER;
  unsigned int old = a.load(std::memory_order_relaxed);
  while (!a.compare_exchange_weak(old, old >= limit ? 0u : old + 1u, order, std::memory_order_relaxed)) {}
  return old;
}
inline unsigned int atomicDec(unsigned int* p, unsigned int limit) {
  auto a = emu_atomic(p);
  const auto order = EMU_RMW_ORDER;
  unsigned int old = a.load(std::memory_order_relaxed);
  while (!a.compare_exchange_weak(old, (old == 0u || old > limit) ? limit : old - 1u, order, std::memory_order_relaxed)) {}
  return old;
}

#ifndef EMU_STRICT
// ---- assert: glibc's assert() calls __assert_fail. This hidden definition binds inside the
// emulator's .so and turns a failed device assert into a launch error instead of abort().
extern "C" __attribute__((visibility("hidden"), noreturn)) void __assert_fail(
    const char* expr, const char* file, unsigned int line, const char* func) noexcept {
  using namespace emu::detail;
  Fiber* f = tl_fiber;
  if (f == nullptr) {
    std::fprintf(stderr, "%s:%u: %s: assertion `%s' failed\n", file, line, func, expr);
    std::abort();
  }
  f->block->launch->fail(emu::kAssert, fmt("block %u thread %u: assertion `%s' failed at %s:%u in %s",
                                           f->block->idx.x, f->tid.x, expr, file, line, func));
  // Cannot throw out of a noexcept function: abandon this fiber's stack without unwinding.
  on_fiber_exit(f);
  yield_fiber(f, true);
  __builtin_unreachable();
}
#endif  // EMU_STRICT

// ---- tensor-core twins (mma.sync, ldmatrix) of kernel/mma.cuh: both runtimes
#include "cuda_cpu_mma.h"
