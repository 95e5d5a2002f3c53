// megakernel.cu - one decode step of a Llama-family model as ONE persistent kernel.
//
// Every block pulls its own queue of instructions (built by scheduler.py) and runs them in
// order: parse, wait on a counter, compute, signal a counter. Blocks never leave the kernel
// between ops, so a whole decode step is one launch. The same device functions also run as one
// thin kernel per op (op_<NAME>) for the multi-kernel baseline.
//
// This file is compiled by NVRTC/nvcc for the GPU and by g++ with emulator/cuda_cpu.h for the
// CPU. The generated header (isa.py) is prepended: opcodes, word layout, model constants and
// the Params struct all come from there.
//
// Memory rules (ARCHITECTURE section 4): only weights are read through __ldg / const pointers.
// Everything written during a launch (activations, KV cache, counters, state) is read with plain
// or acquire loads through non-const pointers, so nvcc never emits ld.global.nc for it.

// ================================================================================================
// Config and static checks
// ================================================================================================

#define H MK_HIDDEN
#define D MK_HEAD_DIM
#define HALF (MK_HEAD_DIM / 2)
#define NWARPS (MK_THREADS / 32)
#define FULL_MASK 0xffffffffu

// -infinity without <math.h> (NVRTC has no INFINITY macro).
#define NEG_INF __int_as_float(0xff800000u)

// L2 prefetch of the weights an instruction will stream, issued before its wait (weights never
// depend on counters), so the wait hides their HBM latency. -DMK_PREFETCH=0 turns it off (A/B).
#ifndef MK_PREFETCH
#define MK_PREFETCH 1
#endif
// Per prefetched range at most this many bytes (the LM head's rows would not fit in L2 anyway).
#define PREFETCH_MAX_BYTES (64 * 1024)

// Positions of one attention unit processed per pass (scores live in shared memory).
#define T_TILE 128

static_assert(MK_THREADS % 32 == 0, "whole warps only");
static_assert(MK_HIDDEN % 8 == 0 && MK_FFN % 8 == 0 && MK_Q_DIM % 8 == 0,
              "mat-vec rows are read 8 bf16 (16 bytes) at a time");
static_assert(MK_HEAD_DIM % 32 == 0, "attention gives each lane HEAD_DIM/32 elements");
static_assert(MK_HEADS % MK_KV_HEADS == 0, "GQA groups must be whole");

__host__ __device__ constexpr int cmax(int a, int b) { return a > b ? a : b; }
// Longest vector a block keeps in shared memory: normed residual, attention output, or h.
#define VEC_MAX cmax(MK_HIDDEN, cmax(MK_FFN, MK_Q_DIM))
static_assert(VEC_MAX * 4 + (2 * MK_GROUP * MK_HEAD_DIM + MK_GROUP * T_TILE) * 4 < 46 * 1024,
              "static shared memory budget (48 KB) exceeded for this model");

// ================================================================================================
// Device helpers: bf16, warp/block reductions, acquire/timer, RNG
// ================================================================================================
__device__ __forceinline__ float bf16_to_f32(unsigned short b) {
  return __uint_as_float(((unsigned)b) << 16);
}
__device__ __forceinline__ float bf_lo(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf_hi(unsigned w) { return __uint_as_float(w & 0xffff0000u); }

// float32 -> bf16, round to nearest even (NaN stays NaN), as numpy/ml_dtypes rounds.
__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
  unsigned u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (unsigned short)(u >> 16);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
  return v;
}

// Sum over the block, in a fixed order (deterministic). Every thread gets the result.
__device__ float block_sum(float v) {
  __shared__ float s_red[NWARPS + 1];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  if (lane == 0) s_red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float t = lane < NWARPS ? s_red[lane] : 0.f;
    t = warp_sum(t);
    if (lane == 0) s_red[NWARPS] = t;
  }
  __syncthreads();
  const float r = s_red[NWARPS];
  __syncthreads();  // s_red may be reused by the next call
  return r;
}

// Acquire load of a counter or flag written by other blocks during this launch.
__device__ __forceinline__ int load_acquire(const int* p) {
#ifdef __CUDA_ARCH__
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
#elif defined(__CUDACC__)  // nvcc's host pass parses device bodies but never runs them
  return *p;
#else
  return emu::load_acquire(p);
#endif
}

__device__ __forceinline__ unsigned long long global_timer_ns() {
#ifdef __CUDA_ARCH__
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#elif defined(__CUDACC__)
  return 0;
#else
  return emu::global_timer_ns();
#endif
}

// The SM this block runs on (block placement check of the trace); the block index on the CPU.
__device__ __forceinline__ unsigned sm_id() {
#ifdef __CUDA_ARCH__
  unsigned r;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(r));
  return r;
#else
  return blockIdx.x;
#endif
}

// Dot product of one bf16 weight row (16-byte loads, read-only path) with an fp32 vector in
// shared memory; the whole warp cooperates and every lane gets the sum.
template <int N>
__device__ __forceinline__ float warp_dot(const unsigned short* __restrict__ w, const float* x) {
  const uint4* w4 = reinterpret_cast<const uint4*>(w);
  const int lane = threadIdx.x & 31;
  float acc = 0.f;
#pragma unroll 2
  for (int i = lane; i < N / 8; i += 32) {
    const uint4 p = __ldg(w4 + i);
    const float4 a = *reinterpret_cast<const float4*>(x + i * 8);
    const float4 b = *reinterpret_cast<const float4*>(x + i * 8 + 4);
    acc += bf_lo(p.x) * a.x + bf_hi(p.x) * a.y + bf_lo(p.y) * a.z + bf_hi(p.y) * a.w;
    acc += bf_lo(p.z) * b.x + bf_hi(p.z) * b.y + bf_lo(p.w) * b.z + bf_hi(p.w) * b.w;
  }
  return warp_sum(acc);
}

// s_out = rmsnorm(x) * w, x read from global memory (written by other blocks: plain loads).
__device__ void rms_normalize(const float* x, const unsigned short* __restrict__ w, float* s_out) {
  float ss = 0.f;
  for (int i = threadIdx.x; i < H; i += MK_THREADS) {
    const float v = x[i];
    s_out[i] = v;
    ss += v * v;
  }
  ss = block_sum(ss);
  const float r = 1.0f / sqrtf(ss / (float)H + MK_RMS_EPS);
  for (int i = threadIdx.x; i < H; i += MK_THREADS) s_out[i] = s_out[i] * r * bf16_to_f32(__ldg(w + i));
  __syncthreads();
}

// Counter-based RNG for Gumbel-max sampling: a hash of (seed, position, token) -> (0, 1).
// Mirrored bit for bit by sampling.gumbel_noise on the host.
__device__ __forceinline__ unsigned mix32(unsigned h) {
  h ^= h >> 16; h *= 0x85ebca6bu; h ^= h >> 13; h *= 0xc2b2ae35u; h ^= h >> 16;
  return h;
}
__device__ __forceinline__ float gumbel(unsigned seed, unsigned pos, unsigned token) {
  const unsigned h = mix32(mix32(mix32(seed ^ 0x9e3779b9u) ^ pos) ^ token);
  // 23 bits + 0.5 is exact in float32, so u lies in [2^-24, 1 - 2^-24]. (With 24 bits, h >> 8 =
  // 2^24 - 1 rounded (2^24 - 0.5) up to 2^24: u == 1, infinite noise, that token always sampled.)
  const float u = ((float)(h >> 9) + 0.5f) * (1.0f / 8388608.0f);
  return -logf(-logf(u));
}

// Issue L2 prefetches for [p, p + bytes), one 128-byte line per thread per pass. The emulator
// reads one byte per line instead, so AddressSanitizer checks every prefetched address.
__device__ __forceinline__ void prefetch_l2(const unsigned short* p, size_t bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  if (bytes > PREFETCH_MAX_BYTES) bytes = PREFETCH_MAX_BYTES;
  for (size_t off = (size_t)threadIdx.x * 128; off < bytes; off += (size_t)MK_THREADS * 128) {
#if defined(__CUDA_ARCH__)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(c + off));
#elif !defined(__CUDACC__)
    (void)*reinterpret_cast<const volatile char*>(c + off);
#endif
  }
}

// ================================================================================================
// Synchronisation: wait (acquire spin with watchdog) and signal (fence, then atomicAdd)
// ================================================================================================
__device__ void record_error(const Params& P, int code, int instr, int op, int counter,
                             int expected, int seen) {
  if (atomicCAS(&P.error[E_CODE], 0, code) == 0) {
    P.error[E_BLOCK] = blockIdx.x;
    P.error[E_INSTR] = instr;
    P.error[E_OP] = op;
    P.error[E_COUNTER] = counter;
    P.error[E_EXPECTED] = expected;
    P.error[E_SEEN] = seen;
    __threadfence();
  }
}

// Returns false when the launch is being aborted (this or another block hit an error).
__device__ bool wait_counter(const Params& P, int counter, int target, int instr, int op,
                             long long deadline_ns) {
  __shared__ int s_ok;
  if (threadIdx.x == 0) {
    int ok = 1;
    int seen = load_acquire(&P.counters[counter]);
    if (seen < target) {
      const unsigned long long start = global_timer_ns();
      while (seen < target) {
        if (load_acquire(&P.error[E_CODE]) != 0) { ok = 0; break; }
        if ((long long)(global_timer_ns() - start) > deadline_ns) {
          record_error(P, ERR_WATCHDOG, instr, op, counter, target, seen);
          ok = 0;
          break;
        }
        __nanosleep(32);
        seen = load_acquire(&P.counters[counter]);
      }
    }
    s_ok = ok;
  }
  __syncthreads();
  return s_ok != 0;
}

__device__ void signal_counter(const Params& P, int counter) {
  __syncthreads();  // every thread's stores of this instruction are issued
  if (threadIdx.x == 0) {
    __threadfence();  // ... and visible GPU-wide before the count moves
    atomicAdd(&P.counters[counter], 1);
  }
}

// ================================================================================================
// Shared memory of the ops (static: the shim gives each emulated block its own copy)
// ================================================================================================
struct OpShared {
  alignas(16) float vec[VEC_MAX];           // normed residual / merged attention / ffn h
  alignas(16) float row[MK_HEAD_DIM];       // RMS_QKV_ROPE: one head's q, k or v rows
  alignas(16) float q[MK_GROUP * MK_HEAD_DIM];  // ATTENTION: the group's queries
  alignas(16) float o[MK_GROUP * MK_HEAD_DIM];  // ATTENTION: running outputs
  float score[MK_GROUP * T_TILE];           // ATTENTION: scores, then probabilities
  float m[MK_GROUP], l[MK_GROUP], corr[MK_GROUP];
  float best[NWARPS];
  int best_id[NWARPS];
};

// ================================================================================================
// Op: EMBED - residual[b:e] = embed[token, b:e]
// ================================================================================================
__device__ void op_embed(const Params& P, const int* ins, const int* st) {
  const int b = ins[W_TILE_BEGIN], e = ins[W_TILE_END];
  const unsigned short* row = P.embed + (size_t)st[S_TOKEN] * H;
  for (int i = b + threadIdx.x; i < e; i += MK_THREADS) P.residual[i] = bf16_to_f32(__ldg(row + i));
}

// ================================================================================================
// Op: RMS_QKV_ROPE - tiles are row pairs (j, j + HEAD_DIM/2) of one head of Wqkv, so RoPE's
// partner row is always in the same tile; with QK_NORM the scheduler aligns tiles to heads.
// ================================================================================================
__device__ void op_rms_qkv_rope(const Params& P, OpShared& s, const int* ins, const int* st) {
  const int layer = ins[W_LAYER], b = ins[W_TILE_BEGIN], e = ins[W_TILE_END];
  if (b >= e) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  rms_normalize(P.residual, P.in_norm + (size_t)layer * H, s.vec);
  const int pos = st[S_POS];
  const unsigned short* W = P.wqkv + (size_t)layer * MK_QKV_DIM * H;
  for (int p = b; p < e;) {
    const int head = p / HALF;  // q heads, then k heads, then v heads
    const int j0 = p % HALF;
    const int j1 = min(HALF, j0 + (e - p));
    const int n = j1 - j0;
    for (int k = warp; k < 2 * n; k += NWARPS) {
      const int j = j0 + (k >> 1) + (k & 1) * HALF;  // row within the head
      const int r = head * D + j;
      float v = warp_dot<H>(W + (size_t)r * H, s.vec);
#if MK_HAS_BIAS
      v += bf16_to_f32(__ldg(P.bqkv + (size_t)layer * MK_QKV_DIM + r));
#endif
      if (lane == 0) s.row[j] = v;
    }
    __syncthreads();
    const bool is_q = head < MK_HEADS, is_k = !is_q && head < MK_HEADS + MK_KV_HEADS;
#if MK_QK_NORM
    if (is_q || is_k) {  // the tile holds the whole head (j0 == 0, j1 == HALF)
      float ss = 0.f;
      for (int d = threadIdx.x; d < D; d += MK_THREADS) ss += s.row[d] * s.row[d];
      ss = block_sum(ss);
      const float r = 1.0f / sqrtf(ss / (float)D + MK_RMS_EPS);
      const unsigned short* nw = (is_q ? P.q_norm : P.k_norm) + (size_t)layer * D;
      for (int d = threadIdx.x; d < D; d += MK_THREADS) s.row[d] = s.row[d] * r * bf16_to_f32(__ldg(nw + d));
      __syncthreads();
    }
#endif
    for (int j = j0 + threadIdx.x; j < j1; j += MK_THREADS) {
      float a = s.row[j], c = s.row[j + HALF];
      if (is_q || is_k) {  // rotate-half RoPE
        const float cs = __ldg(P.rope_cos + (size_t)pos * HALF + j);
        const float sn = __ldg(P.rope_sin + (size_t)pos * HALF + j);
        const float ra = a * cs - c * sn, rc = c * cs + a * sn;
        a = ra;
        c = rc;
      }
      if (is_q) {
        P.q[head * D + j] = a;
        P.q[head * D + j + HALF] = c;
      } else {
        const int kvh = is_k ? head - MK_HEADS : head - MK_HEADS - MK_KV_HEADS;
        unsigned short* cache = is_k ? P.k_cache : P.v_cache;
        const size_t at = (((size_t)layer * MK_MAX_SEQ + pos) * MK_KV_HEADS + kvh) * D;
        cache[at + j] = f32_to_bf16(a);
        cache[at + j + HALF] = f32_to_bf16(c);
      }
    }
    __syncthreads();  // s.row is reused by the next head
    p += n;
  }
}

// ================================================================================================
// Op: ATTENTION - flash-decoding. A unit is (KV head g, position split); it covers positions
// [split * chunk, (split + 1) * chunk) of [0, pos] for the GROUP query heads of g and writes
// unnormalised outputs with their (max, sum of exp). O_PROJ_RESIDUAL merges the splits.
// ================================================================================================
__device__ void op_attention(const Params& P, OpShared& s, const int* ins, const int* st) {
  const int layer = ins[W_LAYER], b = ins[W_TILE_BEGIN], e = ins[W_TILE_END];
  const int splits = ins[W_ARG0];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n_pos = st[S_POS] + 1;
  const int chunk = (n_pos + splits - 1) / splits;
  const float scale = 1.0f / sqrtf((float)D);
  constexpr int PER = D / 32;
  for (int u = b; u < e; ++u) {
    const int g = u / splits, split = u % splits;
    const int t0 = split * chunk, t1 = min(n_pos, t0 + chunk);
    for (int i = threadIdx.x; i < MK_GROUP * D; i += MK_THREADS) {
      s.q[i] = P.q[g * MK_GROUP * D + i];
      s.o[i] = 0.f;
    }
    if (threadIdx.x < MK_GROUP) {
      s.m[threadIdx.x] = NEG_INF;
      s.l[threadIdx.x] = 0.f;
    }
    __syncthreads();
    const size_t kv0 = ((size_t)layer * MK_MAX_SEQ * MK_KV_HEADS + g) * D;
    const unsigned short* Kg = P.k_cache + kv0;
    const unsigned short* Vg = P.v_cache + kv0;
    for (int base = t0; base < t1; base += T_TILE) {
      const int cnt = min(T_TILE, t1 - base);
      for (int i = warp; i < cnt; i += NWARPS) {  // one warp per position
        const unsigned short* kr = Kg + (size_t)(base + i) * MK_KV_DIM;
        float kreg[PER];
#pragma unroll
        for (int c = 0; c < PER; ++c) kreg[c] = bf16_to_f32(kr[lane + 32 * c]);
        for (int h = 0; h < MK_GROUP; ++h) {
          float acc = 0.f;
#pragma unroll
          for (int c = 0; c < PER; ++c) acc += s.q[h * D + lane + 32 * c] * kreg[c];
          acc = warp_sum(acc);
          if (lane == 0) s.score[h * T_TILE + i] = acc * scale;
        }
      }
      __syncthreads();
      for (int h = warp; h < MK_GROUP; h += NWARPS) {  // online softmax, one warp per head
        float mx = NEG_INF;
        for (int i = lane; i < cnt; i += 32) mx = fmaxf(mx, s.score[h * T_TILE + i]);
        mx = warp_max(mx);
        const float m_new = fmaxf(s.m[h], mx);
        float sum = 0.f;
        for (int i = lane; i < cnt; i += 32) {
          const float p = expf(s.score[h * T_TILE + i] - m_new);
          s.score[h * T_TILE + i] = p;
          sum += p;
        }
        sum = warp_sum(sum);
        if (lane == 0) {
          const float corr = expf(s.m[h] - m_new);
          s.corr[h] = corr;
          s.l[h] = s.l[h] * corr + sum;
          s.m[h] = m_new;
        }
      }
      __syncthreads();
      for (int idx = threadIdx.x; idx < MK_GROUP * D; idx += MK_THREADS) {
        const int h = idx / D, d = idx % D;
        float acc = s.o[idx] * s.corr[h];
        for (int i = 0; i < cnt; ++i)
          acc += s.score[h * T_TILE + i] * bf16_to_f32(Vg[(size_t)(base + i) * MK_KV_DIM + d]);
        s.o[idx] = acc;
      }
      __syncthreads();
    }
    const size_t unit = (size_t)g * splits + split;
    for (int i = threadIdx.x; i < MK_GROUP * D; i += MK_THREADS) P.attn_o[unit * MK_GROUP * D + i] = s.o[i];
    if (threadIdx.x < MK_GROUP) {
      P.attn_ml[(unit * MK_GROUP + threadIdx.x) * 2] = s.m[threadIdx.x];
      P.attn_ml[(unit * MK_GROUP + threadIdx.x) * 2 + 1] = s.l[threadIdx.x];
    }
    __syncthreads();  // s.q / s.o are reused by the next unit
  }
}

// ================================================================================================
// Op: O_PROJ_RESIDUAL - merge the attention splits (every block, into shared memory), then
// residual[r] += Wo[r] . attn for the tile's rows.
// ================================================================================================
__device__ void op_o_proj_residual(const Params& P, OpShared& s, const int* ins, const int* st) {
  const int layer = ins[W_LAYER], b = ins[W_TILE_BEGIN], e = ins[W_TILE_END];
  const int splits = ins[W_ARG0];
  if (b >= e) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int idx = threadIdx.x; idx < MK_Q_DIM; idx += MK_THREADS) {
    const int g = idx / (MK_GROUP * D), h = (idx / D) % MK_GROUP, d = idx % D;
    float M = NEG_INF;
    for (int sp = 0; sp < splits; ++sp)
      M = fmaxf(M, P.attn_ml[(((size_t)g * splits + sp) * MK_GROUP + h) * 2]);
    float L = 0.f, acc = 0.f;
    for (int sp = 0; sp < splits; ++sp) {
      const size_t unit = (size_t)g * splits + sp;
      const float m = P.attn_ml[(unit * MK_GROUP + h) * 2];
      if (m == NEG_INF) continue;  // an empty split
      const float w = expf(m - M);
      L += P.attn_ml[(unit * MK_GROUP + h) * 2 + 1] * w;
      acc += P.attn_o[(unit * MK_GROUP + h) * D + d] * w;
    }
    s.vec[idx] = acc / L;
  }
  __syncthreads();
  const unsigned short* W = P.wo + (size_t)layer * H * MK_Q_DIM;
  for (int r = b + warp; r < e; r += NWARPS) {
    const float v = warp_dot<MK_Q_DIM>(W + (size_t)r * MK_Q_DIM, s.vec);
    if (lane == 0) P.residual[r] += v;
  }
}

// ================================================================================================
// Op: RMS_GATE_UP - h[r] = silu(Wg[r] . x) * (Wu[r] . x), x = rmsnorm(residual)
// ================================================================================================
__device__ void op_rms_gate_up(const Params& P, OpShared& s, const int* ins, const int* st) {
  const int layer = ins[W_LAYER], b = ins[W_TILE_BEGIN], e = ins[W_TILE_END];
  if (b >= e) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  rms_normalize(P.residual, P.post_norm + (size_t)layer * H, s.vec);
  const size_t off = (size_t)layer * MK_FFN * H;
  for (int r = b + warp; r < e; r += NWARPS) {
    const float g = warp_dot<H>(P.wg + off + (size_t)r * H, s.vec);
    const float u = warp_dot<H>(P.wu + off + (size_t)r * H, s.vec);
    if (lane == 0) P.ffn_h[r] = g / (1.0f + expf(-g)) * u;
  }
}

// ================================================================================================
// Op: DOWN_RESIDUAL - residual[r] += Wd[r] . h
// ================================================================================================
__device__ void op_down_residual(const Params& P, OpShared& s, const int* ins, const int* st) {
  const int layer = ins[W_LAYER], b = ins[W_TILE_BEGIN], e = ins[W_TILE_END];
  if (b >= e) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int i = threadIdx.x; i < MK_FFN; i += MK_THREADS) s.vec[i] = P.ffn_h[i];
  __syncthreads();
  const unsigned short* W = P.wd + (size_t)layer * H * MK_FFN;
  for (int r = b + warp; r < e; r += NWARPS) {
    const float v = warp_dot<MK_FFN>(W + (size_t)r * MK_FFN, s.vec);
    if (lane == 0) P.residual[r] += v;
  }
}

// ================================================================================================
// Op: RMS_LM_HEAD - logits[r] = lm_head[r] . rmsnorm(residual); the tile's best score
// (logit, or logit / T + Gumbel noise when sampling) and its token go to lm_part[slot].
// ================================================================================================
__device__ void op_rms_lm_head(const Params& P, OpShared& s, const int* ins, const int* st) {
  const int b = ins[W_TILE_BEGIN], e = ins[W_TILE_END], slot = ins[W_ARG0];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float temp = __int_as_float(st[S_TEMPERATURE]);
  const unsigned seed = (unsigned)st[S_SEED], pos = (unsigned)st[S_POS];
  float best = NEG_INF;
  int best_id = -1;
  if (b < e) {
    rms_normalize(P.residual, P.final_norm, s.vec);
    for (int r = b + warp; r < e; r += NWARPS) {
      const float v = warp_dot<H>(P.lm_head + (size_t)r * H, s.vec);
      if (lane == 0) {
        P.logits[r] = v;
        const float score = temp > 0.f ? v / temp + gumbel(seed, pos, (unsigned)r) : v;
        if (score != score) { best = score; best_id = r; }  // NaN poisons the tile
        else if (best == best && (score > best || best_id < 0)) { best = score; best_id = r; }
      }
    }
  }
  if (lane == 0) {
    s.best[warp] = best;
    s.best_id[warp] = best_id;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 0; w < NWARPS; ++w) {  // rows of a warp rise, so ties keep the lowest id
      const float v = s.best[w];
      const int id = s.best_id[w];
      if (id < 0) continue;
      if (v != v) { best = v; best_id = id; break; }
      if (best_id < 0 || v > best || (v == best && id < best_id)) { best = v; best_id = id; }
    }
    P.lm_part[slot * 2] = best;
    P.lm_part[slot * 2 + 1] = __int_as_float(best_id);
  }
}

// ================================================================================================
// Op: SAMPLE - reduce the LM-head partials to the next token (-1 if a logit was NaN), record it,
// and advance the state so that the next launch (or graph replay) embeds it.
// ================================================================================================
__device__ void op_sample(const Params& P, const int* ins, const int* st) {
  if (threadIdx.x != 0) return;
  const int n = ins[W_ARG0];
  float best = NEG_INF;
  int best_id = -1;
  bool nan = false;
  for (int i = 0; i < n; ++i) {
    const float v = P.lm_part[i * 2];
    const int id = __float_as_int(P.lm_part[i * 2 + 1]);
    if (id < 0) continue;
    if (v != v) { nan = true; break; }
    if (best_id < 0 || v > best || (v == best && id < best_id)) { best = v; best_id = id; }
  }
  const int token = nan ? -1 : best_id;
  const int pos = st[S_POS];
  P.out_tokens[pos] = token;
  P.state[S_TOKEN] = token;
  P.state[S_POS] = pos + 1;
  P.state[S_STEP] = st[S_STEP] + 1;
}

// ================================================================================================
// Prefetch: the weight rows of one instruction (same tiling as the op sections above)
// ================================================================================================
__device__ void prefetch_weights(const Params& P, const int* w) {
  const int layer = w[W_LAYER], b = w[W_TILE_BEGIN], e = w[W_TILE_END];
  if (b >= e) return;
  switch (w[W_OP]) {
    case OP_RMS_QKV_ROPE: {
      const unsigned short* W = P.wqkv + (size_t)layer * MK_QKV_DIM * H;
      for (int p = b; p < e;) {  // rows j0..j1 and j0+HALF..j1+HALF of each head in the tile
        const int head = p / HALF, j0 = p % HALF, j1 = min(HALF, j0 + (e - p));
        prefetch_l2(W + (size_t)(head * D + j0) * H, (size_t)(j1 - j0) * H * 2);
        prefetch_l2(W + (size_t)(head * D + HALF + j0) * H, (size_t)(j1 - j0) * H * 2);
        p += j1 - j0;
      }
      break;
    }
    case OP_O_PROJ_RESIDUAL:
      prefetch_l2(P.wo + ((size_t)layer * H + b) * MK_Q_DIM, (size_t)(e - b) * MK_Q_DIM * 2);
      break;
    case OP_RMS_GATE_UP:
      prefetch_l2(P.wg + ((size_t)layer * MK_FFN + b) * H, (size_t)(e - b) * H * 2);
      prefetch_l2(P.wu + ((size_t)layer * MK_FFN + b) * H, (size_t)(e - b) * H * 2);
      break;
    case OP_DOWN_RESIDUAL:
      prefetch_l2(P.wd + ((size_t)layer * H + b) * MK_FFN, (size_t)(e - b) * MK_FFN * 2);
      break;
    case OP_RMS_LM_HEAD:
      prefetch_l2(P.lm_head + (size_t)b * H, (size_t)(e - b) * H * 2);
      break;
    default:
      break;
  }
}

// ================================================================================================
// The VM loop: run this block's instructions [begin, end). ONLY != OP_NOOP compiles a loop that
// knows a single op (the multi-kernel baseline's thin kernels).
// ================================================================================================
template <int ONLY>
__device__ void run_instructions(const Params& P, int begin, int end) {
  __shared__ OpShared s;
  __shared__ int st[MK_STATE_WORDS];
  if (threadIdx.x < MK_STATE_WORDS) st[threadIdx.x] = P.state[threadIdx.x];
  __syncthreads();
  const int len = st[S_PROGRAM_LEN];
  const long long deadline_ns = (long long)st[S_WATCHDOG_MS] * 1000000LL;
  const int target_scale = st[S_STEP] + 1;  // counters are monotonic across steps
  for (int i = begin; i < end; ++i) {
    const int* ins = P.program + ((size_t)blockIdx.x * len + i) * MK_WIDTH;
    int w[MK_WIDTH];
#pragma unroll
    for (int k = 0; k < MK_WIDTH; ++k) w[k] = __ldg(ins + k);
    const int op = w[W_OP];
    if (op == OP_NOOP) continue;
#ifdef MK_TRACE
    unsigned long long* tr = P.trace + ((size_t)blockIdx.x * len + i) * MK_TRACE_WORDS;
    if (threadIdx.x == 0) {
      tr[T_START] = global_timer_ns();
      tr[T_SMID] = sm_id();
    }
#endif
#if MK_PREFETCH
    prefetch_weights(P, w);
#endif
    if (w[W_WAIT_COUNTER] >= 0 &&
        !wait_counter(P, w[W_WAIT_COUNTER], w[W_WAIT_COUNT] * target_scale, i, op, deadline_ns))
      return;
#ifdef MK_TRACE
    if (threadIdx.x == 0) tr[T_READY] = global_timer_ns();
#endif
    if (ONLY != OP_NOOP && op != ONLY) {
      if (threadIdx.x == 0) record_error(P, ERR_BAD_OPCODE, i, op, -1, ONLY, op);
      return;
    }
    switch (ONLY == OP_NOOP ? op : ONLY) {
      case OP_EMBED: op_embed(P, w, st); break;
      case OP_RMS_QKV_ROPE: op_rms_qkv_rope(P, s, w, st); break;
      case OP_ATTENTION: op_attention(P, s, w, st); break;
      case OP_O_PROJ_RESIDUAL: op_o_proj_residual(P, s, w, st); break;
      case OP_RMS_GATE_UP: op_rms_gate_up(P, s, w, st); break;
      case OP_DOWN_RESIDUAL: op_down_residual(P, s, w, st); break;
      case OP_RMS_LM_HEAD: op_rms_lm_head(P, s, w, st); break;
      case OP_SAMPLE: op_sample(P, w, st); break;
      default:
        if (threadIdx.x == 0) record_error(P, ERR_BAD_OPCODE, i, op, -1, -1, op);
        return;
    }
    if (w[W_SIGNAL_COUNTER] >= 0) signal_counter(P, w[W_SIGNAL_COUNTER]);
    else __syncthreads();  // shared memory is reused by the next instruction
#ifdef MK_TRACE
    if (threadIdx.x == 0) tr[T_END] = global_timer_ns();
#endif
  }
}

// ================================================================================================
// Entry points
// ================================================================================================
// The persistent megakernel: one cooperative launch runs a whole decode step.
extern "C" __global__ void __launch_bounds__(MK_THREADS, 1)
megakernel(const Params P) {
  run_instructions<OP_NOOP>(P, P.begin, P.end);
}

// The multi-kernel baseline: one thin kernel per op; the host launches instruction slots
// [P.begin, P.end) of one op at a time, in order.
#define MK_OP_ENTRY(NAME)                                                    \
  extern "C" __global__ void __launch_bounds__(MK_THREADS, 1)                \
  op_##NAME(const Params P) {                                                \
    run_instructions<OP_##NAME>(P, P.begin, P.end);                          \
  }
MK_OP_ENTRY(EMBED)
MK_OP_ENTRY(RMS_QKV_ROPE)
MK_OP_ENTRY(ATTENTION)
MK_OP_ENTRY(O_PROJ_RESIDUAL)
MK_OP_ENTRY(RMS_GATE_UP)
MK_OP_ENTRY(DOWN_RESIDUAL)
MK_OP_ENTRY(RMS_LM_HEAD)
MK_OP_ENTRY(SAMPLE)
