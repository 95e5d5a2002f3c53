// probes.cu - small CUDA kernels that measure the GPU itself (compiled by cuda_backend.py with
// NVRTC; they never run on the emulator).
//
//   mk_hold(ns)              one thread spins on %globaltimer for ns nanoseconds: launched before
//                            a timed batch, it holds the stream while the host queues the batch,
//                            so the events around the batch time GPU work only, never the host's
//                            submission (bench's device time).
//   mk_timer_tick(out, n)    thread 0 reads %globaltimer n times; out[0] = smallest non-zero
//                            step seen (the timer's tick, ns), out[1] = number of distinct values.
//   mk_l2_read(buf, words, stride, reps, sink)
//                            every block reads `words` 16-byte words at buf + block x stride
//                            (stride 0: every block the same words) `reps` times through L2
//                            (ld.global.cg: never L1), folded into its threads' sink words, and
//                            writes its SM (%smid) to smid[block]: the L2 read rate of one SM, of
//                            every SM from its own lines, and of every SM from one shared set of
//                            lines (the cost model's l2_bw and the broadcast that every token
//                            group's input is; CupyDevice.l2_read).

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

extern "C" __global__ void mk_l2_read(const uint4* buf, long long words, long long stride,
                                      int reps, unsigned* sink, unsigned* smid) {
  constexpr int IN_FLIGHT = 8;  // 16-byte loads a thread issues before it uses the first
  const uint4* p = buf + blockIdx.x * stride;
  const long long step = blockDim.x, group = IN_FLIGHT * step;
  unsigned acc = 0u;
  for (int r = 0; r < reps; ++r) {
    long long i = threadIdx.x;
    for (; i + (IN_FLIGHT - 1) * step < words; i += group) {
      uint4 v[IN_FLIGHT];
#pragma unroll
      for (int k = 0; k < IN_FLIGHT; ++k) v[k] = __ldcg(p + i + k * step);
#pragma unroll
      for (int k = 0; k < IN_FLIGHT; ++k) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
    }
    for (; i < words; i += step) {
      const uint4 v = __ldcg(p + i);
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
  }
  sink[blockIdx.x * blockDim.x + threadIdx.x] = acc;
  if (threadIdx.x == 0) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    smid[blockIdx.x] = sm;
  }
}
