// probes.cu - small CUDA kernels that measure the GPU itself (compiled by cuda_backend.py with
// NVRTC; they never run on the emulator).
//
//   mk_hold(ns)              one thread spins on %globaltimer for ns nanoseconds: launched before
//                            a timed batch, it holds the stream while the host queues the batch,
//                            so the events around the batch time GPU work only, never the host's
//                            submission (bench's device time).
//   mk_timer_tick(out, n)    thread 0 reads %globaltimer n times; out[0] = smallest non-zero
//                            step seen (the timer's tick, ns), out[1] = number of distinct values.

__device__ __forceinline__ unsigned long long probe_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

extern "C" __global__ void mk_hold(long long ns) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const unsigned long long start = probe_timer_ns();
  while ((long long)(probe_timer_ns() - start) < ns) {
  }
}

extern "C" __global__ void mk_timer_tick(unsigned long long* out, int n) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  unsigned long long prev = probe_timer_ns(), tick = ~0ull, distinct = 1;
  for (int i = 0; i < n; ++i) {
    const unsigned long long t = probe_timer_ns();
    if (t != prev) {
      if (t - prev < tick) tick = t - prev;
      ++distinct;
      prev = t;
    }
  }
  out[0] = tick;
  out[1] = distinct;
}
