// cuda_cpu_common.h: what the two runtimes of cuda_cpu.h share, the fiber runtime and the strict
// one (cuda_cpu_strict.h): error codes and messages, the state of a block's barrier and of a
// warp's exchange buffer, the host side of a launch (start, timeout, abort, detach) and the
// adapter from a kernel's signature to launch(). Each runtime adds how its CUDA threads run and
// wait. Included by cuda_cpu.h after the standard headers and the vector types.
#pragma once

namespace emu {

// Thrown at a yield point once the launch is aborted; caught where the CUDA thread starts.
// Deliberately not derived from std::exception so kernel code cannot swallow it by accident.
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

inline thread_local std::string tl_last_error;

// Shared memory holds garbage when a block starts on a GPU. Both runtimes fill each __shared__
// variable with this byte when a block first reaches its declaration (build.py and strict.py
// rewrite `__shared__ T name[dims];` into EMU_SHARED), so a kernel that reads shared memory it
// did not write sees NaN (float) or -1 (int), not a zero or a value left by an earlier block.
constexpr unsigned char kSharedPoison = 0xFF;

// A number for every block of every launch, so a block's shared variables know they are stale.
inline std::atomic<std::uint64_t> g_block_serial{0};
inline std::uint64_t next_block_serial() { return g_block_serial.fetch_add(1, std::memory_order_relaxed) + 1; }

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

// What a launch's host side and its CUDA threads share. Each runtime's Launch derives from it and
// adds fail(): record_error, then make every CUDA thread unwind.
struct LaunchRecord {
  LaunchRecord(void (*k)(const void*), const void* p, int g, int b) : kernel(k), params(p), grid(g), block(b) {}
  void (*kernel)(const void*);
  const void* params;
  int grid, block;
  std::atomic<bool> abort{false};
  std::atomic<bool> started{false};  // every host thread exists (run_host_threads' start gate)
  std::mutex mu;
  std::condition_variable cv;
  int threads_done = 0;  // host threads (run_host_threads) that returned
  int code = kOk;
  std::string error;

  // First error wins.
  void record_error(int c, const std::string& msg) {
    std::lock_guard<std::mutex> lk(mu);
    if (code == kOk) {
      code = c;
      error = msg;
    }
  }
};

// The __syncthreads state of a block (each runtime's Block derives from it). Two slots alternate
// by generation: results of generation g stay readable while generation g + 1 collects.
struct BarrierState {
  int bar_arrived = 0;
  unsigned int bar_gen = 0;
  int bar_count[2] = {0, 0}, bar_or[2] = {0, 0}, bar_and[2] = {1, 1};
  int bar_result_count[2] = {0, 0}, bar_result_or[2] = {0, 0}, bar_result_and[2] = {1, 1};

  // Adds one thread's predicate to slot s (= bar_gen & 1).
  void deposit(int s, int pred) {
    bar_count[s] += pred != 0;
    bar_or[s] |= pred != 0;
    bar_and[s] &= pred != 0;
  }
  // The last thread arrived: publish slot s, clear it and open the next generation.
  void complete(int s) {
    bar_result_count[s] = bar_count[s];
    bar_result_or[s] = bar_or[s];
    bar_result_and[s] = bar_and[s];
    bar_count[s] = 0;
    bar_or[s] = 0;
    bar_and[s] = 1;
    bar_arrived = 0;
    ++bar_gen;
  }
  // Valid until generation gen + 2 completes, which needs the reader to arrive twice more.
  void results(int s, int* count, int* all, int* any) const {
    if (count) *count = bar_result_count[s];
    if (all) *all = bar_result_and[s];
    if (any) *any = bar_result_or[s];
  }
};

// A cp.async copy of 16 bytes issued and not yet landed (cuda_cpu_mma.h emu::cp_async_16): its
// destination and the source bytes it read at the issue.
struct AsyncCopy {
  void* dst;
  unsigned char bytes[16];
};

// A CUDA thread's copies not landed yet, in issue order, and where each group it committed
// (cp.async.commit_group) ends in that list; the copies past the last end are in no group.
struct AsyncCopies {
  std::vector<AsyncCopy> pending;
  std::vector<std::size_t> group_ends;
  void clear() {
    pending.clear();
    group_ends.clear();
  }
};

// The exchange buffer of one warp. One collective is open at a time; the lane that completes it
// computes every lane's result, so the buffer is free again at once. Two kinds of collective use
// it: the shuffles, votes and reductions deposit 64 bits (plus a shuffle argument and width) and
// get 64 bits computed lane by lane; a wide exchange (warp_exchange: the tensor-core twins of
// kernel/mma.cuh) deposits up to kLaneInBytes per lane and gets up to kLaneOutBytes, computed for
// the whole warp in one call (an mma is one 16x8 product, not 32 separate ones).
struct Warp;
using WarpCompute = std::uint64_t (*)(const Warp&, unsigned int lane);
using WarpComputeAll = void (*)(Warp&);

struct Warp {
  // mma.m16n8k16 deposits its A, B and C fragments (4 + 2 + 4 words); ldmatrix.x4 a 16-byte row.
  static constexpr std::size_t kLaneInBytes = 48, kLaneOutBytes = 16;

  unsigned int exists = 0;       // lanes that exist (a partial last warp has fewer)
  unsigned int exited = 0;       // lanes whose CUDA thread returned
  bool open = false;             // a collective is collecting deposits
  unsigned int mask = 0, arrived = 0;
  unsigned int seq = 0;          // collectives completed so far
  const char* op = "";
  std::uint64_t vals[32];        // deposits of the open collective
  int args[32];                  // each lane's source lane / delta / lane mask
  int widths[32];
  std::uint64_t results[32];     // lane l's result stays valid until l enters another collective
  alignas(16) unsigned char wide_in[32][kLaneInBytes];    // a wide exchange's deposits
  alignas(16) unsigned char wide_out[32][kLaneOutBytes];  // and results (valid as `results`)

  // Opens a collective of the lanes in `need`.
  void begin(unsigned int need, const char* collective) {
    open = true;
    mask = need;
    arrived = 0;
    op = collective;
  }
  // Lane `lane` deposits its value, shuffle argument and width. True when it was the last lane
  // of the mask: then every lane's result is computed and the collective is closed.
  bool deposit(unsigned int lane, std::uint64_t val, int arg, int width, WarpCompute compute) {
    vals[lane] = val;
    args[lane] = arg;
    widths[lane] = width;
    if (!arrive(lane)) return false;
    for (unsigned int m = mask; m != 0; m &= m - 1) {
      const unsigned int l = static_cast<unsigned int>(__builtin_ctz(m));
      results[l] = compute(*this, l);
    }
    close();
    return true;
  }
  // The same for a wide exchange: `bytes` (at most kLaneInBytes) from `in`; the last lane runs
  // `compute` once, which fills wide_out of every lane in the mask.
  bool deposit_wide(unsigned int lane, const void* in, std::size_t bytes, WarpComputeAll compute) {
    std::memcpy(wide_in[lane], in, bytes);
    if (!arrive(lane)) return false;
    compute(*this);
    close();
    return true;
  }

 private:
  bool arrive(unsigned int lane) {
    arrived |= 1u << lane;
    return arrived == mask;
  }
  void close() {
    open = false;
    ++seq;
  }
};

// Warp collective errors that both runtimes detect alike.
inline std::string not_in_mask_message(int warp, unsigned int block, unsigned int lane, const char* op,
                                       unsigned int mask) {
  return fmt("warp %d of block %u: lane %u calls %s with mask 0x%08x, which does not name it", warp, block, lane, op,
             mask);
}
inline std::string other_collective_message(int warp, unsigned int block, unsigned int lane, const char* op,
                                            const Warp& w) {
  return fmt("warp %d of block %u: lane %u reached %s while lanes %s wait at %s (mask 0x%08x)", warp, block, lane,
             op, lane_list(w.arrived).c_str(), w.op, w.mask);
}

// A wide exchange (mma, ldmatrix) is .sync.aligned: all 32 lanes of the warp execute it.
inline std::string partial_warp_message(int warp, unsigned int block, const char* op, unsigned int exists) {
  return fmt("warp %d of block %u: %s needs all 32 lanes of the warp, but only lanes %s exist (the block's "
             "size is not a multiple of 32)", warp, block, op, lane_list(exists).c_str());
}

// One CUDA thread's run of the kernel: an abort unwinds quietly, any other exception fails the launch.
template <class LaunchT>
inline void run_kernel(LaunchT* L, unsigned int block, unsigned int thread) {
  try {
    L->kernel(L->params);
  } catch (const LaunchAborted&) {
  } catch (const std::exception& e) {
    L->fail(kException, fmt("block %u thread %u: uncaught C++ exception: %s", block, thread, e.what()));
  } catch (...) {
    L->fail(kException, fmt("block %u thread %u: uncaught C++ exception", block, thread));
  }
}

// The host side of a launch: starts n OS threads running work(i), all before any is joined, and
// waits for them, at most timeout_s seconds when that is finite and positive. Then it fails the
// launch with kTimeout (every CUDA thread unwinds at its next yield point) and waits 5 s more;
// threads still running are detached (kStuck; the caller must end the process), kept safe by
// their copy of L. `noun` names the threads in the start error; stuck_message(still, n) is
// appended to the timeout error. Returns L->code and leaves L->error in tl_last_error.
//
// No thread runs work(i) before the last one is created (the start gate, an acquire of
// L->started). Without it a thread could run its kernel to the end before the next was created:
// its exit releases L's reference count, the host's copy of L for the next thread acquires it,
// and the new thread inherits the whole kernel of the finished one as happened-before, so TSan
// (strict mode) missed a race between them, in about 1 of 6 runs of a two-thread race on two
// cores and every run on one (issue 17, test_dynamic_shared_memory_orders_no_accesses in CI).
inline void open_start_gate(LaunchRecord& L) {
  L.started.store(true, std::memory_order_release);
  L.started.notify_all();
}

template <class LaunchT, class Work, class StuckMessage>
inline int run_host_threads(const std::shared_ptr<LaunchT>& L, int n, double timeout_s, const char* noun,
                            Work work, StuckMessage stuck_message) {
  std::vector<std::thread> threads;
  threads.reserve(n);
  try {
    for (int i = 0; i < n; ++i)
      threads.emplace_back([L, i, work] {
        L->started.wait(false, std::memory_order_acquire);
        work(i);
        std::lock_guard<std::mutex> lk(L->mu);
        ++L->threads_done;
        L->cv.notify_all();
      });
  } catch (const std::exception& e) {
    L->fail(kBadLaunch, fmt("cannot start %d %s: %s", n, noun, e.what()));
    open_start_gate(*L);
    for (auto& t : threads) t.join();
    tl_last_error = L->error;
    return L->code;
  }
  open_start_gate(*L);
  auto all_done = [&] { return L->threads_done == n; };
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
        L->error += stuck_message(n - L->threads_done, n);
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

}  // namespace detail

inline unsigned long long global_timer_ns() {
  return static_cast<unsigned long long>(std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::steady_clock::now().time_since_epoch()).count());
}

inline const char* last_error() { return detail::tl_last_error.c_str(); }

// Adapts `extern "C" __global__ void k(const Params* p)` (or `k(Params p)`) to launch().
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
