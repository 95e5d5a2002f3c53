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
namespace detail {

// Blocks per launch: EMU_SHARED keeps one static instance per block index.
constexpr int kMaxBlocks = 64;

// The shared Warp exchange buffer (the shuffle functions read it), plus its lock.
struct LockedWarp : Warp {
  std::mutex mu;
  std::condition_variable cv;
};

struct Block;

// One host thread per CUDA thread.
struct Launch : LaunchRecord {
  using LaunchRecord::LaunchRecord;
  std::unique_ptr<Block[]> blocks;

  inline void fail(int c, const std::string& msg);
};

struct Block : BarrierState {
  Launch* launch = nullptr;
  ::uint3 idx{0, 0, 0};
  ::dim3 dim, grid;
  int nthreads = 0, nwarps = 0;
  std::unique_ptr<LockedWarp[]> warps;
  std::mutex mu;  // everything below, and the barrier state
  std::condition_variable cv;
  int live = 0, exited = 0;
  void* dyn_smem = nullptr;
  std::size_t dyn_smem_bytes = 0;  // written once, before dyn_smem_ready's release
  std::atomic<void*> dyn_smem_ready{nullptr};  // dyn_smem, once allocated (dynamic_shared)
  std::mutex dyn_mu;  // dynamic_shared's allocation, and nothing else
  std::uint64_t serial = 0;  // next_block_serial(): this block of this launch
  ~Block() { std::free(dyn_smem); }
};

// First error wins; then every waiting thread is woken to unwind. The notifies take each lock,
// so a waiter that just found `abort` false cannot miss its wake-up. Callers hold no lock.
inline void Launch::fail(int c, const std::string& msg) {
  record_error(c, msg);
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
  AsyncCopies copies;  // its cp.async copies not landed yet (dropped at its exit)
};

inline thread_local Thread* tl_thread = nullptr;
inline thread_local bool tl_fence_pending = false;

inline Thread* current_thread() {
  Thread* t = tl_thread;
  if (t == nullptr) {
    std::fprintf(stderr, "emu: a device function that needs a CUDA thread was called outside a launch\n");
    std::abort();
  }
  return t;
}

inline AsyncCopies& async_copies() { return current_thread()->copies; }

inline bool aborting(const Block* b) { return b->launch->abort.load(std::memory_order_relaxed); }

inline void check_abort(const Block* b) {
  if (aborting(b)) throw LaunchAborted{};
}

// Records the error and unwinds. Callers hold no lock (Launch::fail takes every block and warp lock).
[[noreturn]] inline void fail_here(int code, const std::string& msg) {
  current_thread()->block->launch->fail(code, msg);
  throw LaunchAborted{};
}

// The same from under a lock: releases `lk` first.
template <class Lock>
[[noreturn]] inline void fail_here(Lock& lk, int code, const std::string& msg) {
  if (lk.owns_lock()) lk.unlock();
  fail_here(code, msg);
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
  b->deposit(s, pred);
  if (++b->bar_arrived == b->live) {
    if (b->exited > 0) fail_here(lk, kDivergentBarrier, divergent_barrier_message(b));
    b->complete(s);
    b->cv.notify_all();
  } else {
    b->cv.wait(lk, [&] { return b->bar_gen != gen || aborting(b); });
    check_abort(b);
  }
  b->results(s, count, all, any);
}

// One warp collective, with the fiber runtime's semantics (cuda_cpu.h warp_rendezvous): every
// lane named in `mask` deposits, the last to arrive computes every lane's result; collect(warp,
// lane) reads this lane's under the warp's lock.
template <class Deposit, class Collect>
inline auto warp_rendezvous(const char* op, unsigned int mask, bool whole_warp, Deposit deposit, Collect collect) {
  Thread* t = current_thread();
  Block* b = t->block;
  const int warp = static_cast<int>(t->tid.x) >> 5;
  const unsigned int lane = t->tid.x & 31u, bit = 1u << lane;
  LockedWarp& w = b->warps[warp];
  std::unique_lock<std::mutex> lk(w.mu);
  check_abort(b);
  if (!(mask & bit))
    fail_here(lk, kWarpError, not_in_mask_message(warp, b->idx.x, lane, op, mask));
  if (whole_warp && w.exists != ~0u)
    fail_here(lk, kWarpError, partial_warp_message(warp, b->idx.x, op, w.exists));
  const unsigned int need = mask & w.exists;
  for (;;) {
    if (!w.open) {
      if (need & w.exited)
        fail_here(lk, kWarpError, fmt("warp %d of block %u: lanes %s named in mask 0x%08x exited before %s",
                                      warp, b->idx.x, lane_list(need & w.exited).c_str(), need, op));
      w.begin(need, op);
      break;
    }
    if (w.mask == need && !(w.arrived & bit)) {
      if (w.op != op && std::strcmp(w.op, op) != 0)
        fail_here(lk, kWarpError, other_collective_message(warp, b->idx.x, lane, op, w));
      break;
    }
    const unsigned int seq = w.seq;  // another collective (other mask) is open: wait for it
    w.cv.wait(lk, [&] { return w.seq != seq || aborting(b); });
    check_abort(b);
  }
  if (deposit(static_cast<Warp&>(w), lane)) {
    w.cv.notify_all();
  } else {
    const unsigned int seq = w.seq;
    w.cv.wait(lk, [&] { return w.seq != seq || aborting(b); });
    check_abort(b);
  }
  return collect(static_cast<const Warp&>(w), lane);
}

inline std::uint64_t warp_collective(const char* op, unsigned int mask, std::uint64_t val, int arg, int width,
                                     WarpCompute compute) {
  return warp_rendezvous(
      op, mask, false, [&](Warp& w, unsigned int lane) { return w.deposit(lane, val, arg, width, compute); },
      [](const Warp& w, unsigned int lane) { return w.results[lane]; });
}

// A wide exchange of the whole warp (cuda_cpu.h warp_exchange).
inline void warp_exchange(const char* op, const void* in, std::size_t in_bytes, void* out, std::size_t out_bytes,
                          WarpComputeAll compute) {
  warp_rendezvous(
      op, ~0u, true, [&](Warp& w, unsigned int lane) { return w.deposit_wide(lane, in, in_bytes, compute); },
      [&](const Warp& w, unsigned int lane) {
        std::memcpy(out, w.wide_out[lane], out_bytes);
        return 0;
      });
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
  LockedWarp& w = b->warps[t->tid.x >> 5];
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
  run_kernel(L, b->idx.x, tid);
  on_thread_exit(&t);
  tl_thread = nullptr;
}

// One static instance of T per block index: the storage behind EMU_SHARED. Zero-initialised
// static storage needs no guard (T has no constructor, as __shared__ variables may not), so no
// lock is taken on first use, which would order blocks that the kernel does not order. The
// first of a block's threads to reach the declaration fills the slot with kSharedPoison, under
// the slot's own lock; the others see its release of `serial` (acquire) and skip it, so the
// poisoning happens before their accesses and is no race, while their accesses to the slot
// stay unordered by it. The lock is the slot's, not the block's: a thread waiting for it could
// otherwise acquire what the poisoner did after, up to its poisoning of the next __shared__.
template <class T>
struct PerBlock {
  T slot[kMaxBlocks];
  std::atomic<std::uint64_t> serial[kMaxBlocks];
  std::mutex poison[kMaxBlocks];
  T& get() {
    Block* b = current_thread()->block;
    const unsigned i = b->idx.x;
    if (serial[i].load(std::memory_order_acquire) != b->serial) {
      std::lock_guard<std::mutex> lk(poison[i]);
      if (serial[i].load(std::memory_order_relaxed) != b->serial) {
        std::memset(static_cast<void*>(&slot[i]), kSharedPoison, sizeof(T));
        serial[i].store(b->serial, std::memory_order_release);
      }
    }
    return slot[i];
  }
};

}  // namespace detail

// ============================================================================ public device API
inline void trap() {
  detail::Thread* t = detail::current_thread();
  detail::fail_here(kTrap, detail::fmt("trap: block %u thread %u called __trap()", t->block->idx.x, t->tid.x));
}

inline int load_acquire(const int* p) {
  if (detail::tl_thread) detail::check_abort(detail::tl_thread->block);
  return std::atomic_ref<int>(*const_cast<int*>(p)).load(std::memory_order_acquire);
}

// *p += v as a release read-modify-write (megakernel.cu red_add_release: red.release.gpu).
inline void red_add_release(int* p, int v) {
  if (detail::tl_thread) detail::check_abort(detail::tl_thread->block);
  std::atomic_ref<int>(*p).fetch_add(v, std::memory_order_release);
}

// Returns *p, then *p += v, as an acq_rel read-modify-write (megakernel.cu ticket_add:
// atom.acq_rel.gpu).
inline int atom_add_acq_rel(int* p, int v) {
  if (detail::tl_thread) detail::check_abort(detail::tl_thread->block);
  return std::atomic_ref<int>(*p).fetch_add(v, std::memory_order_acq_rel);
}

// Per-block buffer for dynamic shared memory; the size may not grow within a launch. Only the
// first calls take a lock, the block's allocation lock `dyn_mu` (the first allocates, then
// releases `dyn_smem_ready`); later calls acquire that one store and nothing else. A lock on
// every call would order each caller's earlier accesses before every later caller's: the kernel
// calls dynamic_smem() between a fill and its reads, so a missing barrier there went unreported
// whenever the writers happened to call it first (issue 17, a flaky negative control in CI).
// Nor may the lock be the block's `mu`: a thread waiting for it could acquire another thread's
// exit or barrier arrival, everything that thread did before, and hide a race with it.
inline void* dynamic_shared(std::size_t bytes) {
  detail::Thread* t = detail::current_thread();
  detail::Block* b = t->block;
  if (void* p = b->dyn_smem_ready.load(std::memory_order_acquire); p != nullptr && bytes <= b->dyn_smem_bytes)
    return p;
  std::unique_lock<std::mutex> lk(b->dyn_mu);
  if (bytes > b->dyn_smem_bytes) {
    if (b->dyn_smem != nullptr)
      detail::fail_here(lk, kBadLaunch, detail::fmt("block %u thread %u: dynamic shared memory grew from %zu to %zu "
                                                    "bytes within one launch", b->idx.x, t->tid.x, b->dyn_smem_bytes, bytes));
    b->dyn_smem_bytes = (bytes + 127) & ~std::size_t{127};
    b->dyn_smem = std::aligned_alloc(128, b->dyn_smem_bytes);
    std::memset(b->dyn_smem, 0, b->dyn_smem_bytes);
    b->dyn_smem_ready.store(b->dyn_smem, std::memory_order_release);
  }
  return b->dyn_smem;
}

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
  auto L = std::make_shared<Launch>(kernel, params, grid, block);
  L->blocks.reset(new Block[grid]);
  for (int bi = 0; bi < grid; ++bi) {
    Block& b = L->blocks[bi];
    b.launch = L.get();
    b.serial = next_block_serial();
    b.idx = ::uint3{static_cast<unsigned int>(bi), 0, 0};
    b.dim = ::dim3(block, 1, 1);
    b.grid = ::dim3(grid, 1, 1);
    b.nthreads = block;
    b.nwarps = (block + 31) / 32;
    b.live = block;
    b.warps.reset(new LockedWarp[b.nwarps]);
    for (int wi = 0; wi < b.nwarps; ++wi) {
      const int lanes = std::min(32, block - wi * 32);
      b.warps[wi].exists = lanes == 32 ? ~0u : (1u << lanes) - 1u;
    }
  }
  return run_host_threads(
      L, grid * block, timeout_s, "threads",
      [L, block](int i) {
        run_thread(L.get(), &L->blocks[i / block], static_cast<unsigned int>(i % block));
      },
      [](int stuck, int n) {
        return fmt("; %d of %d threads did not stop within 5 s of the abort; they were detached", stuck, n);
      });
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

inline void __threadfence() { emu::detail::tl_fence_pending = true; }
inline void __threadfence_block() { emu::detail::tl_fence_pending = true; }
inline void __threadfence_system() { emu::detail::tl_fence_pending = true; }

inline void __nanosleep(unsigned int /*ns*/) {
  if (emu::detail::tl_thread) emu::detail::check_abort(emu::detail::tl_thread->block);
  std::this_thread::yield();
}

#define EMU_RMW_ORDER ::emu::detail::rmw_order()

inline unsigned int __activemask() {
  using namespace emu::detail;
  Thread* t = current_thread();
  LockedWarp& w = t->block->warps[t->tid.x >> 5];
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
