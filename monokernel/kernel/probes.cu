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
//                            (ld.global.cg: never L1), summed into its threads' sink words, and
//                            writes its SM (%smid) to smid[block]: the L2 read rate of one SM, of
//                            every SM from its own lines, and of every SM from one shared set of
//                            lines (the cost model's l2_bw and the broadcast that every token
//                            group's input is; CupyDevice.l2_read).
//   mk_hbm_stream(buf, block_bytes, mode, chunk, stage_bytes, stages, sink, smid)
//                            every block streams its own block_bytes at buf + block x block_bytes
//                            once, from HBM (the buffer is far past L2), one of three ways: mode
//                            0 16-byte ld.global.cg loads into registers, PROBE_LOADS a thread in
//                            flight; mode 1 16-byte cp.async.cg into a ring of `stages` (2 or 4)
//                            stages of stage_bytes in dynamic shared memory, all but the one
//                            being read in flight; mode 2 cp.async.bulk copies of `chunk` bytes
//                            into the same ring, an mbarrier a stage. What it reads is summed
//                            (mod 2^32) into sink; smid as mk_l2_read's. The rate of a K/V-
//                            shaped stream from every SM each way (CupyDevice.hbm_stream; the
//                            cost model charges K/V at gemv_bw, lever 2 at hbm_bw: NOTES.md).
//   mk_cluster_place(out, timeout_ns)
//                            launched in thread-block clusters (CupyDevice.cluster_placement):
//                            each block's thread 0 counts itself in (out[4 x gridDim], zeroed by
//                            the host), waits up to timeout_ns for the grid's other blocks, then
//                            writes (%smid, %clusterid.x, %cluster_ctarank, blocks counted in
//                            when it stopped waiting) to out[4 x block]: gridDim in every block
//                            if the whole grid was resident at once, as a persistent grid must.

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

#define PROBE_LOADS 8  // 16-byte loads a thread issues before it uses the first

// The sum (mod 2^32) of a thread's 16-byte words of p[0, words): words threadIdx.x, + blockDim.x,
// ..., by ld.global.cg (L2, never L1), PROBE_LOADS in flight; added to acc.
__device__ __forceinline__ unsigned probe_read(const uint4* p, long long words, unsigned acc) {
  const long long step = blockDim.x, group = PROBE_LOADS * step;
  long long i = threadIdx.x;
  for (; i + (PROBE_LOADS - 1) * step < words; i += group) {
    uint4 v[PROBE_LOADS];
#pragma unroll
    for (int k = 0; k < PROBE_LOADS; ++k) v[k] = __ldcg(p + i + k * step);
#pragma unroll
    for (int k = 0; k < PROBE_LOADS; ++k) acc += v[k].x + v[k].y + v[k].z + v[k].w;
  }
  for (; i < words; i += step) {
    const uint4 v = __ldcg(p + i);
    acc += v.x + v.y + v.z + v.w;
  }
  return acc;
}

// A probe block's end: its threads' sums into sink (so no read is dead code), its SM into smid.
__device__ __forceinline__ void probe_finish(unsigned* sink, unsigned* smid, unsigned acc) {
  sink[blockIdx.x * blockDim.x + threadIdx.x] = acc;
  if (threadIdx.x == 0) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    smid[blockIdx.x] = sm;
  }
}

extern "C" __global__ void mk_l2_read(const uint4* buf, long long words, long long stride,
                                      int reps, unsigned* sink, unsigned* smid) {
  const uint4* p = buf + blockIdx.x * stride;
  unsigned acc = 0u;
  for (int r = 0; r < reps; ++r) acc = probe_read(p, words, acc);
  probe_finish(sink, smid, acc);
}

// Modes 1 and 2: ring stages at most (the mbarriers, the cp.async wait depth); from
// devices/cuda.py, which runs rings of 2 and of HBM_MAX_STAGES stages only
#ifndef HBM_MAX_STAGES
#error "HBM_MAX_STAGES: devices/cuda.py passes it as -DHBM_MAX_STAGES"
#endif

__device__ __forceinline__ unsigned probe_smem(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// This thread's 16-byte words of ring stage `at` (stage_bytes), summed into acc.
__device__ __forceinline__ unsigned probe_fold(const unsigned char* at, int stage_bytes,
                                               unsigned acc) {
  for (int i = threadIdx.x * 16; i < stage_bytes; i += blockDim.x * 16) {
    const uint4 v = *reinterpret_cast<const uint4*>(at + i);
    acc += v.x + v.y + v.z + v.w;
  }
  return acc;
}

// Mode 1: stage s of the block's bytes, this thread's 16-byte words, by cp.async.cg into its ring
// slot; one commit group a stage (an empty group past the end keeps the count uniform).
__device__ __forceinline__ void probe_cp_async_stage(const unsigned char* src, long long n_stages,
                                                     long long s, unsigned char* ring,
                                                     int stage_bytes, int stages) {
  if (s < n_stages) {
    unsigned char* dst = ring + (s % stages) * stage_bytes;
    for (int i = threadIdx.x * 16; i < stage_bytes; i += blockDim.x * 16)
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(probe_smem(dst + i)),
                   "l"(src + s * stage_bytes + i) : "memory");
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// Mode 2: stage s by cp.async.bulk, `chunk` bytes a copy, issued by warp 0: lane 0 arms the
// stage's mbarrier with the stage's bytes (its one arrival), then the lanes issue the copies.
__device__ __forceinline__ void probe_bulk_stage(const unsigned char* src, long long n_stages,
                                                 long long s, unsigned char* ring,
                                                 int stage_bytes, int stages, int chunk,
                                                 unsigned long long* bars) {
  if (s >= n_stages || threadIdx.x >= 32) return;
  const unsigned bar = probe_smem(bars + s % stages);
  if (threadIdx.x == 0)
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar),
                 "r"(stage_bytes) : "memory");
  __syncwarp();
  unsigned char* dst = ring + (s % stages) * stage_bytes;
  for (int i = threadIdx.x * chunk; i < stage_bytes; i += 32 * chunk)
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        ::"r"(probe_smem(dst + i)), "l"(src + s * stage_bytes + i), "r"(chunk), "r"(bar)
        : "memory");
}

__device__ __forceinline__ void probe_bulk_wait(unsigned long long* bar, unsigned parity) {
  unsigned done = 0;
  while (!done)
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}" : "=r"(done) : "r"(probe_smem(bar)), "r"(parity) : "memory");
}

extern "C" __global__ void mk_hbm_stream(const unsigned char* buf, long long block_bytes,
                                         int mode, int chunk, int stage_bytes, int stages,
                                         unsigned* sink, unsigned* smid) {
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ __align__(8) unsigned long long bars[HBM_MAX_STAGES];
  const unsigned char* src = buf + blockIdx.x * block_bytes;
  unsigned acc = 0u;
  // a ring this kernel does not wait on right writes nothing: its case cannot read as a rate
  if (mode != 0 && stages != 2 && stages != HBM_MAX_STAGES) return;
  if (mode == 0) {
    acc = probe_read(reinterpret_cast<const uint4*>(src), block_bytes / 16, acc);
  } else if (mode == 1) {
    // a thread reads back only the words it copied itself: its own cp.async.wait_group lands
    // them, no barrier
    const long long n = block_bytes / stage_bytes;
    for (int s = 0; s < stages - 1; ++s)
      probe_cp_async_stage(src, n, s, ring, stage_bytes, stages);
    for (long long s = 0; s < n; ++s) {
      probe_cp_async_stage(src, n, s + stages - 1, ring, stage_bytes, stages);
      if (stages == 2)  // stage s landed: at most the groups after it still in flight
        asm volatile("cp.async.wait_group 1;" ::: "memory");
      else
        asm volatile("cp.async.wait_group %0;" ::"n"(HBM_MAX_STAGES - 1) : "memory");
      acc = probe_fold(ring + (s % stages) * stage_bytes, stage_bytes, acc);
    }
  } else {
    const long long n = block_bytes / stage_bytes;
    if (threadIdx.x == 0) {
      for (int k = 0; k < stages; ++k)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(probe_smem(bars + k))
                     : "memory");
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the inits, to the copies
    }
    __syncthreads();
    for (int s = 0; s < stages; ++s)
      probe_bulk_stage(src, n, s, ring, stage_bytes, stages, chunk, bars);
    for (long long s = 0; s < n; ++s) {
      probe_bulk_wait(bars + s % stages, (unsigned)((s / stages) & 1));
      acc = probe_fold(ring + (s % stages) * stage_bytes, stage_bytes, acc);
      __syncthreads();  // every thread is done with the slot before its next stage lands there
      probe_bulk_stage(src, n, s + stages, ring, stage_bytes, stages, chunk, bars);
    }
  }
  probe_finish(sink, smid, acc);
}

extern "C" __global__ void mk_cluster_place(unsigned* out, long long timeout_ns) {
  if (threadIdx.x != 0) return;
  unsigned* count = out + 4 * gridDim.x;
  atomicAdd(count, 1u);
  const unsigned long long start = probe_timer_ns();
  unsigned seen;
  do {
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(count) : "memory");
  } while (seen < gridDim.x && (long long)(probe_timer_ns() - start) < timeout_ns);
  unsigned sm, cluster, rank;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(cluster));
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  unsigned* o = out + 4 * blockIdx.x;
  o[0] = sm;
  o[1] = cluster;
  o[2] = rank;
  o[3] = seen;
}
