// cuda_cpu_strict.h: the strict-memory runtime of cuda_cpu.h (EMU_STRICT builds only).
//
// The default runtime runs a block's CUDA threads as fibers on one OS thread, and x86 orders
// memory strongly: a kernel that forgets a __threadfence still passes. Here every CUDA thread is
// its own OS thread and every synchronisation the kernel relies on is spelled out in C++ memory
// model terms, so ThreadSanitizer (strict_driver.cpp, built by strict.py) reports the data race
// that a missing fence or acquire leaves on a GPU:
//   - __syncthreads is a mutex + condition variable generation barrier (all-to-all
//     happens-before between the block's threads), warp collectives a per-warp mutex + condvar;
//   - atomics are relaxed, as CUDA's are. __threadfence() makes the calling thread's NEXT atomic
//     read-modify-write a release (acq_rel) one: the "stores; fence; atomicAdd(flag)" producer
//     pattern. It is not a std::atomic_thread_fence because TSan does not model fences (it
//     would report a race the fence prevents). A fence that no atomic follows orders nothing
//     here, a weaker model than the GPU's, which may hide a race behind such a fence but never
//     invents one;
//   - emu::load_acquire is an acquire load; __nanosleep yields the OS thread;
//   - __shared__ storage is per block: strict.py rewrites `__shared__ T name[dims];` into
//     EMU_SHARED(T, name, [dims]), a static array of one T[dims] per block index, and a local
//     reference `name` bound to this block's element. No lock sits between blocks, so the only
//     happens-before edges between blocks are the kernel's own (and thread start/join).
// Errors: divergent barriers and lanes that leave a warp collective waiting are reported as in
// the fiber runtime; other hangs end at the host timeout. A failed device assert() ends the
// process (exit code 3): strict builds run only inside strict_driver's own process.
#pragma once

namespace emu {

struct LaunchAborted {};

enum Code : int {
  kOk = 0,
  kTimeout = 1,
  kTrap = 2,
  kAssert = 3,
  kDivergentBarrier = 4,
  kWarpError = 5,
  kDeadlock = 6,
  kBadLaunch = 7,
  kException = 8,
  kStuck = 9,
};

namespace detail {

// Blocks per launch: EMU_SHARED keeps one static instance per block index.
constexpr int kMaxBlocks = 64;

inline std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
inline std::string fmt(const char* f, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, f);
  std::vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  return buf;
}

inline std::string lane_list(unsigned int bits) {
  std::string out;
  for (int l = 0; l < 32; ++l)
    if (bits >> l & 1u) out += (out.empty() ? "" : ", ") + std::to_string(l);
  return out;
}

inline std::string seconds_text(double s) {
  std::string t = fmt("%g", s);
  if (t.find_first_of(".e") == std::string::npos) t += ".0";
  return t;
}

// Same fields as the fiber runtime's Warp (the shuffle functions read them), plus its lock.
struct Warp {
  unsigned int exists = 0, exited = 0;
  bool open = false;
  unsigned int mask = 0, arrived = 0;
  unsigned int seq = 0;
  const char* op = "";
  std::uint64_t vals[32];
  int args[32];
  int widths[32];
  std::uint64_t results[32];
  std::mutex mu;
  std::condition_variable cv;
};

using WarpCompute = std::uint64_t (*)(const Warp&, unsigned int lane);

struct Block;

struct Launch {
  void (*kernel)(const void*) = nullptr;
  const void* params = nullptr;
  int grid = 0, block = 0;
  std::atomic<bool> abort{false};
  std::unique_ptr<Block[]> blocks;
  std::mutex mu;
  std::condition_variable cv;
  int threads_done = 0;
  int code = kOk;
  std::string error;

  inline void fail(int c, const std::string& msg);
};

struct Block {
  Launch* launch = nullptr;
  ::uint3 idx{0, 0, 0};
  ::dim3 dim, grid;
  int nthreads = 0, nwarps = 0;
  std::unique_ptr<Warp[]> warps;
  std::mutex mu;  // everything below
  std::condition_variable cv;
  int live = 0, exited = 0;
  int bar_arrived = 0;
  unsigned int bar_gen = 0;
  int bar_count[2] = {0, 0}, bar_or[2] = {0, 0}, bar_and[2] = {1, 1};
  int bar_result_count[2] = {0, 0}, bar_result_or[2] = {0, 0}, bar_result_and[2] = {1, 1};
  void* dyn_smem = nullptr;
  std::size_t dyn_smem_bytes = 0;
  ~Block() { std::free(dyn_smem); }
};

// First error wins; then every waiting thread is woken to unwind. The notifies take each lock,
// so a waiter that just found `abort` false cannot miss its wake-up. Callers hold no lock.
inline void Launch::fail(int c, const std::string& msg) {
  {
    std::lock_guard<std::mutex> lk(mu);
    if (code == kOk) {
      code = c;
      error = msg;
    }
  }
  abort.store(true, std::memory_order_relaxed);
  for (int b = 0; b < grid; ++b) {
    Block& blk = blocks[b];
    { std::lock_guard<std::mutex> lk(blk.mu); }
    blk.cv.notify_all();
    for (int w = 0; w < blk.nwarps; ++w) {
      { std::lock_guard<std::mutex> lk(blk.warps[w].mu); }
      blk.warps[w].cv.notify_all();
    }
  }
}

struct Thread {
  ::uint3 tid{0, 0, 0};
  Block* block = nullptr;
};

inline thread_local Thread* tl_thread = nullptr;
inline thread_local bool tl_fence_pending = false;
inline thread_local std::string tl_last_error;

inline Thread* current_thread() {
  Thread* t = tl_thread;
  if (t == nullptr) {
    std::fprintf(stderr, "emu: a device function that needs a CUDA thread was called outside a launch\n");
    std::abort();
  }
  return t;
}

inline bool aborting(const Block* b) { return b->launch->abort.load(std::memory_order_relaxed); }

inline void check_abort(const Block* b) {
  if (aborting(b)) throw LaunchAborted{};
}

// Releases `lk` (Launch::fail takes every block and warp lock), records the error, unwinds.
template <class Lock>
[[noreturn]] inline void fail_here(Lock& lk, int code, const std::string& msg) {
  if (lk.owns_lock()) lk.unlock();
  current_thread()->block->launch->fail(code, msg);
  throw LaunchAborted{};
}

// The memory order of an atomic read-modify-write: release (acq_rel) right after __threadfence.
inline std::memory_order rmw_order() {
  if (!tl_fence_pending) return std::memory_order_relaxed;
  tl_fence_pending = false;
  return std::memory_order_acq_rel;
}

inline std::string divergent_barrier_message(const Block* b) {
  return fmt("divergent barrier: in block %u, %d thread(s) wait at __syncthreads while %d thread(s) exited",
             b->idx.x, b->bar_arrived, b->exited);
}

// Generation barrier over the block's live threads; also computes __syncthreads_count/and/or.
inline void barrier(int pred, int* count, int* all, int* any) {
  Block* b = current_thread()->block;
  std::unique_lock<std::mutex> lk(b->mu);
  check_abort(b);
  const unsigned int gen = b->bar_gen;
  const int s = gen & 1;
  b->bar_count[s] += pred != 0;
  b->bar_or[s] |= pred != 0;
  b->bar_and[s] &= pred != 0;
  if (++b->bar_arrived == b->live) {
    if (b->exited > 0) fail_here(lk, kDivergentBarrier, divergent_barrier_message(b));
    b->bar_result_count[s] = b->bar_count[s];
    b->bar_result_or[s] = b->bar_or[s];
    b->bar_result_and[s] = b->bar_and[s];
    b->bar_count[s] = 0;
    b->bar_or[s] = 0;
    b->bar_and[s] = 1;
    b->bar_arrived = 0;
    ++b->bar_gen;
    b->cv.notify_all();
  } else {
    b->cv.wait(lk, [&] { return b->bar_gen != gen || aborting(b); });
    check_abort(b);
  }
  if (count) *count = b->bar_result_count[s];
  if (all) *all = b->bar_result_and[s];
  if (any) *any = b->bar_result_or[s];
}

// One warp collective, with the fiber runtime's semantics: every lane named in `mask` deposits
// its value, the last to arrive computes every lane's result.
inline std::uint64_t warp_collective(const char* op, unsigned int mask, std::uint64_t val, int arg, int width,
                                     WarpCompute compute) {
  Thread* t = current_thread();
  Block* b = t->block;
  const int warp = static_cast<int>(t->tid.x) >> 5;
  const unsigned int lane = t->tid.x & 31u, bit = 1u << lane;
  Warp& w = b->warps[warp];
  std::unique_lock<std::mutex> lk(w.mu);
  check_abort(b);
  if (!(mask & bit))
    fail_here(lk, kWarpError, fmt("warp %d of block %u: lane %u calls %s with mask 0x%08x, which does not name it",
                                  warp, b->idx.x, lane, op, mask));
  const unsigned int need = mask & w.exists;
  for (;;) {
    if (!w.open) {
      if (need & w.exited)
        fail_here(lk, kWarpError, fmt("warp %d of block %u: lanes %s named in mask 0x%08x exited before %s",
                                      warp, b->idx.x, lane_list(need & w.exited).c_str(), need, op));
      w.open = true;
      w.mask = need;
      w.arrived = 0;
      w.op = op;
      break;
    }
    if (w.mask == need && !(w.arrived & bit)) {
      if (w.op != op && std::strcmp(w.op, op) != 0)
        fail_here(lk, kWarpError, fmt("warp %d of block %u: lane %u reached %s while lanes %s wait at %s (mask 0x%08x)",
                                      warp, b->idx.x, lane, op, lane_list(w.arrived).c_str(), w.op, w.mask));
      break;
    }
    const unsigned int seq = w.seq;  // another collective (other mask) is open: wait for it
    w.cv.wait(lk, [&] { return w.seq != seq || aborting(b); });
    check_abort(b);
  }
  w.vals[lane] = val;
  w.args[lane] = arg;
  w.widths[lane] = width;
  w.arrived |= bit;
  if (w.arrived == w.mask) {
    for (unsigned int m = w.mask; m != 0; m &= m - 1) {
      const unsigned int l = static_cast<unsigned int>(__builtin_ctz(m));
      w.results[l] = compute(w, l);
    }
    w.open = false;
    ++w.seq;
    w.cv.notify_all();
  } else {
    const unsigned int seq = w.seq;
    w.cv.wait(lk, [&] { return w.seq != seq || aborting(b); });
    check_abort(b);
  }
  return w.results[lane];
}

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
  if (width < 1 || width > 32 || (width & (width - 1)) != 0) {
    std::unique_lock<std::mutex> none;
    fail_here(none, kWarpError, fmt("%s: width %d is not a power of two in 1..32", op, width));
  }
}

// A thread returned (or unwound): a barrier or warp collective that only waits for it now fails.
inline void on_thread_exit(Thread* t) {
  Block* b = t->block;
  bool divergent = false;
  {
    std::lock_guard<std::mutex> lk(b->mu);
    --b->live;
    ++b->exited;
    divergent = !aborting(b) && b->bar_arrived > 0 && b->bar_arrived == b->live;
  }
  if (divergent) {
    std::string msg;
    {
      std::lock_guard<std::mutex> lk(b->mu);
      msg = divergent_barrier_message(b);
    }
    b->launch->fail(kDivergentBarrier, msg);
  }
  Warp& w = b->warps[t->tid.x >> 5];
  const unsigned int bit = 1u << (t->tid.x & 31u);
  std::string missing;
  {
    std::lock_guard<std::mutex> lk(w.mu);
    w.exited |= bit;
    if (!aborting(b) && w.open && (w.mask & bit) && !(w.arrived & bit))
      missing = fmt("warp %u of block %u: lane %u named in mask 0x%08x exited without reaching %s",
                    t->tid.x >> 5, b->idx.x, t->tid.x & 31u, w.mask, w.op);
  }
  if (!missing.empty()) b->launch->fail(kWarpError, missing);
}

inline void run_thread(Launch* L, Block* b, unsigned int tid) {
  Thread t;
  t.tid = ::uint3{tid, 0, 0};
  t.block = b;
  tl_thread = &t;
  tl_fence_pending = false;
  try {
    L->kernel(L->params);
  } catch (const LaunchAborted&) {
  } catch (const std::exception& e) {
    L->fail(kException, fmt("block %u thread %u: uncaught C++ exception: %s", b->idx.x, tid, e.what()));
  } catch (...) {
    L->fail(kException, fmt("block %u thread %u: uncaught C++ exception", b->idx.x, tid));
  }
  on_thread_exit(&t);
  tl_thread = nullptr;
}

// One static instance of T per block index: the storage behind EMU_SHARED. Zero-initialised
// static storage needs no guard (T has no constructor, as __shared__ variables may not), so no
// lock is taken on first use, which would order blocks that the kernel does not order.
template <class T>
struct PerBlock {
  T slot[kMaxBlocks];
  T& get() { return slot[current_thread()->block->idx.x]; }
};

}  // namespace detail

// ============================================================================ public device API
inline void trap() {
  detail::Thread* t = detail::current_thread();
  std::unique_lock<std::mutex> none;
  detail::fail_here(none, kTrap, detail::fmt("trap: block %u thread %u called __trap()", t->block->idx.x, t->tid.x));
}

inline int load_acquire(const int* p) {
  if (detail::tl_thread) detail::check_abort(detail::tl_thread->block);
  return std::atomic_ref<int>(*const_cast<int*>(p)).load(std::memory_order_acquire);
}

inline unsigned long long global_timer_ns() {
  return static_cast<unsigned long long>(std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::steady_clock::now().time_since_epoch()).count());
}

// Per-block buffer for dynamic shared memory; the size may not grow within a launch.
inline void* dynamic_shared(std::size_t bytes) {
  detail::Thread* t = detail::current_thread();
  detail::Block* b = t->block;
  std::unique_lock<std::mutex> lk(b->mu);
  if (bytes > b->dyn_smem_bytes) {
    if (b->dyn_smem != nullptr)
      detail::fail_here(lk, kBadLaunch, detail::fmt("block %u thread %u: dynamic shared memory grew from %zu to %zu "
                                                    "bytes within one launch", b->idx.x, t->tid.x, b->dyn_smem_bytes, bytes));
    b->dyn_smem_bytes = (bytes + 127) & ~std::size_t{127};
    b->dyn_smem = std::aligned_alloc(128, b->dyn_smem_bytes);
    std::memset(b->dyn_smem, 0, b->dyn_smem_bytes);
  }
  return b->dyn_smem;
}

inline const char* last_error() { return detail::tl_last_error.c_str(); }

// Runs kernel(params) on grid x block CUDA threads, one OS thread each, all started before any
// is joined. Returns 0, or a Code with last_error() set. kStuck: threads that ignored the abort
// were detached; the caller must end the process.
inline int launch(void (*kernel)(const void*), int grid, int block, const void* params, double timeout_s) {
  using namespace detail;
  tl_last_error.clear();
  if (grid < 1 || grid > kMaxBlocks || block < 1 || block > 1024) {
    tl_last_error = fmt("bad launch configuration: grid %d, block %d (strict mode needs 1 <= grid <= %d, "
                        "1 <= block <= 1024)", grid, block, kMaxBlocks);
    return kBadLaunch;
  }
  auto L = std::make_shared<Launch>();
  L->kernel = kernel;
  L->params = params;
  L->grid = grid;
  L->block = block;
  L->blocks.reset(new Block[grid]);
  for (int bi = 0; bi < grid; ++bi) {
    Block& b = L->blocks[bi];
    b.launch = L.get();
    b.idx = ::uint3{static_cast<unsigned int>(bi), 0, 0};
    b.dim = ::dim3(block, 1, 1);
    b.grid = ::dim3(grid, 1, 1);
    b.nthreads = block;
    b.nwarps = (block + 31) / 32;
    b.live = block;
    b.warps.reset(new Warp[b.nwarps]);
    for (int wi = 0; wi < b.nwarps; ++wi) {
      const int lanes = std::min(32, block - wi * 32);
      b.warps[wi].exists = lanes == 32 ? ~0u : (1u << lanes) - 1u;
    }
  }
  const int total = grid * block;
  std::vector<std::thread> threads;
  threads.reserve(total);
  try {
    for (int bi = 0; bi < grid; ++bi)
      for (int t = 0; t < block; ++t)
        threads.emplace_back([L, bi, t] {
          run_thread(L.get(), &L->blocks[bi], static_cast<unsigned int>(t));
          std::lock_guard<std::mutex> lk(L->mu);
          ++L->threads_done;
          L->cv.notify_all();
        });
  } catch (const std::exception& e) {
    L->fail(kBadLaunch, fmt("cannot start %d threads: %s", total, e.what()));
    for (auto& t : threads) t.join();
    tl_last_error = L->error;
    return L->code;
  }
  auto all_done = [&] { return L->threads_done == total; };
  {
    std::unique_lock<std::mutex> lk(L->mu);
    bool done = true;
    if (std::isfinite(timeout_s) && timeout_s > 0)
      done = L->cv.wait_for(lk, std::chrono::duration<double>(timeout_s), all_done);
    else
      L->cv.wait(lk, all_done);
    if (!done) {
      lk.unlock();
      L->fail(kTimeout, fmt("launch exceeded %s s host timeout", seconds_text(timeout_s).c_str()));
      lk.lock();
      if (!L->cv.wait_for(lk, std::chrono::seconds(5), all_done)) {
        L->error += fmt("; %d of %d threads did not stop within 5 s of the abort; they were detached",
                        total - L->threads_done, total);
        L->code = kStuck;
        lk.unlock();
        for (auto& t : threads) t.detach();
        tl_last_error = L->error;
        return kStuck;
      }
    }
  }
  for (auto& t : threads) t.join();
  tl_last_error = L->error;
  return L->code;
}

template <class F> struct kernel_arg;
template <class P> struct kernel_arg<void (*)(P)> { using type = P; };
template <class P> struct kernel_arg<void (*)(P) noexcept> { using type = P; };

template <auto K>
void kernel_entry(const void* params) {
  using P = typename kernel_arg<decltype(K)>::type;
  if constexpr (std::is_pointer_v<P>) {
    K(static_cast<P>(const_cast<void*>(params)));
  } else {
    K(*static_cast<const std::remove_cvref_t<P>*>(params));
  }
}

}  // namespace emu

// ============================================================================ CUDA built-ins
#define threadIdx (static_cast<const ::uint3&>(::emu::detail::current_thread()->tid))
#define blockIdx (static_cast<const ::uint3&>(::emu::detail::current_thread()->block->idx))
#define blockDim (static_cast<const ::dim3&>(::emu::detail::current_thread()->block->dim))
#define gridDim (static_cast<const ::dim3&>(::emu::detail::current_thread()->block->grid))

// `__shared__ T NAME DIMS;` as rewritten by strict.py: this block's instance of a per-block array.
#define EMU_SHARED(T, NAME, DIMS)                              \
  static ::emu::detail::PerBlock<T DIMS> emu_shared_##NAME;  \
  T(&NAME) DIMS = emu_shared_##NAME.get()

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

inline void __threadfence() { emu::detail::tl_fence_pending = true; }
inline void __threadfence_block() { emu::detail::tl_fence_pending = true; }
inline void __threadfence_system() { emu::detail::tl_fence_pending = true; }

inline void __nanosleep(unsigned int /*ns*/) {
  if (emu::detail::tl_thread) emu::detail::check_abort(emu::detail::tl_thread->block);
  std::this_thread::yield();
}

[[noreturn]] inline void __trap() {
  emu::trap();
  __builtin_unreachable();
}

inline long long clock64() { return static_cast<long long>(emu::global_timer_ns()); }

#define EMU_RMW_ORDER ::emu::detail::rmw_order()

inline unsigned int __activemask() {
  using namespace emu::detail;
  Thread* t = current_thread();
  Warp& w = t->block->warps[t->tid.x >> 5];
  std::lock_guard<std::mutex> lk(w.mu);
  return w.exists & ~w.exited;
}

// glibc's assert() calls __assert_fail, which may not throw: report and end the process.
extern "C" __attribute__((noreturn)) void __assert_fail(const char* expr, const char* file, unsigned int line,
                                                       const char* func) noexcept {
  using namespace emu::detail;
  Thread* t = tl_thread;
  if (t)
    std::fprintf(stderr, "emu: block %u thread %u: assertion `%s' failed at %s:%u in %s\n", t->block->idx.x,
                 t->tid.x, expr, file, line, func);
  else
    std::fprintf(stderr, "%s:%u: %s: assertion `%s' failed\n", file, line, func, expr);
  std::fflush(stderr);
  std::_Exit(emu::kAssert);
}
