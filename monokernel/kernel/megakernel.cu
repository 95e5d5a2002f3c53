// megakernel.cu - one decode step of a Llama-family model as ONE persistent kernel.
//
// Every block pulls its own queue of instructions (built by schedule.py) and runs them in
// order: parse, wait on a counter, compute, signal a counter. Blocks never leave the kernel
// between ops or between steps: one launch runs the prompt and the decode steps until a stop
// (run_instructions). The same device functions also run as one thin kernel per op (op_<NAME>)
// for the multi-kernel baseline. Each op is one section below ("Op: <NAME>"), its Python side
// one module of kernel/ops/ (docs/adding-an-op.md).
//
// This file is compiled by NVRTC/nvcc for the GPU and by g++ with emulator/cuda_cpu.h for the
// CPU. The generated header (header.py, from isa.py and kernel/ops) is prepended: opcodes, word
// layout, each op's named argument words (A_<OP>_<NAME>), model constants and the Params struct
// all come from there.
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
#define PREFETCH_MAX_BYTES MK_PREFETCH_MAX_BYTES  // isa.PREFETCH_MAX_BYTES

// Positions of one attention unit processed per pass (scores live in shared memory).
#define T_TILE MK_T_TILE  // isa.T_TILE
// Positions of a K/V tile of the tensor-core kernel's attention (header.segment_tile: T_TILE,
// or half of it where two buffers of T_TILE would pass the shared-memory cap)
#define SEG_TILE MK_SEG_TILE

// A step carries up to MK_T_MAX tokens (Program.tokens): positions POS..POS+NTOK-1 of one
// sequence, a prompt chunk. Every op loops over them with the one-token step's arithmetic, so a
// chunk's K/V and logits are bitwise those of one token per step (docs/many-tokens.md, slice 2);
// per-token activations are rows of MK_T_MAX-row buffers. Built for one token, the loops fold
// away and the kernel compiles as before.
#if MK_MMA && !MK_SLOTS
#error "MK_MMA (tensor_cores) is for a kernel of slots"
#endif
#ifndef MK_T_MAX
#define MK_T_MAX 1
#endif
// Late q/k attention keeps the chunk's keys (bf16 [T_MAX, HEAD_DIM]) in dynamic shared memory
// (chunk_keys): MK_DYN_SMEM bytes, which every launch passes (header.dynamic_shared_bytes).
#ifndef MK_DYN_SMEM
#define MK_DYN_SMEM 0
#endif
static_assert(!(MK_QK_NORM && MK_T_MAX > 1) || MK_DYN_SMEM >= MK_T_MAX * MK_HEAD_DIM * 2,
              "late q/k in steps of many tokens: chunk_keys holds T_MAX keys of HEAD_DIM bf16");

static_assert(MK_THREADS % 32 == 0, "whole warps only");
static_assert(MK_HIDDEN % 8 == 0 && MK_FFN % 8 == 0 && MK_Q_DIM % 8 == 0,
              "mat-vec rows are read 8 bf16 (16 bytes) at a time");
static_assert(MK_HEAD_DIM % 32 == 0, "attention gives each lane HEAD_DIM/32 elements");
static_assert(MK_HEAD_DIM <= MK_THREADS, "RMS_QKV_ROPE gives each head element a thread");
static_assert(MK_HEADS % MK_KV_HEADS == 0, "GQA groups must be whole");

__host__ __device__ constexpr int cmax(int a, int b) { return a > b ? a : b; }
__host__ __device__ constexpr int cmin(int a, int b) { return a < b ? a : b; }
// Whole rounds of copy_to_shared: n floats rounded up to float4s for every thread.
#define COPY_SPAN(n) (((n) / 4 + MK_THREADS - 1) / MK_THREADS * MK_THREADS * 4)

// An L2 prefetch of the 128-byte line holding p. The emulator reads one byte instead, so
// AddressSanitizer checks every prefetched address (and the strict build that no prefetch reads
// memory another block may be writing).
__device__ __forceinline__ void prefetch_line(const void* p) {
#if defined(__CUDA_ARCH__)
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#elif !defined(__CUDACC__)
  (void)*reinterpret_cast<const volatile char*>(p);
#endif
}

// Longest vector a block keeps in shared memory: normed residual, attention output, or h (as
// copy_to_shared writes it: whole rounds); and ATTENTION's per-warp V partials, which use
// the same space. The tensor-core DOWN reads h from global memory (block_mma): no h here.
#if MK_MMA
#define VEC_FFN 0
#else
#define VEC_FFN COPY_SPAN(MK_FFN)
#endif
#define VEC_MAX cmax(cmax(MK_HIDDEN, cmax(VEC_FFN, COPY_SPAN(MK_Q_DIM))), \
                     (MK_THREADS / 32) * cmax(MK_GROUP, 2) * MK_HEAD_DIM)
static_assert(VEC_MAX * 4 + (2 * MK_GROUP * MK_HEAD_DIM + MK_GROUP * T_TILE) * 4 < 46 * 1024,
              "static shared memory budget (48 KB) exceeded for this model (and MK_T_MAX)");

// ================================================================================================
// Device helpers: bf16, warp/block reductions, acquire/timer, RNG
// ================================================================================================
// The step's tokens: NTOK from the state words, or 1 in a kernel built for one (MK_T_MAX 1).
__device__ __forceinline__ int step_tokens(const int* st) { return MK_T_MAX == 1 ? 1 : st[S_NTOK]; }

// ---- The step's rows ----------------------------------------------------------------------
// A kernel built with MK_SLOTS > 0 runs steps of many sequences: row tok of the step is a row of
// the token table (isa.RowWord: token, slot, position, the first row of its segment, its logits
// row), copied into shared memory after the state words (load_state), and a slot's positions
// live in K/V pages of MK_PAGE positions found through its block table (kv_row). With MK_SLOTS
// 0 a step is positions POS..POS+NTOK-1 of the one sequence (a prompt chunk: TOKEN, then feed[]),
// the cache row is the position, and these accessors fold to what the kernel read before.
__device__ __forceinline__ const int* step_row(const int* st, int tok) {
  return st + MK_STATE_WORDS + tok * MK_ROW_WORDS;
}
__device__ __forceinline__ int row_pos(const int* st, int tok) {
  return MK_SLOTS ? step_row(st, tok)[R_POS] : st[S_POS] + tok;
}
__device__ __forceinline__ int row_slot(const int* st, int tok) {
  return MK_SLOTS ? step_row(st, tok)[R_SLOT] : 0;
}
// The first row of tok's segment (its sequence's rows in this step): late q/k reads the keys
// of the rows between it and tok from k_raw, the cache getting them only after the attention.
__device__ __forceinline__ int row_seg(const int* st, int tok) {
  return MK_SLOTS ? step_row(st, tok)[R_SEG] : 0;
}
// The cache row (of one layer's [KV_ROWS, KV_HEADS, HEAD_DIM]) of a slot's position. The block
// table is written by the host between launches only: plain loads, from L1 after the first.
__device__ __forceinline__ int kv_row(const Params& P, int slot, int pos) {
#if MK_SLOTS
  return P.block_table[slot * MK_SLOT_PAGES + pos / MK_PAGE] * MK_PAGE + pos % MK_PAGE;
#else
  (void)P;
  (void)slot;
  return pos;
#endif
}
__device__ __forceinline__ size_t kv_at(const Params& P, int layer, int slot, int pos, int kvh) {
  return (((size_t)layer * MK_KV_ROWS + kv_row(P, slot, pos)) * MK_KV_HEADS + kvh) * D;
}

// ---- The last layer of a step that needs no logits ----------------------------------------
// A step none of whose rows needs logits (prompt chunks before their prompt's last) idles the
// last layer after RMS_QKV_ROPE: QKV has written every row's K/V, and nothing reads those rows'
// residual again (costmodel last_layer_skip; benchmarks/NOTES.md "The last layer skipped where
// no row needs logits"). An idle instruction still waits and signals its counters, late q/k's
// O_PROJ still caches the step's keys, and a slice still signals its row group's counter:
// later steps read those. Block-uniform (its threads' rows of the table, one barrier), so every
// thread of the block calls it; the tensor-core kernel of slots only (elsewhere: never idle).
__device__ __forceinline__ bool last_layer_idle(const int* st, int layer) {
#if MK_MMA && MK_SLOTS
  if (layer != MK_LAYERS - 1) return false;
  int wants = 0;
  for (int tok = threadIdx.x; tok < step_tokens(st); tok += MK_THREADS)
    wants |= step_row(st, tok)[R_LOGITS] >= 0;
  return !__syncthreads_or(wants);
#else
  (void)st;
  (void)layer;
  return false;
#endif
}

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

// An element of attn or ffn_h as its producer stores it (mk_in_t, isa.BF16_INPUTS; residual_in
// has its own writers): fp32, or in a tensor-core build the bf16 block_mma would round it to;
// a float* is shared memory.
__device__ __forceinline__ void store_in(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_in(unsigned short* p, float v) { *p = f32_to_bf16(v); }

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

// threadIdx.x read afresh (a volatile read of %tid.x on the GPU): what is computed from it is
// recomputed where it is used instead of hoisted to the kernel's start and kept in registers
// through every op (the staging's per-thread shared-memory addresses were 24 registers held
// across the whole attention of a late q/k model at head_dim 128, and it spilled).
__device__ __forceinline__ int fresh_tid() {
#ifdef __CUDA_ARCH__
  int t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return t;
#else
  return threadIdx.x;
#endif
}

// ---- mat-vec ------------------------------------------------------------------------------
// Weight rows are bf16, read 16 bytes (8 values) per load through the read-only path; x is an
// fp32 vector in shared memory. A warp computes R rows per pass: every lane issues its loads for
// all R rows (K per row per chunk) before the first FMA, so a pass keeps R x K 16-byte loads per
// lane in flight: >= 8 for every row length (>= 32 KB per SM with 8 warps; 2 would cap the
// stream near 2 TB/s by Little's law, PERFORMANCE.md section 2).

template <int N>
struct RowShape {
  static_assert(N % 8 == 0, "rows are read 8 bf16 at a time");
  static constexpr int V = N / 8;            // 16-byte vectors per row
  static constexpr int L = (V + 31) / 32;    // per lane, whole row
  static constexpr int K = L < MK_MATVEC_LOADS ? L : MK_MATVEC_LOADS;  // per lane per row per chunk
  static constexpr int R = L >= MK_MATVEC_LOADS ? 1 : (MK_MATVEC_LOADS + L - 1) / L;  // rows per pass
};

__device__ __forceinline__ float dot8(uint4 p, float4 a, float4 b) {
  return bf_lo(p.x) * a.x + bf_hi(p.x) * a.y + bf_lo(p.y) * a.z + bf_hi(p.y) * a.w +
         bf_lo(p.z) * b.x + bf_hi(p.z) * b.y + bf_lo(p.w) * b.z + bf_hi(p.w) * b.w;
}

// out[r] = row(r) . x for the rows r whose bit is set in ``valid`` (others: 0); every lane gets
// every sum. row(r) is only dereferenced for valid rows.
template <int N, int R, class RowPtr>
__device__ __forceinline__ void warp_dot_rows(RowPtr row, unsigned valid, const float* x,
                                              float (&out)[R]) {
  using S = RowShape<N>;
  const int lane = threadIdx.x & 31;
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
#pragma unroll
  for (int c0 = 0; c0 < S::L; c0 += S::K) {
    uint4 p[R][S::K];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const bool ok = (valid >> r) & 1u;
      const uint4* w4 = reinterpret_cast<const uint4*>(row(r));
#pragma unroll
      for (int k = 0; k < S::K; ++k) {
        const int i = lane + 32 * (c0 + k);
        p[r][k] = ok && c0 + k < S::L && i < S::V ? __ldg(w4 + i) : make_uint4(0u, 0u, 0u, 0u);
      }
    }
#pragma unroll
    for (int k = 0; k < S::K; ++k) {
      const int i = lane + 32 * (c0 + k);
      if (c0 + k < S::L && i < S::V) {
        const float4 a = *reinterpret_cast<const float4*>(x + i * 8);
        const float4 b = *reinterpret_cast<const float4*>(x + i * 8 + 4);
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] += dot8(p[r][k], a, b);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) out[r] = warp_sum(acc[r]);
}

// Rows k in [0, n) of one instruction, RowShape<N>::R per warp pass, warps round-robin.
// pre(k) is loaded by lane (k - k0) before the pass's weights (the same round trip: bias, the
// block's own residual row); then emit(k, dot, pre) runs on that lane.
template <int N, class RowPtr, class Pre, class Emit>
__device__ __forceinline__ void block_dot_rows(int n, RowPtr row, const float* x, Pre pre,
                                               Emit emit) {
  constexpr int R = RowShape<N>::R;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int k0 = warp * R; k0 < n; k0 += NWARPS * R) {
    const int m = min(R, n - k0);
    const float before = lane < m ? pre(k0 + lane) : 0.f;
    float out[R];
    warp_dot_rows<N, R>([&](int r) { return row(k0 + r); }, (1u << m) - 1u, x, out);
#pragma unroll
    for (int r = 0; r < R; ++r)
      if (lane == r && r < m) emit(k0 + r, out[r], before);
  }
}

// Row pairs (A[k], B[k]) for k in [0, n), loaded together (gate and up): emit(k, a, b).
template <int N, class Emit>
__device__ __forceinline__ void block_dot_row_pairs(int n, const unsigned short* A,
                                                    const unsigned short* B, const float* x,
                                                    Emit emit) {
  constexpr int R = RowShape<N>::R > 1 ? RowShape<N>::R / 2 + RowShape<N>::R % 2 : 1;  // isa.pair_rows
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int k0 = warp * R; k0 < n; k0 += NWARPS * R) {
    const int m = min(R, n - k0);
    float out[2 * R];
    warp_dot_rows<N, 2 * R>(
        [&](int r) { return r < R ? A + (size_t)(k0 + r) * N : B + (size_t)(k0 + r - R) * N; },
        ((1u << m) - 1u) | (((1u << m) - 1u) << R), x, out);
#pragma unroll
    for (int r = 0; r < R; ++r)
      if (lane == r && r < m) emit(k0 + r, out[r], out[R + r]);
  }
}

// ---- RMSNorm ------------------------------------------------------------------------------
// Each thread owns elements i = threadIdx.x + MK_THREADS * c of the hidden vector.
#define RMS_PER ((MK_HIDDEN + MK_THREADS - 1) / MK_THREADS)

// The norm weights this thread will need, loaded before the instruction's wait (weights never
// depend on counters), so that after it only the residual is a round trip.
__device__ __forceinline__ void rms_load_weights(const unsigned short* __restrict__ w,
                                                 float (&g)[RMS_PER]) {
#pragma unroll
  for (int c = 0; c < RMS_PER; ++c) {
    const int i = threadIdx.x + MK_THREADS * c;
    g[c] = i < H ? bf16_to_f32(__ldg(w + i)) : 0.f;
  }
}

// s_out = rmsnorm(x) * g, x read from global memory (written by other blocks: plain loads).
__device__ void rms_apply(const float* x, const float (&g)[RMS_PER], float* s_out) {
  float v[RMS_PER];
  float ss = 0.f;
#pragma unroll
  for (int c = 0; c < RMS_PER; ++c) {
    const int i = threadIdx.x + MK_THREADS * c;
    v[c] = i < H ? x[i] : 0.f;
    ss += v[c] * v[c];
  }
  ss = block_sum(ss);
  const float r = 1.0f / sqrtf(ss / (float)H + MK_RMS_EPS);
#pragma unroll
  for (int c = 0; c < RMS_PER; ++c) {
    const int i = threadIdx.x + MK_THREADS * c;
    if (i < H) s_out[i] = v[c] * r * g[c];
  }
  __syncthreads();
}

// s_dst[0, N) = src[0, N), a vector other blocks wrote during the launch (plain loads), in one
// round: every float4 load of the thread is issued before its first store (a strided loop
// compiles to a peel of single loads and rounds of 4: 3 dependent rounds for SmolLM2's FFN, 8
// for Llama's). Loads and stores are unconditional - a thread past the end reads the last
// float4 again and writes it past N, into s_dst's padding up to COPY_SPAN(N) - because with a
// conditional store the compiler sank each load to its store (load, store, load, store: Qwen3's
// merged read). The caller's barrier publishes it.
template <int N>
__device__ __forceinline__ void copy_to_shared(float* s_dst, const float* src) {
  static_assert(N % 4 == 0, "copied as float4s");
  static_assert(COPY_SPAN(N) <= VEC_MAX, "s_dst holds whole rounds");
  constexpr int V = N / 4, PER = (V + MK_THREADS - 1) / MK_THREADS;
  float4 r[PER];
#pragma unroll
  for (int k = 0; k < PER; ++k)
    r[k] = reinterpret_cast<const float4*>(src)[min((int)threadIdx.x + k * MK_THREADS, V - 1)];
#pragma unroll
  for (int k = 0; k < PER; ++k)
    reinterpret_cast<float4*>(s_dst)[threadIdx.x + k * MK_THREADS] = r[k];
}

// Dynamic shared memory, sized by the launch (MK_DYN_SMEM, header.dynamic_shared_bytes), so
// it does not count against the 48 KB of static shared memory: late q/k attention's chunk keys
// (chunk_keys: a step of 128 tokens at head_dim 128, 32 KB), or the tensor-core kernel's
// staged K and V tiles (attention_segment) and its row-split passes' sums (block_mma_rows);
// nullptr in a kernel without them.
__device__ __forceinline__ void* dynamic_smem() {
#if MK_DYN_SMEM > 0
#ifdef __CUDA_ARCH__
  extern __shared__ uint4 mk_dynamic_shared[];
  return mk_dynamic_shared;
#else
  return emu::dynamic_shared(MK_DYN_SMEM);
#endif
#else
  return nullptr;
#endif
}

#if MK_MMA
#include "mma.cuh"
// ---- Mat-muls on tensor cores (MK_MMA: backend option tensor_cores) -------------------------
// Y[tok][r] = W[r] . X[tok] for a tile's weight rows and a step's rows (tokens) at once, on
// mma.sync m16n8k16 (bf16 x bf16, fp32 accumulate; mma.cuh): the weights fill the 16-row side,
// 8 tokens the other. Rows come in groups of 16 (rowptr(q, r): row r of group q, nullptr past
// the tile: zeros; row 0 of a group inside the tile never null), tokens in groups of 8 (past
// ntok: zeros).
//   - Each lane loads 16 bytes (8 bf16) of a weight row per 32-column chunk: lane (g, t) columns
//     8t..8t+7 of rows g and g + 8. Two mma k-steps take them: step j's k slots 2t+{0,1} and
//     2t+8+{0,1} are columns 8t+4j+{0,1} and 8t+4j+2+{0,1}, and the input fragment permutes
//     its columns alike (a product over k is any order of k, the same for every row and token).
//   - The input comes through load_x(tok, col, b[4]) as the bf16 of its columns col..col + 7,
//     two a word (the low half the even column): the RMS ops round their normed residual,
//     itself read as bf16 (residual_in; rms_bf16_x8; the reference's bf16_inputs mode mirrors
//     both); O_PROJ's and DOWN's inputs are stored as bf16 by their producers
//     (isa.BF16_INPUTS) and loaded as they are.
//   - A pass takes a pair of row groups and up to MMA_NT token tiles: each chunk's weight
//     fragments are loaded once and multiplied by every token tile of the pass.
//   - The k-loop is split over the block's warps in fixed chunk ranges; their partials go to
//     shared memory and epi(q0, tok0, sum) adds them in warp order (sum(q, r, n): row r of
//     group q0 + q, token tok0 + n). Neither split depends on ntok, and mma's columns are
//     independent: a token's numbers never depend on the step's other tokens.
#define MMA_KC MK_MMA_KC          // isa.MMA_KC: input columns per chunk (a lane: 8 of them)
#define MMA_RG MK_MMA_RG          // isa.MMA_RG: row groups of 16 per pass (one input fragment)
#define MMA_UNROLL MK_MMA_UNROLL  // isa.MMA_UNROLL: chunks whose loads a lane issues at once
// token tiles (8 tokens each) a pass multiplies by each chunk's weight fragments, loaded once:
// a block reads its weight tile once per 8 x isa.MMA_NT of its step's tokens
#define MMA_NT cmin(MK_MMA_NT, (MK_T_MAX + 7) / 8)

struct MmaShared {
  float part[NWARPS][MMA_RG][16][8];  // the warps' partial sums of a pass's token tile
  float rms[MK_T_MAX];                // 1 / rms of each input row (RMS ops)
  int rows[MK_T_MAX];                 // the LM head: the step's rows with logits
  float best[MK_T_MAX];               // the LM head: each row's best score so far
  int best_id[MK_T_MAX];
};

__device__ __forceinline__ unsigned bf16_pack(float lo, float hi) {
  return (unsigned)f32_to_bf16(lo) | (unsigned)f32_to_bf16(hi) << 16;
}

// A pass's input fragments of one chunk (columns col..col + 7 a lane) for its token tiles j < nt
// (tokens tb0 + 8 j + g; zeros past ntok, past the tiles or where !ok).
template <int NT, class LoadX>
__device__ __forceinline__ void mma_load_tiles(LoadX& load_x, int tb0, int nt, int ntok, int col,
                                               bool ok, unsigned (&x)[NT][4]) {
  const int g = (threadIdx.x & 31) >> 2;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int tok = tb0 + 8 * j + g;
    if (ok && j < nt && tok < ntok) {
      load_x(tok, col, x[j]);
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) x[j][k] = 0u;
    }
  }
}

// acc[j] += a row group's chunk (its rows g and g + 8, 8 columns a lane: two k-steps) x token
// tile j's input fragments, for j < nt.
template <int NT>
__device__ __forceinline__ void mma_tiles(float (&acc)[NT][4], const uint4 (&a)[2],
                                          const unsigned (&x)[NT][4], int nt) {
  const unsigned a0[4] = {a[0].x, a[1].x, a[0].y, a[1].y};
  const unsigned a1[4] = {a[0].z, a[1].z, a[0].w, a[1].w};
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    if (j >= nt) continue;
    const unsigned b0[2] = {x[j][0], x[j][1]};
    const unsigned b1[2] = {x[j][2], x[j][3]};
    mma_m16n8k16_bf16(acc[j], a0, b0, acc[j]);
    mma_m16n8k16_bf16(acc[j], a1, b1, acc[j]);
  }
}

// A pass that splits the rows over the warps (block_mma in a step of more than
// MMA_ROWS_SPLIT_ABOVE rows, K <= MMA_ROWS_SPLIT_MAX_K): warp w multiplies row group q0 + w by
// up to MMA_RT token tiles over block_mma's k ranges, one after the other, each range's
// partial from zero and added to the sum in warp order: every sum is the k split's, bit for
// bit, but a block reads its weight tile once per 64 tokens and the pass's inputs once per
// NWARPS row groups. The sums live in dynamic shared memory (registers: the megakernel
// spilled), each lane's own words until the epilogue. A warp walks every chunk of k (C /
// MMA_ROWS_UNROLL rounds, their weights copied MMA_RING - 1 rounds ahead into a cp.async ring
// after the sums), so long k (DOWN's) and small steps keep the k split.
#define MMA_ROWS_SPLIT_ABOVE MK_MMA_ROWS_SPLIT_ABOVE  // isa.MMA_ROWS_SPLIT_ABOVE
#define MMA_ROWS_SPLIT_MAX_K MK_MMA_ROWS_SPLIT_MAX_K  // isa.MMA_ROWS_SPLIT_MAX_K
#define MMA_RT cmin(MK_MMA_RT, (MK_T_MAX + 7) / 8)    // isa.MMA_RT: token tiles a pass
#define MMA_ROWS_UNROLL MK_MMA_ROWS_UNROLL  // isa.MMA_ROWS_UNROLL: chunks' weights loaded at once
#define MMA_RING MK_MMA_RING  // isa.MMA_RING: rounds in a lane's ring (MMA_RING - 1 in flight)
#define MMA_SUMS_BYTES (MMA_RT * NWARPS * 16 * 8 * 4)
// A kernel with block_mma_rows' ring (steps of more than MMA_ROWS_SPLIT_ABOVE tokens) and the
// registers for it (header.k_split_ring: head_dim 64) runs block_mma's k split through it too:
// a round of one chunk, MMA_RG row groups x 2 halves of 16 bytes a lane, the size of
// block_mma_rows' round (benchmarks/NOTES.md "block_mma's weights through the ring"); other
// kernels load those weights into registers
#define MMA_K_RING MK_K_RING
static_assert(!MMA_K_RING || (MK_MMA && MK_T_MAX > MMA_ROWS_SPLIT_ABOVE),
              "block_mma's ring is block_mma_rows'");
#if MK_MMA && MK_T_MAX > MMA_ROWS_SPLIT_ABOVE
static_assert(MMA_RG <= MMA_ROWS_UNROLL, "block_mma's round in block_mma_rows' ring slot");
static_assert(MK_DYN_SMEM >= MMA_SUMS_BYTES + MMA_RING * MMA_ROWS_UNROLL * 2 * MK_THREADS * 16,
              "block_mma_rows' sums and ring");
static_assert(MK_RMS_STAGE_AT >= MMA_SUMS_BYTES + MMA_RING * MMA_ROWS_UNROLL * 2 * MK_THREADS * 16,
              "the staged rows over block_mma_rows' ring");
#endif

// The cp.async ring block_mma_rows and block_mma's k split copy their weights into, after
// block_mma_rows' sums in dynamic shared memory: [MMA_RING][4][threads] 16 bytes, this
// thread's slots (each a lane's own: it copies them and reads them after its wait).
__device__ __forceinline__ uint4* mma_ring() {
  return
      reinterpret_cast<uint4*>(static_cast<char*>(dynamic_smem()) + MMA_SUMS_BYTES) + threadIdx.x;
}

template <int K, class RowPtr, class LoadX, class Epi>
__device__ void block_mma_rows(int groups, int ntok, RowPtr rowptr, LoadX load_x, Epi epi) {
  constexpr int C = (K + MMA_KC - 1) / MMA_KC, NT = MMA_RT;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  // the pass's sums: [token tile][row group of the pass][16][8]
  float (*sums)[NWARPS][16][8] = static_cast<float (*)[NWARPS][16][8]>(dynamic_smem());
  // the ring: [MMA_RING][MMA_ROWS_UNROLL][2][threads] 16 bytes, each a lane's own (cp.async by
  // the lane, read by the lane after its wait: no barrier), MMA_RING - 1 rounds in flight while
  // one is multiplied, so the weights' L2 and HBM reads run beside the mma
  uint4* const ring = mma_ring();
  // (no barrier first: the instruction before, attention's tiles in dynamic shared memory,
  // ended with the block's barrier in run_step; mma_rms' staged rows lie beside the ring)
  for (int tb0 = 0; tb0 < ntok; tb0 += 8 * NT) {
    const int nt = min(NT, (ntok - tb0 + 7) / 8);  // the pass's token tiles (warp-uniform)
    for (int qb = 0; qb < groups; qb += NWARPS) {
      const int q = qb + warp;  // this warp's row group (none past the tile: no k loop)
      // a group's row past the tile multiplies the group's row 0: every epilogue stops at the
      // tile's rows and a row of an mma's D depends on its own row of A alone, so those sums
      // are never read, and the ring needs no null check (with one, Qwen3's 8/8 kernel spilled)
      const unsigned short* w[2] = {nullptr, nullptr};
      if (q < groups) {
        w[0] = rowptr(q, g);
        w[1] = rowptr(q, g + 8);
        if (w[0] == nullptr) w[0] = rowptr(q, 0);
        if (w[1] == nullptr) w[1] = rowptr(q, 0);
      }
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) sums[j][warp][mma_d_row(i)][mma_d_col(i)] = 0.f;
      for (int r = 0; r < NWARPS && q < groups; ++r) {  // block_mma's k ranges, in warp order
        const int c_begin = r * C / NWARPS, c_end = (r + 1) * C / NWARPS;
        if (MK_PREFETCH && r + 1 < NWARPS) {  // the walk's next range into L2 while this
          // one's loads wait on HBM (the design's mma_rows_prefetch): lane (g, t) the 128-byte
          // lines t, t + 4, ... of its rows g and g + 8
          const int e = min(K, (r + 2) * C / NWARPS * MMA_KC);
          for (int c = c_end * MMA_KC + 64 * t; c < e; c += 256)
#pragma unroll
            for (int h = 0; h < 2; ++h) prefetch_line(w[h] + c);
        }
        float acc[NT][4];
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[j][i] = 0.f;
        // the range's round c (its chunks c0 = c_begin + c MMA_ROWS_UNROLL ...) into ring slot
        // c mod MMA_RING, a cp.async group (empty past the range)
        const auto issue = [&](int c0, int slot) {
#pragma unroll
          for (int u = 0; u < MMA_ROWS_UNROLL; ++u) {
            const int col = (c0 + u) * MMA_KC + 8 * t;
#pragma unroll
            for (int h = 0; h < 2; ++h)
              if (c0 + u < c_end && col < K)
                cp_async_16(ring + ((slot * MMA_ROWS_UNROLL + u) * 2 + h) * MK_THREADS, w[h] + col);
          }
          cp_async_commit();
        };
#pragma unroll
        for (int c = 0; c + 1 < MMA_RING; ++c) issue(c_begin + c * MMA_ROWS_UNROLL, c);
        int slot = 0;  // this round's
        for (int c0 = c_begin; c0 < c_end; c0 += MMA_ROWS_UNROLL) {
          // MMA_RING - 1 rounds ahead, then this round's copies landed
          issue(c0 + (MMA_RING - 1) * MMA_ROWS_UNROLL, slot == 0 ? MMA_RING - 1 : slot - 1);
          cp_async_wait_group<MMA_RING - 1>();
          const int take = slot;
          slot = slot + 1 == MMA_RING ? 0 : slot + 1;
#pragma unroll
          for (int u = 0; u < MMA_ROWS_UNROLL; ++u) {  // each chunk: its inputs (L1: every warp
            const int col = (c0 + u) * MMA_KC + 8 * t;  // of the block reads them), then its
            const bool ok = c0 + u < c_end && col < K;  // weights from the lane's ring slot
            unsigned x[NT][4];
            mma_load_tiles<NT>(load_x, tb0, nt, ntok, col, ok, x);
            uint4 a[2];
#pragma unroll
            for (int h = 0; h < 2; ++h)
              a[h] = ok ? ring[((take * MMA_ROWS_UNROLL + u) * 2 + h) * MK_THREADS]
                        : make_uint4(0u, 0u, 0u, 0u);
            mma_tiles<NT>(acc, a, x, nt);
          }
        }
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int i = 0; i < 4; ++i) sums[j][warp][mma_d_row(i)][mma_d_col(i)] += acc[j][i];
      }
      __syncthreads();
      for (int j = 0; j < nt; ++j)
        for (int p = 0; p < NWARPS && qb + p < groups; p += MMA_RG)
          epi(qb + p, tb0 + 8 * j,
              [&](int qq, int rr, int n) { return sums[j][p + qq][rr][n]; });
      __syncthreads();  // sums: the next pass's
    }
  }
}

template <int K, bool RING = MMA_K_RING, class RowPtr, class LoadX, class Epi>
__device__ void block_mma(MmaShared& sm, int groups, int ntok, RowPtr rowptr, LoadX load_x,
                          Epi epi) {
  static_assert(K % 8 == 0, "a lane loads 8 columns at a time");
  if (MK_T_MAX > MMA_ROWS_SPLIT_ABOVE && K <= MMA_ROWS_SPLIT_MAX_K &&
      ntok > MMA_ROWS_SPLIT_ABOVE) {
    block_mma_rows<K>(groups, ntok, rowptr, load_x, epi);
    return;
  }
  constexpr int C = (K + MMA_KC - 1) / MMA_KC, NT = MMA_NT;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int c_begin = warp * C / NWARPS, c_end = (warp + 1) * C / NWARPS;
  // (the ring: no barrier first, as in block_mma_rows)
  for (int tb0 = 0; tb0 < ntok; tb0 += 8 * NT) {
    const int nt = min(NT, (ntok - tb0 + 7) / 8);  // the pass's token tiles (warp-uniform)
    for (int q0 = 0; q0 < groups; q0 += MMA_RG) {
      const unsigned short* w[MMA_RG][2];
#pragma unroll
      for (int q = 0; q < MMA_RG; ++q) {
        w[q][0] = q0 + q < groups ? rowptr(q0 + q, g) : nullptr;
        w[q][1] = q0 + q < groups ? rowptr(q0 + q, g + 8) : nullptr;
      }
      float acc[MMA_RG][NT][4];
#pragma unroll
      for (int q = 0; q < MMA_RG; ++q)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[q][j][i] = 0.f;
      if constexpr (RING) {
        // the ring (mma_ring): a round is one chunk, [MMA_RG][2][threads] 16 bytes, each a
        // lane's own, MMA_RING - 1 chunks in flight while one is multiplied
        uint4* const ring = mma_ring();
        // a row past the tile multiplies row 0 of group q0 (block_mma_rows' reason: the
        // epilogue stops at the tile's rows, a row of D depends on its own row of A alone)
        const unsigned short* const w0 = rowptr(q0, 0);
        int off[MMA_RG][2];  // each row as an offset (elements) from w0
#pragma unroll
        for (int q = 0; q < MMA_RG; ++q)
#pragma unroll
          for (int h = 0; h < 2; ++h) off[q][h] = w[q][h] == nullptr ? 0 : (int)(w[q][h] - w0);
        // chunk c's weights into ring slot `slot`, a cp.async group (empty past the range)
        const auto issue = [&](int c, int slot) {
          const int col = c * MMA_KC + 8 * t;
          if (c < c_end && col < K) {
#pragma unroll
            for (int q = 0; q < MMA_RG; ++q)
#pragma unroll
              for (int h = 0; h < 2; ++h)
                cp_async_16(ring + ((slot * MMA_RG + q) * 2 + h) * MK_THREADS,
                            w0 + off[q][h] + col);
          }
          cp_async_commit();
        };
#pragma unroll
        for (int c = 0; c + 1 < MMA_RING; ++c) issue(c_begin + c, c);
        int slot = 0;  // this chunk's
        for (int c0 = c_begin; c0 < c_end; ++c0) {
          // MMA_RING - 1 chunks ahead, then this chunk's copies landed
          issue(c0 + MMA_RING - 1, slot == 0 ? MMA_RING - 1 : slot - 1);
          cp_async_wait_group<MMA_RING - 1>();
          const int take = slot;
          slot = slot + 1 == MMA_RING ? 0 : slot + 1;
          const int col = c0 * MMA_KC + 8 * t;
          const bool ok = col < K;
          unsigned x[NT][4];  // the input fragments' words, then the weights from the ring
          mma_load_tiles<NT>(load_x, tb0, nt, ntok, col, ok, x);
#pragma unroll
          for (int q = 0; q < MMA_RG; ++q) {
            uint4 a[2];
#pragma unroll
            for (int h = 0; h < 2; ++h)
              a[h] = ok ? ring[((take * MMA_RG + q) * 2 + h) * MK_THREADS]
                        : make_uint4(0u, 0u, 0u, 0u);
            mma_tiles<NT>(acc[q], a, x, nt);
          }
        }
      } else {
        for (int c0 = c_begin; c0 < c_end; c0 += MMA_UNROLL) {
          uint4 a[MMA_UNROLL][MMA_RG][2];
          unsigned x[MMA_UNROLL][NT][4];  // the input fragments' words: bf16 of columns 2i, 2i + 1
#pragma unroll
          for (int u = 0; u < MMA_UNROLL; ++u) {  // every load of the chunks first
            const int col = (c0 + u) * MMA_KC + 8 * t;
            const bool ok = c0 + u < c_end && col < K;
#pragma unroll
            for (int q = 0; q < MMA_RG; ++q)
#pragma unroll
              for (int h = 0; h < 2; ++h)
                a[u][q][h] = ok && w[q][h] ? __ldg(reinterpret_cast<const uint4*>(w[q][h] + col))
                                           : make_uint4(0u, 0u, 0u, 0u);
            mma_load_tiles<NT>(load_x, tb0, nt, ntok, col, ok, x[u]);
          }
#pragma unroll
          for (int u = 0; u < MMA_UNROLL; ++u)
#pragma unroll
            for (int q = 0; q < MMA_RG; ++q) mma_tiles<NT>(acc[q], a[u][q], x[u], nt);
        }
      }
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        if (j >= nt) break;
#pragma unroll
        for (int q = 0; q < MMA_RG; ++q)
#pragma unroll
          for (int i = 0; i < 4; ++i)
            sm.part[warp][q][mma_d_row(i)][mma_d_col(i)] = acc[q][j][i];
        __syncthreads();
        epi(q0, tb0 + 8 * j, [&](int q, int r, int n) {
          float v = 0.f;
#pragma unroll
          for (int k = 0; k < NWARPS; ++k) v += sm.part[k][q][r][n];
          return v;
        });
        __syncthreads();  // sm.part: the next token tile's
      }
    }
  }
}

// x = bf16 of rmsnorm(v)[col..col + 8) * w, two a word (v: the row's residual as bf16,
// residual_in; r: its 1 / rms)
__device__ __forceinline__ void rms_bf16_x8(const unsigned short* v, float r,
                                            const unsigned short* w, int col, unsigned (&x)[4]) {
  const uint4 a = *reinterpret_cast<const uint4*>(v + col);
  const uint4 gw = __ldg(reinterpret_cast<const uint4*>(w + col));
  x[0] = bf16_pack(bf_lo(a.x) * r * bf_lo(gw.x), bf_hi(a.x) * r * bf_hi(gw.x));
  x[1] = bf16_pack(bf_lo(a.y) * r * bf_lo(gw.y), bf_hi(a.y) * r * bf_hi(gw.y));
  x[2] = bf16_pack(bf_lo(a.z) * r * bf_lo(gw.z), bf_hi(a.z) * r * bf_hi(gw.z));
  x[3] = bf16_pack(bf_lo(a.w) * r * bf_lo(gw.w), bf_hi(a.w) * r * bf_hi(gw.w));
}

// x = the bf16 elements v[col..col + 8), two a word (one 16-byte load): attn and ffn_h as a
// tensor-core build stores them (isa.BF16_INPUTS), the fragment's words as they are
__device__ __forceinline__ void load_bf16_x8(const unsigned short* v, int col, unsigned (&x)[4]) {
  const uint4 a = *reinterpret_cast<const uint4*>(v + col);
  x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
}

// The RMS ops' staged inputs (mma_rms): row i of a step share at rms_stage() + i *
// RMS_STAGE_LD bf16, in dynamic shared memory after block_mma_rows' sums (header.py
// rms_stage_rows: MK_RMS_STAGE_FIT rows fit; a build may stage fewer, -DMK_RMS_STAGE_ROWS)
#ifndef MK_RMS_STAGE_ROWS
#define MK_RMS_STAGE_ROWS MK_RMS_STAGE_FIT
#endif
#define RMS_STAGE_LD MK_RMS_STAGE_LD  // header.rms_stage_ld: fragment loads free of conflicts
static_assert(MK_RMS_STAGE_ROWS <= MK_RMS_STAGE_FIT, "more staged rows than fit");
static_assert(MK_RMS_STAGE_AT + MK_RMS_STAGE_FIT * RMS_STAGE_LD * 2 <= MK_DYN_SMEM,
              "the staged rows past dynamic shared memory");
__device__ __forceinline__ unsigned short* rms_stage() {
  return reinterpret_cast<unsigned short*>(static_cast<char*>(dynamic_smem()) + MK_RMS_STAGE_AT);
}

// Each input row's 1 / rms (as rms_apply computes it, a warp per row, of the row as bf16): x
// (residual_in) row i at x + row(i) * H for i < n. The share's first MK_RMS_STAGE_ROWS rows
// are normed here once too: the warp reads its row again right after its sum (from L1) and
// stores the bf16 inputs block_mma would build from it (rms_bf16_x8 with the norm weights w)
// in rms_stage(), so those rows come from L2 once and every pass reads them in shared memory
// (rms_load_x); the rest are normed from residual_in in every pass. Returns how many rows it
// staged; the numbers are the same either way.
template <class Row>
__device__ int mma_rms(MmaShared& sm, const unsigned short* x, int n, Row row,
                       const unsigned short* w) {
  const int lane = threadIdx.x & 31;
  const int staged = min(n, MK_RMS_STAGE_ROWS);
  for (int i = threadIdx.x >> 5; i < n; i += NWARPS) {
    const unsigned short* v = x + (size_t)row(i) * H;
    float ss = 0.f;
    for (int k = lane; k < H; k += 32) {
      const float a = bf16_to_f32(v[k]);
      ss += a * a;
    }
    ss = warp_sum(ss);  // (a butterfly: every lane holds the same sum)
    const float r = 1.0f / sqrtf(ss / (float)H + MK_RMS_EPS);
    if (lane == 0) sm.rms[i] = r;
    if (i < staged) {
      unsigned short* out = rms_stage() + (size_t)i * RMS_STAGE_LD;
      for (int col = 8 * lane; col < H; col += 8 * 32) {
        unsigned b[4];
        rms_bf16_x8(v, r, w, col, b);
        *reinterpret_cast<uint4*>(out + col) = make_uint4(b[0], b[1], b[2], b[3]);
      }
    }
  }
  __syncthreads();
  return staged;
}

// block_mma's load_x of an RMS op: input row i's bf16 columns col..col + 7 from the staged
// rows (i < staged: mma_rms'), or normed from its residual_in row v (r: its 1 / rms, w: the
// norm weights)
__device__ __forceinline__ void rms_load_x(int staged, int i, const unsigned short* v, float r,
                                           const unsigned short* w, int col, unsigned (&x)[4]) {
  if (i < staged)
    load_bf16_x8(rms_stage() + (size_t)i * RMS_STAGE_LD, col, x);
  else
    rms_bf16_x8(v, r, w, col, x);
}

// block_mma's rows of a tile of n consecutive weight rows (W: the tile's first, ld elements
// each), 16 a group: O_PROJ, DOWN and the LM head.
__device__ __forceinline__ auto tile_rows(const unsigned short* W, int n, int ld) {
  return [=](int q, int r) -> const unsigned short* {
    const int k = q * 16 + r;
    return k < n ? W + (size_t)k * ld : nullptr;
  };
}

// block_mma's epilogue of O_PROJ and DOWN: res[tok][b + k] += Y[tok][k] for the pass's rows
// k < n (the tile's residual rows, this block's own) and tokens < ntok; with MK_RES_IN_EPI
// (header.residual_in_epilogue) also the bf16 copy the RMS ops read, res_in (residual_in at
// the same offsets), of the sum it stored.
template <class Sum>
__device__ __forceinline__ void mma_add_rows(float* res, mk_in_t* res_in, int b, int n,
                                             int ntok, int q0, int tok0, Sum sum) {
  for (int i = threadIdx.x; i < MMA_RG * 128; i += MK_THREADS) {
    const int q = i / 128, r = (i / 8) % 16, m = i % 8;
    const int k = (q0 + q) * 16 + r, tok = tok0 + m;
    if (k < n && tok < ntok) {
      const size_t at = (size_t)tok * H + b + k;
      const float v = res[at] + sum(q, r, m);
      res[at] = v;
#if MK_RES_IN_EPI
      res_in[at] = f32_to_bf16(v);
#else
      (void)res_in;
#endif
    }
  }
}

// After O_PROJ's or DOWN's block_mma (its last barrier orders the epilogue's writes before
// these reads), where the epilogue does not store it (MK_RES_IN_EPI 0: at head_dim 128 that
// store spills the kernel): the bf16 copy the RMS ops read (residual_in) of the rows [b, e)
// of tokens [t0, t0 + n) the epilogue added to.
__device__ __forceinline__ void store_residual_in(const Params& P, int t0, int b, int e, int n) {
  if (MK_RES_IN_EPI) return;
  const int w = e - b;
  for (int i = threadIdx.x; i < w * n; i += MK_THREADS) {
    const size_t at = (size_t)(t0 + i / w) * H + b + i % w;
    P.residual_in[at] = f32_to_bf16(P.residual[at]);
  }
}

// A mat-mul instruction's rows [b, e) and tokens [t0, t1) this step (kernel/token_groups.py,
// isa Word.GROUP and GROUP_TILE, their fields isa.PACKED_WORDS'): in a step of at least its
// op's min_tokens tokens, its token group's rows for its share of them, [j n / c, (j + 1) n /
// c) of c members; else its own tile for every token. Either way a token's rows have the same
// k-loop: its numbers do not change.
struct MmaTile {
  int b, e, t0, t1;
};
__device__ __forceinline__ MmaTile token_group(const int* ins, int ntok) {
  const int g = ins[W_GROUP], c = MK_GROUP_MEMBERS(g), j = MK_GROUP_INDEX(g);
  if (c > 1 && ntok >= MK_GROUP_MIN_TOKENS(g))
    return {MK_GROUP_TILE_BEGIN(ins[W_GROUP_TILE]), MK_GROUP_TILE_END(ins[W_GROUP_TILE]),
            j * ntok / c, (j + 1) * ntok / c};
  return {ins[W_TILE_BEGIN], ins[W_TILE_END], 0, ntok};
}
#endif  // MK_MMA

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

// Issue L2 prefetches for [p, p + bytes), one 128-byte line per thread per pass.
__device__ __forceinline__ void prefetch_l2(const void* p, size_t bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  if (bytes > PREFETCH_MAX_BYTES) bytes = PREFETCH_MAX_BYTES;
  for (size_t off = (size_t)threadIdx.x * 128; off < bytes; off += (size_t)MK_THREADS * 128)
    prefetch_line(c + off);
}

// ================================================================================================
// Synchronisation: wait (acquire spin with watchdog) and signal (barrier, then a release add)
// ================================================================================================
// MK_SYNC=2 (default): the hop of PERFORMANCE.md R4. Signal: __syncthreads, then thread 0 adds 1
// with `red.release.gpu` - no __threadfence (fence.sc.gpu: MEMBAR.SC.GPU + CCTL.IVALL in the
// SASS). Wait: thread 0 polls ONE `ld.acquire.gpu` of the counter per trip; the error word and
// %globaltimer only every POLL_CHECK trips; no __nanosleep for the first SPIN_NS of a wait.
// MK_SYNC=1: the fenced hop (fence + relaxed atomicAdd; error word, counter, timer and a
// nanosleep every trip), kept as the A/B twin (backend cuda-sync1) until a GPU has measured both.
//
// Why the release add by ONE thread publishes the stores of EVERY thread of the block (PTX ISA,
// memory consistency model, 8.9.4-8.9.5): a store W by thread t precedes t's bar.sync in program
// order; that bar.sync synchronizes with thread 0's bar.sync on the same barrier (8.9.4 item 2);
// thread 0's red.release.gpu follows its bar.sync in program order; it is a release pattern that
// synchronizes with the consumer's ld.acquire.gpu (item 4): the load reads the value of this add
// or of a later add to the counter, every one an atomic, so the add precedes the load in
// observation order (8.9.2), and the two are morally strong (both strong, gpu scope containing
// both threads, same address and size). Base causality order is transitive (8.9.5: "the
// transitivity of base causality order accounts for the cumulativity of synchronizing
// operations"), so W precedes the acquire, and through the consumer's own __syncthreads every
// read R of W's address by any consumer thread: R cannot read a value older than W. No
// fence.acq_rel is needed beside the release; MK_SYNC=1's fence.sc is stronger than required.
// (HazyResearch's Megakernels signals with a relaxed atomicAdd after its TMA stores complete and
// polls a volatile load, which this model does not order; we keep the release/acquire pair.)
// The emulator maps the add to a C++ release fetch_add and the poll to an acquire load, so the
// strict-memory TSan build (cuda_cpu_strict.h) checks the same happens-before chain: barrier
// (mutex) -> release RMW -> acquire load -> barrier.
#ifndef MK_SYNC
#define MK_SYNC 2
#endif
#define POLL_CHECK 16       // polls per check of the error word and the watchdog (power of 2)
#define SPIN_NS 4000        // a wait spins without __nanosleep for its first SPIN_NS
static_assert((POLL_CHECK & (POLL_CHECK - 1)) == 0, "POLL_CHECK must be a power of 2");

// *p += v as a release at gpu scope (no return value: RED, not ATOM).
__device__ __forceinline__ void red_add_release(int* p, int v) {
#ifdef __CUDA_ARCH__
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
#elif defined(__CUDACC__)  // nvcc's host pass parses device bodies but never runs them
  *p += v;
#else
  emu::red_add_release(p, v);
#endif
}

// A ticket: returns *p, then *p += v, as an acq_rel RMW at gpu scope (MK_SYNC=2): a release of
// this block's stores issued before it (after a barrier, as a signal) and, for the drawer of the
// last ticket, an acquire of every earlier drawer's (each RMW continues the release sequence of
// the ones before it). MK_SYNC=1: fence + relaxed atomicAdd, then an acquire
// load of the counter.
__device__ __forceinline__ int ticket_add(int* p, int v) {
#if MK_SYNC >= 2
#ifdef __CUDA_ARCH__
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v)
               : "memory");
  return old;
#elif defined(__CUDACC__)
  const int old = *p;
  *p += v;
  return old;
#else
  return emu::atom_add_acq_rel(p, v);
#endif
#else
  __threadfence();
  const int old = atomicAdd(p, v);
  (void)load_acquire(p);
  return old;
#endif
}

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
// watchdog_ms: the state word S_WATCHDOG_MS, read by the caller from shared memory (a deadline
// held in registers through every op spilled Qwen3's tensor-core megakernel).
__device__ bool wait_counter(const Params& P, int counter, int target, int instr, int op,
                             int watchdog_ms) {
  __shared__ int s_ok;
  if (threadIdx.x == 0) {
    const long long deadline_ns = (long long)watchdog_ms * 1000000LL;
    int ok = 1;
    int seen = load_acquire(&P.counters[counter]);
    if (seen < target) {
      const unsigned long long start = global_timer_ns();
#if MK_SYNC >= 2
      bool sleep = false;
      for (unsigned n = 1; seen < target; ++n) {
        if ((n & (POLL_CHECK - 1)) == 0) {
          if (load_acquire(&P.error[E_CODE]) != 0) { ok = 0; break; }
          const long long waited = (long long)(global_timer_ns() - start);
          if (waited > deadline_ns) {
            record_error(P, ERR_WATCHDOG, instr, op, counter, target, seen);
            ok = 0;
            break;
          }
          sleep = waited > SPIN_NS;
        }
        if (sleep) __nanosleep(32);
        seen = load_acquire(&P.counters[counter]);
      }
#else
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
#endif
    }
    s_ok = ok;
  }
  __syncthreads();
  return s_ok != 0;
}

__device__ void signal_counter(const Params& P, int counter) {
  __syncthreads();  // every thread's stores of this instruction are issued
  if (threadIdx.x == 0) {
#if MK_SYNC >= 2
    red_add_release(&P.counters[counter], 1);  // ... and published by the release (see above)
#else
    __threadfence();  // ... and visible GPU-wide before the count moves
    atomicAdd(&P.counters[counter], 1);
#endif
  }
}

// ================================================================================================
// Shared memory of the ops (static: the shim gives each emulated block its own copy)
// ================================================================================================
// EMBED stages a step's rows by cp.async in a kernel of many tokens on tensor cores (op_embed)
#define EMBED_STAGED (MK_MMA && MK_T_MAX > 1)
#define EMBED_STAGE MK_EMBED_STAGE_BYTES  // isa.EMBED_STAGE_BYTES: the stage's bytes

struct OpShared {
  union {
    alignas(16) float vec[VEC_MAX];  // normed residual / merged attention / ffn h
#if EMBED_STAGED
    alignas(16) unsigned short embed[EMBED_STAGE / 2];  // EMBED: a pass's rows (op_embed)
#endif
  };
  alignas(16) float row[MK_HEAD_DIM];       // RMS_QKV_ROPE: one head's q, k or v rows
  alignas(16) float q[MK_GROUP * MK_HEAD_DIM];  // ATTENTION: the group's queries
  alignas(16) float o[MK_GROUP * MK_HEAD_DIM];  // ATTENTION: running outputs
  float score[MK_GROUP * T_TILE];           // ATTENTION: scores, then probabilities
  float m[MK_GROUP], l[MK_GROUP], corr[MK_GROUP];
  float best[NWARPS];
  int best_id[NWARPS];
  int words[3][MK_WIDTH];  // the VM loop's instruction words: this one, the next, the one after
#if MK_MMA
  MmaShared mma;  // the mat-muls on tensor cores
#endif
};

__device__ __forceinline__ unsigned short* chunk_keys() {
  return static_cast<unsigned short*>(dynamic_smem());
}

// ================================================================================================
// Op: EMBED - residual[b:e] = embed[token, b:e]
// ================================================================================================
// false (every block then stops) for a token outside the vocabulary: a NaN step leaves -1 in
// the state (the host reads it as the NaN), and a launch repeated as it is (the bench's
// replays) must not embed it from outside the table.
// A chunk's tokens after the first come from feed[] (the prompt, written before the launch);
// a step of many sequences' from its token table.
__device__ bool op_embed(const Params& P, OpShared& s, const int* ins, const int* st,
                         int instr) {
  const int b = ins[W_TILE_BEGIN], e = ins[W_TILE_END], ntok = step_tokens(st);
  const auto token_of = [&](int tok) {
    return MK_SLOTS ? step_row(st, tok)[R_TOKEN]
                    : tok == 0 ? st[S_TOKEN] : P.feed[st[S_POS] + tok];
  };
#if EMBED_STAGED
  // A step of many rows: a row after another would be a dependent HBM trip each (T of them).
  // A pass of EMBED_STAGE bytes at a time, the rows' 16-byte chunks of the tile (8 columns
  // each, from the chunk holding b to the one holding e - 1) go by cp.async into s.embed,
  // every copy issued before the wait (no register holds a loaded value: the megakernel has
  // none to spare), each copy's thread checking its row's token; then the tile's (row,
  // column) elements over the threads from there. The first row outside the vocabulary is
  // the one reported (earlier passes' rows were all inside it).
  static_assert(H % 8 == 0, "an embedding row is whole 16-byte chunks (cp.async)");
  static_assert(EMBED_STAGE % 16 == 0 && EMBED_STAGE >= 16 * (H / 8 + 1),
                "a pass holds at least a row of the widest tile's chunks");
  const int c0 = b / 8, chunks = max((e + 7) / 8 - c0, 1), w = e - b;
  const int per_pass = EMBED_STAGE / (16 * chunks);
  for (int r0 = 0; r0 < ntok; r0 += per_pass) {
    const int rows = min(per_pass, ntok - r0);
    if (r0 > 0) __syncthreads();  // the previous pass's reads of the stage are done
    bool bad = false;
    for (int i = threadIdx.x; i < rows * chunks; i += MK_THREADS) {
      const int r = i / chunks, token = token_of(r0 + r);
      if (token < 0 || token >= MK_VOCAB) bad = true;
      else if (w > 0)
        cp_async_16(s.embed + 8 * i, P.embed + (size_t)token * H + 8 * (c0 + i - r * chunks));
    }
    cp_async_wait();
    if (__syncthreads_or(bad)) {
      if (threadIdx.x == 0) {
        int r = r0;
        while (token_of(r) >= 0 && token_of(r) < MK_VOCAB) ++r;
        record_error(P, ERR_BAD_TOKEN, instr, OP_EMBED, -1, MK_VOCAB, token_of(r));
      }
      return false;
    }
    for (int i = threadIdx.x; i < rows * w; i += MK_THREADS) {
      const int r = i / w, c = i - r * w;
      const unsigned short v = s.embed[8 * chunks * r + b - 8 * c0 + c];
      const size_t at = (size_t)(r0 + r) * H + b + c;
      P.residual[at] = bf16_to_f32(v);
      P.residual_in[at] = v;  // its bf16 copy: the embedding's bits
    }
  }
  return true;
#else
  // one row (the one-token kernel) or the CUDA-core kernel of many tokens: a row after another
  (void)s;
  for (int tok = 0; tok < ntok; ++tok) {
    const int token = token_of(tok);
    if (token < 0 || token >= MK_VOCAB) {
      if (threadIdx.x == 0) record_error(P, ERR_BAD_TOKEN, instr, OP_EMBED, -1, MK_VOCAB, token);
      return false;
    }
    const unsigned short* row = P.embed + (size_t)token * H;
    float* res = P.residual + (size_t)tok * H;
#if MK_MMA
    mk_in_t* res_in = P.residual_in + (size_t)tok * H;  // its bf16 copy: the embedding's bits
    for (int i = b + threadIdx.x; i < e; i += MK_THREADS) {
      const unsigned short v = __ldg(row + i);
      res[i] = bf16_to_f32(v);
      res_in[i] = v;
    }
#else
    for (int i = b + threadIdx.x; i < e; i += MK_THREADS) res[i] = bf16_to_f32(__ldg(row + i));
#endif
  }
  return true;
#endif
}

// Late q/k (QK_NORM models): RMS_QKV_ROPE tiles are row pairs as for every model and leave q
// and the new k raw; each attention unit norms and ropes its group's queries and key (a few
// hundred values, redundant across splits), and O_PROJ caches the key afterwards.
#define LATE_QK MK_QK_NORM
#define KEY_CACHE_KEYS MK_KEY_CACHE_KEYS  // isa.KEY_CACHE_KEYS: keys an O_PROJ warp caches at once

// One warp: N head vectors k < N, out(k, j, v) for v = rope(rmsnorm(x_k) * w)[j], x_k = x(k)
// (global or shared) at position pos(k); live(k) false: the vector is skipped (its loads
// read vector 0 again). Every load of the N vectors - x, the norm weights w and the RoPE rows -
// is issued before the first use: one round trip after the wait (the weights and the RoPE row
// were prefetched into L2 before it: prefetch_weights). Lane l owns the rotation pairs (j, j +
// HALF) for j = l + 32 k. The arithmetic is pinned (no contraction: __fmul_rn / __fadd_rn), so
// a key normed here for a segment's K tile (N keys at once) and for the cache (one at a time)
// is the same value whichever instantiation ran it.
template <int N, class X, class Pos, class Live, class Out>
__device__ __forceinline__ void warp_qk_norm_rope_n(const Params& P, X x, const unsigned short* w,
                                                    Pos pos, Live live, Out out) {
  constexpr int PAIRS = (HALF + 31) / 32;
  const int lane = threadIdx.x & 31;
  float a[N][PAIRS], c[N][PAIRS], wa[PAIRS], wc[PAIRS], cs[N][PAIRS], sn[N][PAIRS];
#pragma unroll
  for (int k = 0; k < PAIRS; ++k) {
    const int j = min(lane + 32 * k, HALF - 1);  // clamped: unpredicated loads; unused past HALF
    wa[k] = bf16_to_f32(__ldg(w + j));
    wc[k] = bf16_to_f32(__ldg(w + j + HALF));
#pragma unroll
    for (int n = 0; n < N; ++n) {
      const int v = live(n) ? n : 0;
      const float* xv = x(v);
      a[n][k] = xv[j];
      c[n][k] = xv[j + HALF];
      cs[n][k] = __ldg(P.rope_cos + (size_t)pos(v) * HALF + j);
      sn[n][k] = __ldg(P.rope_sin + (size_t)pos(v) * HALF + j);
    }
  }
#pragma unroll
  for (int n = 0; n < N; ++n) {
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < PAIRS; ++k)
      if (lane + 32 * k < HALF)
        ss = __fadd_rn(ss, __fadd_rn(__fmul_rn(a[n][k], a[n][k]), __fmul_rn(c[n][k], c[n][k])));
    ss = warp_sum(ss);
    const float r = 1.0f / sqrtf(ss / (float)D + MK_RMS_EPS);
#pragma unroll
    for (int k = 0; k < PAIRS; ++k) {
      const int j = lane + 32 * k;
      if (j < HALF && live(n)) {
        const float na = __fmul_rn(__fmul_rn(a[n][k], r), wa[k]);
        const float nc = __fmul_rn(__fmul_rn(c[n][k], r), wc[k]);
        out(n, j, __fadd_rn(__fmul_rn(na, cs[n][k]), -__fmul_rn(nc, sn[n][k])));
        out(n, j + HALF, __fadd_rn(__fmul_rn(nc, cs[n][k]), __fmul_rn(na, sn[n][k])));
      }
    }
  }
  __syncwarp();
}

// One warp: out = rope(rmsnorm(x) * w) of one head vector at position pos (x may be global or
// shared).
__device__ __forceinline__ void warp_qk_norm_rope(const Params& P, const float* x,
                                                  const unsigned short* w, int pos, float* out) {
  warp_qk_norm_rope_n<1>(
      P, [&](int) { return x; }, w, [&](int) { return pos; }, [](int) { return true; },
      [&](int, int j, float v) { out[j] = v; });
}

// ================================================================================================
// Op: RMS_QKV_ROPE - tiles are row pairs (j, j + HEAD_DIM/2) of one head of Wqkv, so RoPE's
// partner row is always in the same tile.
// After the wait: the residual (one round trip), then per head segment of the tile its rows
// with their bias, RoPE entries and q/k-norm weights loaded in the same round trip.
// ================================================================================================
#if MK_MMA
// Row pair (j, j + HALF) of `head` for the step's row tok: bias, RoPE (q and k, unless late
// q/k) and the store (q, raw k, or the K/V cache).
__device__ __forceinline__ void qkv_store(const Params& P, const int* st, int layer, int tok,
                                          int head, int j, float a, float c) {
  const int pos = row_pos(st, tok);
  const bool is_q = head < MK_HEADS, is_k = !is_q && head < MK_HEADS + MK_KV_HEADS;
#if MK_HAS_BIAS
  a += bf16_to_f32(__ldg(P.bqkv + (size_t)layer * MK_QKV_DIM + head * D + j));
  c += bf16_to_f32(__ldg(P.bqkv + (size_t)layer * MK_QKV_DIM + head * D + j + HALF));
#endif
  if ((is_q || is_k) && !LATE_QK) {  // rotate-half RoPE
    const float cs = __ldg(P.rope_cos + (size_t)pos * HALF + j);
    const float sn = __ldg(P.rope_sin + (size_t)pos * HALF + j);
    const float ra = a * cs - c * sn, rc = c * cs + a * sn;
    a = ra;
    c = rc;
  }
  if (is_q) {
    float* q_out = P.q + (size_t)tok * MK_Q_DIM + head * D;
    q_out[j] = a;
    q_out[j + HALF] = c;
#if LATE_QK
  } else if (is_k) {
    float* k_raw = P.k_raw + (size_t)tok * MK_KV_DIM + (head - MK_HEADS) * D;
    k_raw[j] = a;
    k_raw[j + HALF] = c;
#endif
  } else {
    const int kvh = is_k ? head - MK_HEADS : head - MK_HEADS - MK_KV_HEADS;
    unsigned short* cache = is_k ? P.k_cache : P.v_cache;
    const size_t at = kv_at(P, layer, row_slot(st, tok), pos, kvh);
    cache[at + j] = f32_to_bf16(a);
    cache[at + j + HALF] = f32_to_bf16(c);
  }
}
#endif

__device__ void op_rms_qkv_rope(const Params& P, OpShared& s, const int* ins, const int* st,
                                const float (&g)[RMS_PER]) {
#if MK_MMA
  // the tile's row pairs [b, e) for tokens [t0, t0 + n) (token_group); a row group: 8 pairs'
  // rows j (group rows 0-7) and their partners j + HALF (rows 8-15)
  (void)g;
  const MmaTile m = token_group(ins, step_tokens(st));
  const int layer = ins[W_LAYER], b = m.b, e = m.e, t0 = m.t0, n = m.t1 - m.t0;
  if (b >= e || n <= 0) return;
  const unsigned short* W = P.wqkv + (size_t)layer * MK_QKV_DIM * H;
  const unsigned short* norm = P.in_norm + (size_t)layer * H;
  const int staged = mma_rms(s.mma, P.residual_in, n, [&](int i) { return t0 + i; }, norm);
  block_mma<H>(
      s.mma, (e - b + 7) / 8, n,
      [&](int q, int r) -> const unsigned short* {
        const int p = b + q * 8 + (r & 7);
        return p < e ? W + (size_t)((p / HALF) * D + p % HALF + (r >= 8 ? HALF : 0)) * H
                     : nullptr;
      },
      [&](int tok, int col, unsigned (&x)[4]) {
        rms_load_x(staged, tok, P.residual_in + (size_t)(t0 + tok) * H, s.mma.rms[tok], norm, col,
                   x);
      },
      [&](int q0, int tok0, auto sum) {
        for (int i = threadIdx.x; i < MMA_RG * 64; i += MK_THREADS) {
          const int q = i / 64, r = (i / 8) % 8, k = i % 8;
          const int p = b + (q0 + q) * 8 + r, tok = tok0 + k;
          if (p < e && tok < n)
            qkv_store(P, st, layer, t0 + tok, p / HALF, p % HALF, sum(q, r, k),
                      sum(q, r + 8, k));
        }
      });
#else
  const int layer = ins[W_LAYER], b = ins[W_TILE_BEGIN], e = ins[W_TILE_END];
  if (b >= e) return;
  const int t = threadIdx.x, ntok = step_tokens(st);
  const unsigned short* W = P.wqkv + (size_t)layer * MK_QKV_DIM * H;
  for (int tok = 0; tok < ntok; ++tok) {
    rms_apply(P.residual + (size_t)tok * H, g, s.vec);
    const int pos = row_pos(st, tok), slot = row_slot(st, tok);
    float* q_out = P.q + (size_t)tok * MK_Q_DIM;
#if LATE_QK
    float* k_raw = P.k_raw + (size_t)tok * MK_KV_DIM;
#endif
    for (int p = b; p < e;) {
      const int head = p / HALF;  // q heads, then k heads, then v heads
      const int j0 = p % HALF;
      const int j1 = min(HALF, j0 + (e - p));
      const int n = j1 - j0;
      const bool is_q = head < MK_HEADS, is_k = !is_q && head < MK_HEADS + MK_KV_HEADS;
      // late q/k (QK_NORM): q and k leave raw; ATTENTION norms and ropes them
      const bool rotate = (is_q || is_k) && !LATE_QK;
      // thread t: RoPE entry j0 + t, q/k-norm weight of element t (issued with the rows below)
      float cs = 1.f, sn = 0.f;
      if (rotate && t < n) {
        cs = __ldg(P.rope_cos + (size_t)pos * HALF + j0 + t);
        sn = __ldg(P.rope_sin + (size_t)pos * HALF + j0 + t);
      }
      // rows k < n: j0 + k; rows k >= n: their RoPE partners j0 + k - n + HALF
      auto row_j = [&](int k) { return k < n ? j0 + k : j0 + k - n + HALF; };
      block_dot_rows<H>(
          2 * n, [&](int k) { return W + (size_t)(head * D + row_j(k)) * H; }, s.vec,
          [&](int k) {
#if MK_HAS_BIAS
            return bf16_to_f32(__ldg(P.bqkv + (size_t)layer * MK_QKV_DIM + head * D + row_j(k)));
#else
            (void)k;
            return 0.f;
#endif
          },
          [&](int k, float v, float bias) { s.row[row_j(k)] = v + bias; });
      __syncthreads();
      if (t < n) {
        const int j = j0 + t;
        float a = s.row[j], c = s.row[j + HALF];
        if (rotate) {  // rotate-half RoPE
          const float ra = a * cs - c * sn, rc = c * cs + a * sn;
          a = ra;
          c = rc;
        }
        if (is_q) {
          q_out[head * D + j] = a;
          q_out[head * D + j + HALF] = c;
#if LATE_QK
        } else if (is_k) {
          k_raw[(head - MK_HEADS) * D + j] = a;
          k_raw[(head - MK_HEADS) * D + j + HALF] = c;
#endif
        } else {
          const int kvh = is_k ? head - MK_HEADS : head - MK_HEADS - MK_KV_HEADS;
          unsigned short* cache = is_k ? P.k_cache : P.v_cache;
          const size_t at = kv_at(P, layer, slot, pos, kvh);
          cache[at + j] = f32_to_bf16(a);
          cache[at + j + HALF] = f32_to_bf16(c);
        }
      }
      __syncthreads();  // s.row is reused by the next head
      p += n;
    }
  }
#endif
}

// ================================================================================================
// Op: ATTENTION - flash-decoding. A unit is (KV head g, position split); it covers positions
// [split * chunk, (split + 1) * chunk) of [0, pos] for the GROUP query heads of g and writes
// unnormalised outputs with their (max, sum of exp). O_PROJ_RESIDUAL merges the splits.
// ================================================================================================
// K and V rows are read 16 bytes (8 bf16) per lane: KV_LANES lanes cover a row, so a warp
// reads KV_PPW positions per load and each lane keeps KV_UNROLL loads in flight: a
// 128-position tile is one or two HBM rounds for K and for V. K, V and the queries are read
// through plain loads (the cache is written during the launch).
#define KV_LANES (MK_HEAD_DIM / 8)         // lanes per K/V row
#define KV_PPW (32 / KV_LANES)             // positions per warp per load
#define KV_SLOTS (NWARPS * KV_PPW)         // positions per block per load
#define KV_UNROLL MK_KV_UNROLL             // isa.KV_UNROLL
static_assert(MK_HEAD_DIM % 8 == 0 && KV_LANES <= 32 && 32 % KV_LANES == 0,
              "attention reads K/V rows 8 bf16 per lane");
static_assert(NWARPS * MK_GROUP * MK_HEAD_DIM <= VEC_MAX,
              "attention's per-warp V partials live in s.vec");

__device__ __forceinline__ uint4 load_kv(const unsigned short* p) {
  return *reinterpret_cast<const uint4*>(p);  // the KV cache: plain loads, never ld.global.nc
}

// This lane's V adjacent 16-byte chunks c * V.. of rows i0 + u * slots (u < U) of a K or V
// tile, all issued before any is used. A row past cnt reads row cnt - 1 again (an L1/L2 hit) and
// its result is not used: the callers mask by i < cnt. (Loading zeros there instead made the
// loads predicated, and at head_dim 64 ptxas then issued each one only after the previous row's
// dot product: one K load in flight instead of KV_UNROLL; tests/kernel/test_sass.py counts them.)
// Late q/k with chunks: positions >= chunk_from come from `chunk` (rows of HEAD_DIM bf16,
// position chunk_from first) instead: the chunk's keys, which the cache gets only after the
// layer's attention (O_PROJ caches them). `rows`: the layer's cache at the unit's KV head;
// position p's row is kv_row(seq, p), seq the row's sequence slot (p itself without slots).
template <int U, int V>
__device__ __forceinline__ void load_kv_rows(const Params& P, int seq,
                                             const unsigned short* rows, int base, int cnt,
                                             int i0, int slots, int c, uint4 (&kv)[U][V],
                                             const unsigned short* chunk, int chunk_from) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int i = min(i0 + u * slots, cnt - 1);
#if LATE_QK && MK_T_MAX > 1
    if (chunk != nullptr && base + i >= chunk_from) {
      const unsigned short* r = chunk + (size_t)(base + i - chunk_from) * D + c * 8 * V;
#pragma unroll
      for (int v = 0; v < V; ++v) kv[u][v] = *reinterpret_cast<const uint4*>(r + v * 8);
      continue;
    }
#else
    (void)chunk;
    (void)chunk_from;
#endif
    const unsigned short* r = rows + (size_t)kv_row(P, seq, base + i) * MK_KV_DIM + c * 8 * V;
#pragma unroll
    for (int v = 0; v < V; ++v) kv[u][v] = load_kv(r + v * 8);
  }
}

// The K loop's own layout (isa.attn_k_vec): a lane reads K_VEC adjacent 16-byte chunks of a row
// (K_LANES lanes a row) and K_UNROLL = KV_UNROLL / K_VEC rows, the same KV_UNROLL loads and
// positions a round (isa.attn_round_positions) as the V loop. At head_dim 64 K_VEC is 4: with
// one chunk a lane ptxas issued a kernel of slots' K loads one at a time, each behind the
// previous row's dot product and into the same registers; one row's four chunks it keeps in
// flight together (benchmarks/NOTES.md, the K loads at head_dim 64; tests/kernel/test_sass.py).
#define K_VEC MK_K_VEC
#define K_LANES (MK_HEAD_DIM / (8 * K_VEC))
#define K_PPW (32 / K_LANES)
#define K_SLOTS (NWARPS * K_PPW)
#define K_UNROLL (KV_UNROLL / K_VEC)
static_assert(K_LANES <= 32 && 32 % K_LANES == 0 && KV_UNROLL % K_VEC == 0 &&
              K_SLOTS * K_UNROLL == KV_SLOTS * KV_UNROLL, "the K loop's layout");

// s.score[h][i] = q_h . K[base + i] * scale for i < cnt (K rows from chunk_from on:
// chunk_keys)
__device__ void attention_scores(const Params& P, OpShared& s, int seq,
                                 const unsigned short* Kg, int base, int cnt, float scale,
                                 int chunk_from) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int c = lane % K_LANES, slot = warp * K_PPW + lane / K_LANES;
  for (int i0 = slot; i0 - slot < cnt; i0 += K_SLOTS * K_UNROLL) {
    uint4 kv[K_UNROLL][K_VEC];
    load_kv_rows(P, seq, Kg, base, cnt, i0, K_SLOTS, c, kv, chunk_keys(), chunk_from);
    // every dot product of the K_UNROLL rows first, then their reductions side by side, then
    // the stores: K_UNROLL x GROUP independent chains instead of one chain per row, each ended
    // by a store before the next row's work
    float acc[K_UNROLL][MK_GROUP];
#pragma unroll
    for (int h = 0; h < MK_GROUP; ++h) {
#pragma unroll
      for (int u = 0; u < K_UNROLL; ++u) acc[u][h] = 0.f;
#pragma unroll
      for (int v = 0; v < K_VEC; ++v) {
        const float* q = s.q + h * D + (c * K_VEC + v) * 8;
        const float4 qa = *reinterpret_cast<const float4*>(q);
        const float4 qb = *reinterpret_cast<const float4*>(q + 4);
#pragma unroll
        for (int u = 0; u < K_UNROLL; ++u) acc[u][h] += dot8(kv[u][v], qa, qb);
      }
    }
#pragma unroll
    for (int o = K_LANES / 2; o > 0; o >>= 1)
#pragma unroll
      for (int u = 0; u < K_UNROLL; ++u)
#pragma unroll
        for (int h = 0; h < MK_GROUP; ++h) acc[u][h] += __shfl_xor_sync(FULL_MASK, acc[u][h], o);
#pragma unroll
    for (int u = 0; u < K_UNROLL; ++u) {
      const int i = i0 + u * K_SLOTS;
#pragma unroll
      for (int h = 0; h < MK_GROUP; ++h)
        if (c == 0 && i < cnt) s.score[h * T_TILE + i] = acc[u][h] * scale;
    }
  }
}

// s.o[h][d] = s.o[h][d] * corr[h] + sum_i p_h[i] V[base + i][d], p in s.score
__device__ void attention_values(const Params& P, OpShared& s, int seq,
                                 const unsigned short* Vg, int base, int cnt) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int c = lane % KV_LANES, slot = warp * KV_PPW + lane / KV_LANES;
  float acc[MK_GROUP][8];
#pragma unroll
  for (int h = 0; h < MK_GROUP; ++h)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[h][e] = 0.f;
  for (int i0 = slot; i0 - slot < cnt; i0 += KV_SLOTS * KV_UNROLL) {
    uint4 kv[KV_UNROLL][1];
    load_kv_rows(P, seq, Vg, base, cnt, i0, KV_SLOTS, c, kv, nullptr, 0);
#pragma unroll
    for (int u = 0; u < KV_UNROLL; ++u) {
      const int i = i0 + u * KV_SLOTS;
      if (i < cnt) {
        const uint4 w = kv[u][0];
        const float v[8] = {bf_lo(w.x), bf_hi(w.x), bf_lo(w.y), bf_hi(w.y),
                            bf_lo(w.z), bf_hi(w.z), bf_lo(w.w), bf_hi(w.w)};
#pragma unroll
        for (int h = 0; h < MK_GROUP; ++h) {
          const float p = s.score[h * T_TILE + i];
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[h][e] += p * v[e];
        }
      }
    }
  }
  // the warp's positions: lanes of one chunk c differ by multiples of KV_LANES
#pragma unroll
  for (int h = 0; h < MK_GROUP; ++h)
#pragma unroll
    for (int e = 0; e < 8; ++e)
#pragma unroll
      for (int o = KV_LANES; o < 32; o <<= 1) acc[h][e] += __shfl_xor_sync(FULL_MASK, acc[h][e], o);
  if (lane < KV_LANES) {
#pragma unroll
    for (int h = 0; h < MK_GROUP; ++h)
#pragma unroll
      for (int e = 0; e < 8; ++e) s.vec[(warp * MK_GROUP + h) * D + c * 8 + e] = acc[h][e];
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < MK_GROUP * D; idx += MK_THREADS) {  // the block's warps
    const int h = idx / D;
    float sum = 0.f;
    for (int w = 0; w < NWARPS; ++w) sum += s.vec[w * MK_GROUP * D + idx];
    s.o[idx] = s.o[idx] * s.corr[h] + sum;
  }
}

// Positions per split: n_pos spread over the splits, but at least min_chunk (the schedule's
// policy: a block's positions per round), so a short context uses fewer splits and the merge
// reads only the used ones: splits_used(). Split s covers [s * chunk, (s + 1) * chunk).
__device__ __forceinline__ int split_chunk(int n_pos, int splits, int min_chunk) {
  return max(max(min_chunk, 1), (n_pos + splits - 1) / splits);
}
__device__ __forceinline__ int splits_used(int n_pos, int splits, int min_chunk) {
  return min(splits, (n_pos + split_chunk(n_pos, splits, min_chunk) - 1) /
                         split_chunk(n_pos, splits, min_chunk));
}

// Rows rotated over a KV group's unit slots (steps of many rows; isa.row_rotations): row r's
// split s runs in slot j = (s + off_r) mod splits of its KV group, off_r the used splits of
// the step's earlier rows, mod splits: the step's non-empty units dealt round-robin over the
// group's instructions instead of every row's split s on the one block holding slot s. The
// partials of (r, g, s) are stored at slot j; the merge reads split s there, in the same
// order as ever, so a row's numbers do not depend on where its units ran. Built in kernels of
// slots (their steps carry many rows): in the one-sequence kernel of prompt chunks the same
// code made ptxas issue attention_scores' K loads one at a time at head_dim 64, when a lane
// read one chunk of a K row (kv_loads_in_flight [4, 4] -> [1, 1, 1, 1, 4] on Llama; the
// layout before isa.attn_k_vec).
#define ROTATE_ROWS (MK_SLOTS > 0)
static_assert(!MK_SLOTS || MK_T_MAX > 1, "a kernel of slots carries steps of many rows");
// the slot of split s of a row rotated by off (s, off < splits)
__device__ __forceinline__ int split_slot(int s, int off, int splits) {
  return ROTATE_ROWS && s + off >= splits ? s + off - splits : s + off;
}
// the next row's rotation after a row of `used` splits
__device__ __forceinline__ int next_rotation(int off, int used, int splits) {
  return ROTATE_ROWS ? split_slot(used == splits ? 0 : used, off, splits) : 0;
}

// The tensor-core kernel runs a unit for a whole segment (a sequence's rows of the step) at
// once, its K and V staged in shared memory and the rows' queries on mma.sync
// (attention_segment); a segment shares one rotation, its last row's used splits (costmodel
// design attn_segments).
#define SEG_ATTN MK_MMA
// The rows that run tok's units together: [tok, unit_rows_end): its segment (tok its first
// row) with SEG_ATTN, else tok alone.
__device__ __forceinline__ int unit_rows_end(const int* st, int tok, int ntok) {
#if SEG_ATTN
  int end = tok + 1;
  while (end < ntok && row_seg(st, end) == tok) ++end;
  return end;
#else
  (void)st;
  (void)ntok;
  return tok + 1;
#endif
}

// A segment's rows in parts (isa.segment_parts; costmodel design attn_row_parts): part p of
// `parts` runs split s of its rows (segment_part_rows) in the unit slot of split s + p x used,
// rotated, so a prompt chunk's units fill the KV group's slots its used splits leave empty. A
// row's partials are its own whichever part holds it, and its merge reads them at its part's
// rotation (rot + p x used). MK_ROW_PARTS: the most m-tiles a part holds (0: one part).
#define ROW_PART_MTILES MK_ROW_PART_MTILES  // isa.ROW_PART_MTILES
#ifndef MK_ROW_PARTS
#define MK_ROW_PARTS (SEG_ATTN ? ROW_PART_MTILES : 0)
#endif
__device__ __forceinline__ int segment_parts(int used, int rows, int splits) {
  if (MK_ROW_PARTS <= 0 || used <= 0) return 1;
  const int most = max(1, min(splits / used, rows));
  for (int parts = 1; parts < most; ++parts)
    if (((rows + parts - 1) / parts * MK_GROUP + 15) / 16 <= MK_ROW_PARTS) return parts;
  return most;
}
// row i's part among a segment's `rows` in `parts` (segment_part_rows: [p rows / parts,
// (p + 1) rows / parts))
__device__ __forceinline__ int segment_part_of(int i, int parts, int rows) {
  return ((i + 1) * parts - 1) / rows;
}

// ---- The split merge (O_PROJ_RESIDUAL's, or by ticket at ATTENTION's end) ------------------
// The merge of the splits in one or two rounds. A thread owns 8 consecutive output
// elements of one (KV group, query head) and loads, for MERGE_CHUNK splits at once, their
// (max, sum) and two float4s of partial outputs before using any. With WAYS > 1, WAYS
// adjacent lanes share an output chunk, lane k taking splits k, k + WAYS, ...: up to
// WAYS * MERGE_CHUNK splits in one round, then the lanes' (max, sum, outputs) are combined by
// shuffles. out[idx] for the output elements idx of chunks [t_begin, t_end).
#define MERGE_CHUNK MK_MERGE_CHUNK  // isa.MERGE_CHUNK
static_assert(MK_HEAD_DIM % 8 == 0, "the merge reads 8 output elements per thread");

// One lane's share of the merge of the 8 output elements at idx of a row (its units from
// unit0: KV_HEADS x splits of them): splits way, way + ways, ... of the row's used ones,
// MERGE_CHUNK loads at once, then the `ways` adjacent lanes of the chunk (aligned to ways)
// combined by shuffles. Every lane of the warp calls it and runs MAXW's shuffle steps (a step
// of o >= ways leaves the lane as it is); a padding lane (live false) loads nothing. The lane
// of way 0 stores out[idx .. idx + 8).
template <int MAXW, class Out>
__device__ __forceinline__ void merge_chunk(const Params& P, size_t unit0, int splits, int used,
                                            int rot, int ways, int way, int idx, bool live,
                                            Out* out) {
  static_assert(MAXW >= 1 && MAXW <= 32 && (MAXW & (MAXW - 1)) == 0, "MAXW: a power of 2");
  const int g = idx / (MK_GROUP * D), h = (idx / D) % MK_GROUP, d = idx % D;
  float M = NEG_INF, L = 0.f, acc[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) acc[e] = 0.f;
  // splits >= used are empty; so is everything of a padding lane
  const int last = live ? used : 0;
  for (int sp0 = way; sp0 < last; sp0 += ways * MERGE_CHUNK) {
    float m[MERGE_CHUNK], l[MERGE_CHUNK];
    float4 o0[MERGE_CHUNK], o1[MERGE_CHUNK];
#pragma unroll
    for (int k = 0; k < MERGE_CHUNK; ++k) {  // every load of the chunk first
      const int sp = sp0 + k * ways;
      const bool ok = sp < last;
      const size_t unit = unit0 + (size_t)g * splits + split_slot(sp, rot, splits);
      const float* ml = P.attn_ml + (unit * MK_GROUP + h) * 2;
      const float* o = P.attn_o + (unit * MK_GROUP + h) * D + d;
      m[k] = ok ? ml[0] : NEG_INF;
      l[k] = ok ? ml[1] : 0.f;
      o0[k] = ok ? *reinterpret_cast<const float4*>(o) : make_float4(0.f, 0.f, 0.f, 0.f);
      o1[k] = ok ? *reinterpret_cast<const float4*>(o + 4) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float Mn = M;
#pragma unroll
    for (int k = 0; k < MERGE_CHUNK; ++k) Mn = fmaxf(Mn, m[k]);
    if (Mn == NEG_INF) continue;  // only empty splits so far
    const float sc = M == NEG_INF ? 0.f : expf(M - Mn);
    L *= sc;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] *= sc;
#pragma unroll
    for (int k = 0; k < MERGE_CHUNK; ++k) {
      if (m[k] == NEG_INF) continue;  // an empty split
      const float w = expf(m[k] - Mn);
      L += l[k] * w;
      const float o[8] = {o0[k].x, o0[k].y, o0[k].z, o0[k].w, o1[k].x, o1[k].y, o1[k].z, o1[k].w};
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] += o[e] * w;
    }
    M = Mn;
  }
#pragma unroll
  for (int o = 1; o < MAXW; o <<= 1) {  // the ways lanes of one output chunk
    const float M2 = __shfl_xor_sync(FULL_MASK, M, o), L2 = __shfl_xor_sync(FULL_MASK, L, o);
    float a2[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) a2[e] = __shfl_xor_sync(FULL_MASK, acc[e], o);
    const float Mn = fmaxf(M, M2);
    if (o >= ways || Mn == NEG_INF) continue;  // another chunk's lane, or both empty
    const float wa = M == NEG_INF ? 0.f : expf(M - Mn), wb = M2 == NEG_INF ? 0.f : expf(M2 - Mn);
    L = L * wa + L2 * wb;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = acc[e] * wa + a2[e] * wb;
    M = Mn;
  }
  if (live && way == 0) {
#pragma unroll
    for (int e = 0; e < 8; ++e) store_in(out + idx + e, acc[e] / L);
  }
}

// tok: the step's token whose partials are merged (rows of KV_HEADS x splits units).
template <int WAYS>
__device__ void merge_splits(const Params& P, int tok, float* out, int t_begin, int t_end,
                             int splits, int used, int rot) {
  const size_t unit0 = (size_t)tok * MK_KV_HEADS * splits;
  const int n = (t_end - t_begin) * WAYS;
  const int n_warps = (n + 31) / 32 * 32;  // whole warps run the loop (the shuffles)
  for (int i = threadIdx.x; i < n_warps; i += MK_THREADS) {
    const int t = t_begin + min(i, n - 1) / WAYS;
    merge_chunk<WAYS>(P, unit0, splits, used, rot, WAYS, i % WAYS, t * 8, i < n, out);
  }
}

// The lanes sharing an output chunk in the ticket's merge of a row of `used` splits
// (isa.merge_ways): the fewest, a power of 2 up to MK_MERGE_TICKET_WAYS, whose lanes load the
// used splits in one round of MERGE_CHUNK each. A function of the row's own splits: its
// merge's arithmetic never depends on the step's other rows.
__device__ __forceinline__ int merge_ways(int used) {
  int w = 1;
  while (w < MK_MERGE_TICKET_WAYS && w * MERGE_CHUNK < used) w <<= 1;
  return w;
}
// One row's output chunks in a KV group, and its lanes in the ticket's merge: chunks x ways,
// whole groups of MK_MERGE_TICKET_WAYS (so every row's lanes start aligned to its ways).
#define MERGE_ROW_CHUNKS (MK_GROUP * D / 8)
__device__ __forceinline__ int merge_row_lanes(int used) {
  const int lanes = MERGE_ROW_CHUNKS * merge_ways(used);
  return (lanes + MK_MERGE_TICKET_WAYS - 1) / MK_MERGE_TICKET_WAYS * MK_MERGE_TICKET_WAYS;
}

// A step that uses at least `least` splits merges them by ticket (the program's
// merge_ticket_min, Word ARG4; 0: never): ATTENTION's instructions of a KV group each draw the
// group's ticket after their units, and the drawer of the last merges the group's used splits
// into P.attn (MK_MERGE_TICKET_WAYS lanes per output chunk: one round up to 32 splits) before
// its block signals; O_PROJ then reads the merged vector (one round of Q_DIM floats) instead of
// every block merging every split. The last drawer resets the ticket for the next step: every later draw comes after
// this block's signal (the next step's ATTENTION waits, through the layer's ops, on it).
__device__ __forceinline__ bool merge_by_ticket(int used, int least) {
  return least > 0 && used >= least;
}
// In a kernel of slots, a row of one used split whose step merges by ticket (merge_ticket_min
// 1: the tensor-core kernel) is normalised and stored into P.attn by its one unit (split 0):
// what the merge of one split gives, without the ticket's last drawer merging the step's rows
// one after another. (The one-sequence kernel does not build it: its branch in op_attention
// made ptxas issue attention_scores' K loads one at a time at head_dim 64, whatever its form:
// tests/kernel/test_sass.py, kv_loads_in_flight; the executor refuses merge_ticket_min 1 there.)
__device__ __forceinline__ bool unit_finishes(int used, int least) {
  return MK_SLOTS > 0 && least == 1 && used == 1;  // merge_by_ticket(used, least) && used == 1
}
// ... and in a kernel of slots it does so only in unit slot 0 (a row rotated by 0: split_slot),
// the instruction the program declares as the KV group's `attn` writer (isa.row_finishes)
__device__ __forceinline__ bool row_finishes(int used, int least, int rot) {
  return unit_finishes(used, least) && rot == 0;
}

// The step's rows each merge by ticket or not by their own used splits (O_PROJ decides per
// row alike). Who merges a row:
// - the one-sequence kernel: one ticket per KV group (counter `ticket`), drawn by each of the
//   group's `tickets` instructions once a row merges (steps_max_used); its last drawer merges
//   every merging row of the step (attention_ticket).
// - a kernel of slots (ROTATE_ROWS): a ticket per row and KV group (counter ticket + r),
//   drawn by the instructions that ran units of the row, each adding its count of them; the
//   drawer that brings it to the row's used splits merges the row (attention_row_tickets). A
//   row's merger thus waits only for the instructions holding that row's units, and a step's
//   merges spread over the group's blocks instead of one block merging every row.
// The drawer of a last ticket resets its counter for the next step: every later draw comes
// after this block's signal (the next step's ATTENTION waits, through the layer's ops, on it).
//
// The merge of the rows a block merges, in one pass: warp 0 holds rows lane * PER + k and
// their lanes in the merge, cnt[k] (0 for a row it does not merge); s_off[r] becomes the first
// lane of row r's merge, a scan of the counts, and lane i finds its row by bisection.
constexpr int ROWS_PER_LANE = (MK_T_MAX + 31) / 32;  // rows per lane of warp 0's scan
__device__ void merge_rows(const Params& P, const int* st, int g, int splits, int min_chunk,
                           int ntok, const int (&cnt)[ROWS_PER_LANE], int* s_off,
                           const unsigned short* s_rot) {
  constexpr int PER = ROWS_PER_LANE;
  if (threadIdx.x < 32) {  // warp 0: the exclusive scan of the rows' lanes
    const int lane = threadIdx.x;
    int sum = 0;
#pragma unroll
    for (int k = 0; k < PER; ++k) sum += cnt[k];
    int incl = sum;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(FULL_MASK, incl, o);
      if (lane >= o) incl += y;
    }
    int run = incl - sum;
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const int tok = lane * PER + k;
      if (tok < ntok) s_off[tok] = run;
      run += cnt[k];
    }
    if (lane == 31) s_off[ntok] = incl;
  }
  __syncthreads();
  const int total = s_off[ntok];
  const int n_warps = (total + 31) / 32 * 32;  // whole warps run the loop (the shuffles)
  for (int i = threadIdx.x; i < n_warps; i += MK_THREADS) {
    const int k = min(i, total - 1);
    int lo = 0, hi = ntok - 1;  // the last row r with s_off[r] <= k: the row of lane k
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (s_off[mid] <= k) lo = mid; else hi = mid - 1;
    }
    const int tok = lo, used = splits_used(row_pos(st, tok) + 1, splits, min_chunk);
    const int ways = merge_ways(used), j = k - s_off[tok], t = j / ways;
    merge_chunk<MK_MERGE_TICKET_WAYS>(
        P, (size_t)tok * MK_KV_HEADS * splits, splits, used, ROTATE_ROWS ? s_rot[tok] : 0, ways,
        j % ways, g * MK_GROUP * D + min(t, MERGE_ROW_CHUNKS - 1) * 8,
        i < total && t < MERGE_ROW_CHUNKS, P.attn + (size_t)tok * MK_Q_DIM);
  }
}

#if ROTATE_ROWS
// Thread r < ntok draws row r's ticket: `draw` is (this instruction's units of the row | its
// used splits << 16), 0 when it holds none or the row does not merge by ticket, and `rot`
// the row's rotation, both found by op_attention's row loop. One draw a thread, so the draws
// are in flight together (an acq_rel RMW is a MEMBAR, which would wait for the thread's
// previous draw).
static_assert(MK_T_MAX < (1 << 15) && MK_T_MAX <= MK_THREADS, "a row's draw: a thread");
__device__ void attention_row_tickets(const Params& P, const int* st, int ticket, int g,
                                      int splits, int min_chunk, int ntok, int draw, int rot) {
  __shared__ int s_off[MK_T_MAX + 1];
  __shared__ unsigned short s_rot[MK_T_MAX];  // each row's rotation (split_slot)
  __syncthreads();  // every thread's partial stores are issued
  if (threadIdx.x < ntok) {
    const int n = draw & 0xffff, used = draw >> 16;
    bool last = false;
    if (n > 0) {
      int* c = &P.counters[ticket + threadIdx.x];
      last = ticket_add(c, n) + n == used;
      if (last) atomicExch(c, 0);
    }
    s_off[threadIdx.x] = last ? merge_row_lanes(used) : 0;
    s_rot[threadIdx.x] = (unsigned short)rot;
  }
  __syncthreads();
  int cnt[ROWS_PER_LANE] = {};  // warp 0's rows
  if (threadIdx.x < 32) {
#pragma unroll
    for (int k = 0; k < ROWS_PER_LANE; ++k) {
      const int tok = threadIdx.x * ROWS_PER_LANE + k;
      cnt[k] = tok < ntok ? s_off[tok] : 0;
    }
  }
  __syncwarp();  // warp 0's reads of s_off before its scan overwrites them
  merge_rows(P, st, g, splits, min_chunk, ntok, cnt, s_off, s_rot);
}
#else
__device__ void attention_ticket(const Params& P, const int* st, int ticket, int tickets, int g,
                                 int splits, int min_chunk, int least, int ntok) {
  __shared__ int s_last;
  __shared__ int s_off[MK_T_MAX + 1];
  constexpr int PER = ROWS_PER_LANE;
  __syncthreads();  // every thread's partial stores are issued
  if (threadIdx.x == 0) {
    const int last = ticket_add(&P.counters[ticket], 1) == tickets - 1;
    if (last) atomicExch(&P.counters[ticket], 0);
    s_last = last;
  }
  __syncthreads();
  if (!s_last) return;
  int cnt[PER] = {};  // warp 0's rows
  if (threadIdx.x < 32) {
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const int tok = threadIdx.x * PER + k;
      const int used = tok < ntok ? splits_used(row_pos(st, tok) + 1, splits, min_chunk) : 0;
      cnt[k] = tok < ntok && merge_by_ticket(used, least) ? merge_row_lanes(used) : 0;
    }
  }
  merge_rows(P, st, g, splits, min_chunk, ntok, cnt, s_off, nullptr);
}
#endif

#if ROTATE_ROWS
// The rolling prefetch of a step of many rows (costmodel design attn_rolling_prefetch): when
// an instruction starts a unit, its threads prefetch every K/V line of its next unit into L2,
// so HBM streams that unit during this one's fixed work (its queries, softmax, barriers,
// partials) and its loads hit L2. The cursor (row, unit slot, that row's rotation) only moves
// forward over the rows and the instruction's unit slots [b, e), in the order the units run:
// a step's scan is O(rows + units), whatever the rows. Before the wait, prefetch_weights
// prefetches the first unit (attn_first_unit_prefetch): of its positions, only those cached
// before the step (the step's own are being written: `before`), at most PREFETCH_MAX_BYTES
// of K and of V, as for the one-sequence kernel.
struct UnitCursor {
  int tok, u, rot;
};
// A K/V tile of a unit as its pass stages it (the attention pipeline, MK_ATTN_PIPE:
// segment_pass copies a tile's successor into the other tile buffer while the tile computes):
// positions [base, base + cnt) of KV head gk of the slot's cache, its segment's first position
// pos0 (segment_k_end); cnt 0: none.
struct SegTile {
  int slot, gk, base, cnt, pos0;
};
// The first tile of unit u (slot u % splits of KV group u / splits) of the segment from row tok
// at rotation rot: its part's rows and positions exactly as attention_segment takes them; cnt
// 0 where the unit has no queries. Recomputed where its copies are issued (from the rolling
// prefetch's cursor), not carried through the unit's passes in five registers.
__device__ __forceinline__ SegTile segment_first_tile(const int* st, int tok, int u, int rot,
                                                      int splits, int min_chunk) {
  const int last = unit_rows_end(st, tok, step_tokens(st)) - 1, nrows = last + 1 - tok;
  const int n_pos = row_pos(st, last) + 1, used = splits_used(n_pos, splits, min_chunk);
  const int parts = segment_parts(used, nrows, splits);
  const int j = u % splits, v = j >= rot ? j - rot : j - rot + splits;
  const int part = v / used, chunk = split_chunk(n_pos, splits, min_chunk);
  const int t0 = (v % used) * chunk, pos0 = row_pos(st, tok);
  const int first = part * nrows / parts, end = (part + 1) * nrows / parts;
  const bool queries = v < used * parts && end - max(first, t0 - pos0) > 0;
  return {row_slot(st, tok), u / splits, t0,
          queries ? min(SEG_TILE, min(pos0 + end, t0 + chunk) - t0) : 0, pos0};
}
// The rolling prefetch: the L2 prefetch of the instruction's next unit's K/V after unit u of the
// segment from row tok (cursor c: where the last call left it, past the unit it prefetched);
// `has_tile` (the pipeline): whether that unit has queries, its first tile then
// segment_first_tile(st, c.tok, c.u - 1, c.rot, ..).
__device__ void attention_prefetch_next(const Params& P, const int* st, UnitCursor& c, int tok,
                                        int u, int rot, int layer, int b, int e, int splits,
                                        int min_chunk, int ntok, bool before = false,
                                        bool* has_tile = nullptr) {
  if (has_tile) *has_tile = false;
  constexpr int LINES = (D * 2 + 127) / 128;  // 128-byte lines per K or V row
  if (c.tok < tok || (c.tok == tok && c.u <= u)) c = {tok, u + 1, rot};  // past this unit
  for (; c.tok < ntok; c.u = b) {
    const int last = unit_rows_end(st, c.tok, ntok) - 1;  // the rows that run c.tok's units
    const int n_pos = row_pos(st, last) + 1, used = splits_used(n_pos, splits, min_chunk);
    const int parts = segment_parts(used, last + 1 - c.tok, splits);
    for (; c.u < e; ++c.u) {
      const int j = c.u % splits, v = j >= c.rot ? j - c.rot : j - c.rot + splits;
      if (v >= used * parts) continue;
      const int split = v % used;  // (a part's positions end earlier: its prefetch reads more)
      const int chunk = split_chunk(n_pos, splits, min_chunk);
      const int t0 = split * chunk, slot = row_slot(st, c.tok);
      const int t1 = before ? min(min(row_pos(st, row_seg(st, c.tok)), t0 + chunk),
                                  t0 + PREFETCH_MAX_BYTES / (D * 2))
                            : min(n_pos, t0 + chunk);
      const size_t kv0 = ((size_t)layer * MK_KV_ROWS * MK_KV_HEADS + c.u / splits) * D;
      if (has_tile)
        *has_tile = segment_first_tile(st, c.tok, c.u, c.rot, splits, min_chunk).cnt > 0;
      for (int k = threadIdx.x; k < (t1 - t0) * 2 * LINES; k += MK_THREADS) {
        const int t = t0 + k / (2 * LINES), r = k % (2 * LINES);
        prefetch_line((r < LINES ? P.k_cache : P.v_cache) + kv0 +
                      (size_t)kv_row(P, slot, t) * MK_KV_DIM + (r % LINES) * 64);
      }
      ++c.u;  // the next call looks past it
      return;
    }
    c.rot = next_rotation(c.rot, used * parts, splits);
    c.tok = last + 1;
  }
}
#endif

#if SEG_ATTN
// ---- A segment's unit on tensor cores (SEG_ATTN) ----------------------------------------------
// The unit's positions [t0, t1) for the segment's rows that reach them (rows r0.. of the
// segment: a row at position pos sees [t0, min(pos + 1, t1))), in tiles of SEG_TILE positions
// staged in dynamic shared memory by cp.async, K and V as rows: K the scores' "col" B operand
// (ldmatrix), V the values' (ldmatrix .trans). Its (row, head) queries, q = (r - r0) * GROUP +
// h, come in m-tiles of 16, one a warp (passes of NWARPS m-tiles); a warp keeps its m-tile's
// queries in a bf16 query tile in shared memory, its outputs (fp32) and running (max, sum) in
// registers, and runs the online softmax per SEG_SUB positions: scores = q . k * scale on mma.sync, masked to
// -inf past each row's own position, then p = exp(score - max) packed as the next mma's A
// fragment (FlashAttention-2's register reuse) against V. Where the numbers cannot depend on
// the step's other rows: a query's score is its own A row against K; a sub-tile (fixed by
// absolute position) without a position of the row leaves its (max, sum, outputs) exactly as
// they were (corr 1, p 0 times a finite or zero V: +0); padding past the tile's positions is
// zeros in K and V, so a row run alone and in a chunk add the same numbers in the same order.
#define SEG_KV_LD (D + 8)      // a staged K or V row: HEAD_DIM bf16 + 16 bytes (the 8 rows of
                               // an ldmatrix land on distinct banks)
#define SEG_SUB MK_SEG_SUB     // isa.seg_sub(HEAD_DIM)
#define SEG_KEYS MK_SEG_KEYS   // isa.SEG_KEYS
#define SEG_QUERIES MK_SEG_QUERIES  // isa.SEG_QUERIES
#define SEG_Q_LD (D + 8)  // a query tile's row: HEAD_DIM bf16 + 16 bytes
#define SEG_NB (SEG_SUB / 8)   // n-blocks of 8 positions a sub-tile
static_assert(D % 16 == 0 && SEG_TILE % SEG_SUB == 0 && SEG_SUB % 16 == 0,
              "a segment's unit: mma k-steps of 16 over HEAD_DIM and over the positions");
#define SEG_TILES_BYTES (2 * SEG_TILE * SEG_KV_LD * 2)  // the K and V tiles
// K and V tile buffers: two with the attention pipeline (MK_ATTN_PIPE; header.attn_pipeline),
// a tile computing in one while its successor (the unit's next tile, or the next unit's
// first) lands in the other
#define SEG_BUFS (MK_ATTN_PIPE ? 2 : 1)

// Positions [base, base + cnt) of the unit's K and V (the slot's cache rows, kv the layer's and
// KV head's offset) into Ks and Vs by cp.async, a 16-byte chunk a copy (no registers, no
// transposition); positions [cnt, cnt rounded up to 16) are zeros. K rows from k_end on are
// left to segment_keys (late q/k: the segment's own keys, not cached yet). The copies are in
// flight when it returns: the caller lands them (cp_async_wait) before the barrier that shows
// them to the block.
__device__ void segment_stage(const Params& P, int slot, size_t kv, int base, int cnt, int k_end,
                              unsigned short* Ks, unsigned short* Vs) {
  constexpr int CH = D / 8;  // 16-byte chunks a row
  constexpr int PER = (SEG_TILE * CH + MK_THREADS - 1) / MK_THREADS;
  const int n16 = (cnt + 15) & ~15, tid = fresh_tid();
#pragma unroll
  for (int u = 0; u < PER; ++u) {
    const int idx = tid + u * MK_THREADS, i = idx / CH, c = idx % CH;
    if (i >= n16) continue;
    const int at = i * SEG_KV_LD + c * 8;
    if (i < cnt) {
      const size_t row = (size_t)kv_row(P, slot, base + i) * MK_KV_DIM + c * 8;
      if (i < k_end) cp_async_16(Ks + at, P.k_cache + kv + row);
      cp_async_16(Vs + at, P.v_cache + kv + row);
    } else {
      *reinterpret_cast<uint4*>(Ks + at) = make_uint4(0u, 0u, 0u, 0u);
      *reinterpret_cast<uint4*>(Vs + at) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

// One SEG_SUB step of the online softmax of a warp's m-tile (both modes of attention_segment
// run this code, so a query's numbers do not depend on the mode): the scores sc (the mma's
// C fragments of n-blocks sb.. of the tile at `base`) scaled and masked past each of the
// lane's two rows' positions (lim) and the tile's (end), the rows' running max and sum
// updated, corr their correction, sc turned into the probabilities.
__device__ __forceinline__ void segment_softmax(float (&sc)[SEG_NB][4], const int (&lim)[2],
                                                int end, int p0, float scale, float (&mrun)[2],
                                                float (&lrun)[2], float (&corr)[2]) {
  const int t = threadIdx.x & 3;
  float mx[2] = {NEG_INF, NEG_INF}, sum[2] = {0.f, 0.f};
#pragma unroll
  for (int nb = 0; nb < SEG_NB; ++nb)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int p = p0 + nb * 8 + 2 * t + (i & 1), h = i >> 1;
      sc[nb][i] = p < min(lim[h], end) ? sc[nb][i] * scale : NEG_INF;
      mx[h] = fmaxf(mx[h], sc[nb][i]);
    }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(FULL_MASK, mx[h], 1));
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(FULL_MASK, mx[h], 2));
    const float mn = fmaxf(mrun[h], mx[h]);
    corr[h] = mn == NEG_INF ? 1.f : expf(mrun[h] - mn);
    mrun[h] = mn;
  }
#pragma unroll
  for (int nb = 0; nb < SEG_NB; ++nb)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int h = i >> 1;
      const float p = mrun[h] == NEG_INF ? 0.f : expf(sc[nb][i] - mrun[h]);
      sc[nb][i] = p;
      sum[h] += p;
    }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    sum[h] += __shfl_xor_sync(FULL_MASK, sum[h], 1);
    sum[h] += __shfl_xor_sync(FULL_MASK, sum[h], 2);
    lrun[h] = lrun[h] * corr[h] + sum[h];
  }
}

// The probabilities of k-step kk of a sub-tile as the A fragment of probabilities x V: the
// score fragments of n-blocks 2 kk and 2 kk + 1 are its halves (FlashAttention-2's reuse).
__device__ __forceinline__ void segment_p_frag(const float (&sc)[SEG_NB][4], int kk,
                                               unsigned (&a)[4]) {
  a[0] = bf16_pack(sc[2 * kk][0], sc[2 * kk][1]);
  a[1] = bf16_pack(sc[2 * kk][2], sc[2 * kk][3]);
  a[2] = bf16_pack(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
  a[3] = bf16_pack(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
}

// Output n-tile nd += probabilities (k-step kk of the sub-tile at sb) x V, after the sub-tile's
// correction (kk 0 applies it).
__device__ __forceinline__ void segment_pv(float (&o)[4], const unsigned (&a)[4],
                                           const float (&corr)[2], smem_addr_t Vs, int nd,
                                           int sb, int kk) {
  if (kk == 0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) o[i] *= corr[i >> 1];
  }
  unsigned b[2];
  ldmatrix_bt_at(b, Vs + 2u * ((sb + kk * 16) * SEG_KV_LD + nd * 8), SEG_KV_LD);
  mma_m16n8k16_bf16(o, a, b, o);
}

// k-step ks of the scores of an n-block of the m-tile (its query tile's fragment a) against the
// staged K rows from k8: c += Q[:, ks] K[k8.., ks]^T. An n-block's scores are k-steps 0, 1, ..
// in order from zeros, in either mode.
__device__ __forceinline__ void segment_score_step(float (&c)[4], const unsigned (&a)[4],
                                                   smem_addr_t k8, int ks) {
  unsigned b[2];
  ldmatrix_b_at(b, k8 + 2u * ks * 16, SEG_KV_LD);
  mma_m16n8k16_bf16(c, a, b, c);
}

// Rows r = first, first + stride, ... < 16 of m-tile mt's query tile Qt (row-major bf16,
// SEG_Q_LD a row): (row, head) m = mt * 16 + r, the query of head gk * GROUP + m % GROUP of
// the step's row row0 + m / GROUP, rounded to bf16; past M, zeros. Late q/k: normed and roped
// first (warp_qk_norm_rope_n, SEG_QUERIES of them a round), their norm weights and RoPE rows
// loaded with them (N of them a round: SEG_QUERIES, or the split mode's 16 / NWARPS rows a
// warp). One warp; every lane's loads of a round before its stores.
template <int N>
__device__ __forceinline__ void segment_q_tile(const Params& P, const int* st, int layer,
                                               int gk, int row0, int M, int mt, int first,
                                               int stride, unsigned short* Qt) {
  const int lane = threadIdx.x & 31;
  auto tok_of = [&](int r) { return row0 + (mt * 16 + r) / MK_GROUP; };
  auto q_of = [&](int r) {
    return P.q + (size_t)tok_of(r) * MK_Q_DIM + (gk * MK_GROUP + (mt * 16 + r) % MK_GROUP) * D;
  };
#if LATE_QK
  for (int r0 = first; r0 < 16; r0 += stride * N) {
    auto r_of = [&](int n) { return r0 + n * stride; };
    auto live = [&](int n) { return r_of(n) < 16 && mt * 16 + r_of(n) < M; };
    if (live(0))
      warp_qk_norm_rope_n<N>(
          P, [&](int n) { return q_of(r_of(n)); }, P.q_norm + (size_t)layer * D,
          [&](int n) { return row_pos(st, tok_of(r_of(n))); }, live,
          [&](int n, int j, float v) { Qt[r_of(n) * SEG_Q_LD + j] = f32_to_bf16(v); });
#pragma unroll
    for (int n = 0; n < N; ++n)
      if (r_of(n) < 16 && !live(n))
        for (int d = lane; d < D; d += 32) Qt[r_of(n) * SEG_Q_LD + d] = 0;
  }
#else
  (void)st;
  (void)layer;
  constexpr int ROWS = 16, PER = (D + 63) / 64;  // float2 loads a lane a row: columns 2 lane + 64 c
  float2 q[ROWS][PER];
#pragma unroll
  for (int k = 0; k < ROWS; ++k) {
    const int r = first + k * stride;
    if (r >= 16) break;
    const float* src = q_of(mt * 16 + r < M ? r : 0);
#pragma unroll
    for (int c = 0; c < PER; ++c)
      if (2 * lane + 64 * c < D)
        q[k][c] = *reinterpret_cast<const float2*>(src + 2 * lane + 64 * c);
  }
#pragma unroll
  for (int k = 0; k < ROWS; ++k) {
    const int r = first + k * stride;
    if (r >= 16) break;
    const bool in = mt * 16 + r < M;
#pragma unroll
    for (int c = 0; c < PER; ++c)
      if (2 * lane + 64 * c < D)
        *reinterpret_cast<unsigned*>(Qt + r * SEG_Q_LD + 2 * lane + 64 * c) =
            in ? bf16_pack(q[k][c].x, q[k][c].y) : 0u;
  }
#endif
}

#if LATE_QK
// Late q/k: the segment's own keys in the tile's positions [max(base, pos0), base + cnt) (row
// seg + p - pos0 of k_raw; the cache gets them after the layer's attention), normed and roped
// as O_PROJ caches them (warp_qk_norm_rope_n: the same bf16 value), into Ks; SEG_KEYS keys a
// warp at once, from the last warp down (a decode row's queries sit on the first warps:
// segment_pass builds them beside its key).
__device__ void segment_keys(const Params& P, int layer, int gk, int seg, int pos0, int base,
                             int cnt, unsigned short* Ks) {
  const int warp = NWARPS - 1 - (int)(threadIdx.x >> 5), hi = base + cnt;
  for (int p0 = max(base, pos0) + warp * SEG_KEYS; p0 < hi; p0 += NWARPS * SEG_KEYS)
    warp_qk_norm_rope_n<SEG_KEYS>(
        P, [&](int n) { return P.k_raw + (size_t)(seg + p0 + n - pos0) * MK_KV_DIM + gk * D; },
        P.k_norm + (size_t)layer * D, [&](int n) { return p0 + n; },
        [&](int n) { return p0 + n < hi; },
        [&](int n, int j, float v) { Ks[(p0 + n - base) * SEG_KV_LD + j] = f32_to_bf16(v); });
}
#endif

// The K rows of tile [base, base + cnt) that segment_stage copies: all of them, or with late
// q/k those before the segment's own keys (pos0 on), which segment_keys_in norms into Ks.
__device__ __forceinline__ int segment_k_end(int pos0, int base, int cnt) {
  return LATE_QK ? pos0 - base : cnt;
}

__device__ __forceinline__ void segment_keys_in(const Params& P, int layer, int gk, int seg,
                                                int pos0, int base, int cnt,
                                                unsigned short* Ks) {
#if LATE_QK
  if (base + cnt > pos0) segment_keys(P, layer, gk, seg, pos0, base, cnt, Ks);
#else
  (void)P;
  (void)layer;
  (void)gk;
  (void)seg;
  (void)pos0;
  (void)base;
  (void)cnt;
  (void)Ks;
#endif
}

// The split mode's shared memory after the K and V tiles (one m-tile): its scores, then the
// softmax warp's probability fragments and corrections per lane, its final (max, sum).
struct SegSplit {
  float s[16][SEG_TILE + 4];                    // the tile's scores, [query row][position]
  unsigned pa[SEG_TILE / 16][32][4];            // probability A fragments, per k-step and lane
  float corr[SEG_TILE / SEG_SUB][32][2];        // each sub-tile's corrections, per lane
  float ml[32][4];                              // per lane: (max, sum) of its two rows
};
static_assert(SEG_TILES_BYTES % 16 == 0, "the split mode's shared memory stays aligned");
static_assert(MK_DYN_SMEM >=
                  SEG_BUFS * SEG_TILES_BYTES + (int)sizeof(SegSplit) + NWARPS * 16 * SEG_Q_LD * 2,
              "the K and V tile buffers, then the split mode's scores and fragments, then a "
              "query tile a warp, live in dynamic shared memory");

// One pass of attention_segment: m-tiles mt0 + warp (ONE false: a warp's own m-tile, rows of
// a chunk) or m-tile 0 split over the warps (ONE: a decode row's GROUP queries: the scores'
// n-blocks over the warps, warp 0's softmax over them in the same fragment layout,
// probabilities x V over the output's n-tiles, a warp keeping only its own n-tiles nd = warp +
// NWARPS i), each score, probability and output element computed by the same instructions in
// the same order either way. The tiles [t0, t1) are staged here (block-wide: ONE is
// block-uniform), once for all passes when there is one tile, from tile buffer buf on. With
// the pipeline (MK_ATTN_PIPE) each tile's successor is copied into the other buffer once the
// tile is in, before computing it: the pass's next tile (buf flips to it), or after the last
// pass's last tile, where `has_next`, the next unit's first (the one the rolling prefetch's
// cursor `next` last passed; the caller flips buf); the pass's first tile was copied by the
// unit before when `pre`.
template <bool ONE>
__device__ __forceinline__ void segment_pass(const Params& P, const int* st, int layer, int gk,
                                             int j, int seg, int r0, int M, int mt0, int t0,
                                             int t1, int splits, int min_chunk, int least,
                                             int rot, float scale, int& buf, bool pre,
                                             bool last_pass, bool has_next,
                                             const UnitCursor& next) {
  const int tid = fresh_tid(), lane = tid & 31, warp = tid >> 5, gq = lane >> 2, t = lane & 3;
  constexpr int OWN = ONE ? (D / 8 + NWARPS - 1) / NWARPS : D / 8;  // a warp's output n-tiles
  auto nd_of = [&](int i) { return ONE ? warp + NWARPS * i : i; };
  char* const smem = static_cast<char*>(dynamic_smem());
  // the K tile of buffer buf (V's follows it)
  auto tiles_at = [&] {
    return reinterpret_cast<unsigned short*>(smem + buf * SEG_TILES_BYTES);
  };
  SegSplit& sp = *reinterpret_cast<SegSplit*>(smem + SEG_BUFS * SEG_TILES_BYTES);
  // the pass's query tile: the block's one (ONE) or this warp's
  unsigned short* Qt = reinterpret_cast<unsigned short*>(smem + SEG_BUFS * SEG_TILES_BYTES +
                                                         sizeof(SegSplit)) +
                       (ONE ? 0 : warp) * 16 * SEG_Q_LD;
  const smem_addr_t qt = smem_addr(Qt);
  const int pos0 = row_pos(st, seg), slot = row_slot(st, seg);
  const int ntiles = (t1 - t0 + SEG_TILE - 1) / SEG_TILE;
  const size_t kv_layer = (size_t)layer * MK_KV_ROWS * MK_KV_HEADS * D;
  const size_t kv = kv_layer + (size_t)gk * D;  // the unit's K/V rows (segment_stage)
  const int mt = ONE ? 0 : mt0 + warp;
  const bool live = ONE || mt < (M + 15) / 16;
  int lim[2];  // this lane's query rows gq, gq + 8: their row's positions end (0: padding)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int m = mt * 16 + gq + 8 * h;
    lim[h] = live && m < M ? pos0 + r0 + m / MK_GROUP + 1 : 0;
  }
  const int warp_lim = live ? pos0 + r0 + (min(mt * 16 + 15, M - 1)) / MK_GROUP + 1 : 0;
  // block-uniform: one tile is staged once for all passes
  const bool stage = mt0 == 0 || ntiles > 1;
  if (stage) __syncthreads();  // the previous unit's (or pass's) readers of the tiles are done
  else __syncwarp();           // this warp's previous pass read its query tile
  // the first tile's copies in flight while the query tile is built (its trip under theirs);
  // late q/k issues them after it (before it, Qwen3-0.6B's kernel of 128 slots spills)
  const int cnt0 = min(SEG_TILE, t1 - t0);
  if (stage && !LATE_QK && !pre)
    segment_stage(P, slot, kv, t0, cnt0, cnt0, tiles_at(),
                  tiles_at() + SEG_TILE * SEG_KV_LD);
  // the query tile (before the outputs are live): the split mode's by all warps, two rows each
  if (live)
    segment_q_tile<ONE ? (16 + NWARPS - 1) / NWARPS : SEG_QUERIES>(
        P, st, layer, gk, seg + r0, M, mt, ONE ? warp : 0, ONE ? NWARPS : 1, Qt);
  float o[OWN][4], mrun[2] = {NEG_INF, NEG_INF}, lrun[2] = {0.f, 0.f};
#pragma unroll
  for (int i = 0; i < OWN; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[i][e] = 0.f;
  for (int tile = 0; tile < ntiles; ++tile) {
    const int base = t0 + tile * SEG_TILE, cnt = min(SEG_TILE, t1 - base);
    unsigned short* const Ks = tiles_at();
    unsigned short* const Vs = Ks + SEG_TILE * SEG_KV_LD;
    const smem_addr_t ks_at = smem_addr(Ks), vs_at = smem_addr(Vs);
    // (with the pipeline a later tile was copied under the one before)
    if (stage && (tile > 0 ? !MK_ATTN_PIPE : LATE_QK && !pre)) {
      if (tile > 0) __syncthreads();  // the previous tile's readers are done
      segment_stage(P, slot, kv, base, cnt, segment_k_end(pos0, base, cnt), Ks, Vs);
    }
    if (stage) {
      // the tile's keys under its copies (from the last warp: a decode row's beside the
      // warps of its queries)
      segment_keys_in(P, layer, gk, seg, pos0, base, cnt, Ks);
      cp_async_wait();
      __syncthreads();  // the tiles (and the query tiles) are in
    } else {
      __syncwarp();  // this warp's query tile is in
    }
    // (block-uniform) the successor: this pass's next tile, or the next unit's first (the
    // unit the rolling prefetch's cursor last passed)
    const bool own = MK_ATTN_PIPE && tile + 1 < ntiles;
    if (MK_ATTN_PIPE && (own || (last_pass && tile + 1 == ntiles && has_next))) {
      // into the other buffer, under this tile's work: its last readers (the tile before this
      // one, or the unit before) passed this tile's barrier
      unsigned short* Kn = reinterpret_cast<unsigned short*>(smem + (buf ^ 1) * SEG_TILES_BYTES);
      const SegTile nx =
          own ? SegTile{slot, gk, base + SEG_TILE, min(SEG_TILE, t1 - base - SEG_TILE), pos0}
              : segment_first_tile(st, next.tok, next.u - 1, next.rot, splits, min_chunk);
      segment_stage(P, nx.slot, kv_layer + (size_t)nx.gk * D, nx.base, nx.cnt,
                    segment_k_end(nx.pos0, nx.base, nx.cnt), Kn, Kn + SEG_TILE * SEG_KV_LD);
    }
    const int n16 = (cnt + 15) & ~15, end = base + cnt;
    if (ONE) {
      // the scores: n-blocks nb = warp, warp + NWARPS, ... below n16
      for (int nb = warp; nb * 8 < n16; nb += NWARPS) {
        float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
          unsigned a[4];
          ldmatrix_a_at(a, qt + 2u * ks * 16, SEG_Q_LD);
          segment_score_step(c, a, ks_at + 2u * nb * 8 * SEG_KV_LD, ks);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) sp.s[gq + 8 * (i >> 1)][nb * 8 + 2 * t + (i & 1)] = c[i];
      }
      __syncthreads();
      if (warp == 0) {  // the softmax, sub-tile by sub-tile as the other mode's warps
        for (int sb = 0; sb < n16 && base + sb < warp_lim; sb += SEG_SUB) {
          float sc[SEG_NB][4], corr[2];
#pragma unroll
          for (int nb = 0; nb < SEG_NB; ++nb)
#pragma unroll
            for (int i = 0; i < 4; ++i)
              sc[nb][i] = sb + nb * 8 < n16
                              ? sp.s[gq + 8 * (i >> 1)][sb + nb * 8 + 2 * t + (i & 1)]
                              : 0.f;
          segment_softmax(sc, lim, end, base + sb, scale, mrun, lrun, corr);
          sp.corr[sb / SEG_SUB][lane][0] = corr[0];
          sp.corr[sb / SEG_SUB][lane][1] = corr[1];
#pragma unroll
          for (int kk = 0; kk < SEG_SUB / 16; ++kk) {
            unsigned a[4];
            segment_p_frag(sc, kk, a);
#pragma unroll
            for (int r = 0; r < 4; ++r) sp.pa[(sb + kk * 16) / 16][lane][r] = a[r];
          }
        }
        sp.ml[lane][0] = mrun[0];
        sp.ml[lane][1] = mrun[1];
        sp.ml[lane][2] = lrun[0];
        sp.ml[lane][3] = lrun[1];
      }
      __syncthreads();
      // probabilities x V: this warp's output n-tiles
      for (int sb = 0; sb < n16 && base + sb < warp_lim; sb += SEG_SUB) {
        const float corr[2] = {sp.corr[sb / SEG_SUB][lane][0], sp.corr[sb / SEG_SUB][lane][1]};
#pragma unroll
        for (int kk = 0; kk < SEG_SUB / 16; ++kk) {
          if (sb + kk * 16 >= n16) continue;
          const unsigned* ap = sp.pa[(sb + kk * 16) / 16][lane];
          const unsigned a[4] = {ap[0], ap[1], ap[2], ap[3]};
#pragma unroll
          for (int i = 0; i < OWN; ++i)
            if (nd_of(i) < D / 8) segment_pv(o[i], a, corr, vs_at, nd_of(i), sb, kk);
        }
      }
      mrun[0] = sp.ml[lane][0];
      mrun[1] = sp.ml[lane][1];
      lrun[0] = sp.ml[lane][2];
      lrun[1] = sp.ml[lane][3];
    } else {
      for (int sb = 0; live && sb < n16 && base + sb < warp_lim; sb += SEG_SUB) {
        float sc[SEG_NB][4], corr[2];
#pragma unroll
        for (int nb = 0; nb < SEG_NB; ++nb)
#pragma unroll
          for (int i = 0; i < 4; ++i) sc[nb][i] = 0.f;
        // the query's k-step once for the sub-tile's n-blocks
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
          unsigned a[4];
          ldmatrix_a_at(a, qt + 2u * ks * 16, SEG_Q_LD);
#pragma unroll
          for (int nb = 0; nb < SEG_NB; ++nb)
            if (sb + nb * 8 < n16)
              segment_score_step(sc[nb], a, ks_at + 2u * (sb + nb * 8) * SEG_KV_LD, ks);
        }
        segment_softmax(sc, lim, end, base + sb, scale, mrun, lrun, corr);
        unsigned pa[SEG_SUB / 16][4];  // the probabilities as A fragments (the scores die here)
#pragma unroll
        for (int kk = 0; kk < SEG_SUB / 16; ++kk) segment_p_frag(sc, kk, pa[kk]);
        // an output n-tile at a time, its k-steps in order (each element's chain as in the
        // split mode, which runs the k-steps outer)
#pragma unroll
        for (int i = 0; i < OWN; ++i)
#pragma unroll
          for (int kk = 0; kk < SEG_SUB / 16; ++kk)
            if (sb + kk * 16 < n16) segment_pv(o[i], pa[kk], corr, vs_at, nd_of(i), sb, kk);
      }
    }
    if (own) buf ^= 1;  // the next tile is in the other buffer
  }
  if (!live) return;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int m = mt * 16 + gq + 8 * h;
    if (m >= M) continue;
    const int tok = seg + r0 + m / MK_GROUP, head = m % MK_GROUP;
    const int used = splits_used(row_pos(st, tok) + 1, splits, min_chunk);
    if (row_finishes(used, least, rot)) {
      mk_in_t* out = P.attn + (size_t)tok * MK_Q_DIM + (size_t)(gk * MK_GROUP + head) * D;
#pragma unroll
      for (int i = 0; i < OWN; ++i) {
        const int nd = nd_of(i);
        if (nd >= D / 8) continue;
        store_in(out + nd * 8 + 2 * t, o[i][2 * h] / lrun[h]);
        store_in(out + nd * 8 + 2 * t + 1, o[i][2 * h + 1] / lrun[h]);
      }
    } else {
      const size_t unit = (size_t)tok * MK_KV_HEADS * splits + (size_t)gk * splits + j;
      float* po = P.attn_o + (unit * MK_GROUP + head) * D;
#pragma unroll
      for (int i = 0; i < OWN; ++i) {
        const int nd = nd_of(i);
        if (nd >= D / 8) continue;
        *reinterpret_cast<float2*>(po + nd * 8 + 2 * t) = make_float2(o[i][2 * h], o[i][2 * h + 1]);
      }
      if (t == 0 && (!ONE || warp == 0)) {
        P.attn_ml[(unit * MK_GROUP + head) * 2] = mrun[h];
        P.attn_ml[(unit * MK_GROUP + head) * 2 + 1] = lrun[h];
      }
    }
  }
}

// Unit slot j (split `split`) of KV group gk for rows [first, end) (a part: segment_parts) of
// the segment of nrows rows from row seg, rotated by rot: the partials of each of those rows
// that reaches it at its slot j, or (row_finishes) its normalised output into P.attn; its
// (row, head) queries in passes of NWARPS m-tiles, or one m-tile split over the warps
// (segment_pass).
__device__ bool attention_segment(const Params& P, const int* st, int layer, int gk, int j,
                                  int split, int seg, int nrows, int first, int end, int splits,
                                  int min_chunk, int least, int rot, float scale, int& buf,
                                  bool pre, bool has_next, const UnitCursor& next) {
  const int pos0 = row_pos(st, seg);
  const int chunk = split_chunk(pos0 + nrows, splits, min_chunk);
  const int t0 = split * chunk, t1 = min(pos0 + end, t0 + chunk);
  const int r0 = max(first, t0 - pos0);  // the part's first row reaching t0
  const int M = (end - r0) * MK_GROUP;   // their (row, head) queries
  if (M <= 0) return false;  // (block-uniform) no row of the part reaches the split
  const int mtiles = (M + 15) / 16;
  if (mtiles == 1) {  // the split mode (block-uniform)
    segment_pass<true>(P, st, layer, gk, j, seg, r0, M, 0, t0, t1, splits, min_chunk, least,
                       rot, scale, buf, pre, true, has_next, next);
    return true;
  }
  // the copied first tile serves the first pass only: a unit of many tiles restages it in
  // every later pass (the pass before left its last tile in the buffer)
  for (int mt0 = 0; mt0 < mtiles; mt0 += NWARPS)
    segment_pass<false>(P, st, layer, gk, j, seg, r0, M, mt0, t0, t1, splits, min_chunk, least,
                        rot, scale, buf, pre && mt0 == 0, mt0 + NWARPS >= mtiles, has_next,
                        next);
  return true;
}

// ATTENTION of the tensor-core kernel: every segment of the step (one rotation each, its last
// row's used splits) runs the instruction's units that hold its splits (attention_segment),
// then each row's ticket as op_attention draws it.
__device__ void op_attention_segments(const Params& P, const int* ins, const int* st) {
  if (last_layer_idle(st, ins[W_LAYER])) return;  // (no unit run: no ticket drawn)
  const int layer = ins[W_LAYER], b = ins[W_TILE_BEGIN], e = ins[W_TILE_END];
  const int splits = ins[A_ATTENTION_SPLITS], min_chunk = ins[A_ATTENTION_MIN_CHUNK];
  const int least = ins[A_ATTENTION_MERGE_MIN], ntok = step_tokens(st);
  const float scale = 1.0f / sqrtf((float)D);
  int rot = 0;          // the segment's rotation (split_slot)
  bool merges = false;  // it ran units of a row that merges by ticket (not row_finishes)
  int my_draw = 0, my_rot = 0;  // thread r: row r's draw and rotation (attention_row_tickets)
  UnitCursor next = {0, b, 0};  // the rolling prefetch's (attention_prefetch_next)
  int buf = 0;       // the tile buffer of the next unit to run (block-uniform)
  bool pre = false;  // its first tile was copied there by the unit before (MK_ATTN_PIPE)
  for (int seg = 0; seg < ntok;) {
    const int end = unit_rows_end(st, seg, ntok), nrows = end - seg;
    const int used = splits_used(row_pos(st, end - 1) + 1, splits, min_chunk);
    const int parts = segment_parts(used, nrows, splits);
    for (int u = b; u < e; ++u) {
      const int g = u / splits, j = u % splits;
      const int v = j >= rot ? j - rot : j - rot + splits;  // the segment's v-th slot
      if (v >= used * parts) continue;  // no positions: no queries, no partials
      const int part = v / used, split = v - part * used;
      bool has_next = false;  // the next unit has queries (the pipeline copies its first tile)
      attention_prefetch_next(P, st, next, seg, u, rot, layer, b, e, splits, min_chunk, ntok,
                              false, MK_ATTN_PIPE ? &has_next : nullptr);
      const bool ran = attention_segment(P, st, layer, g, j, split, seg, nrows,
                                         part * nrows / parts, (part + 1) * nrows / parts,
                                         splits, min_chunk, least,
                                         split_slot(part * used, rot, splits), scale, buf, pre,
                                         has_next, next);
      pre = ran && has_next;  // its pass copied the next unit's first tile
      if (pre) buf ^= 1;
    }
    // each row's draw: this instruction's units of it (a row uses the splits below its own
    // used ones, at its part's rotation), as op_attention's row loop counts them
    for (int tok = seg; tok < end; ++tok) {
      const int u_tok = splits_used(row_pos(st, tok) + 1, splits, min_chunk);
      const int prot = split_slot(segment_part_of(tok - seg, parts, nrows) * used, rot, splits);
      int ran = 0;
      for (int u = b; u < e; ++u) {
        const int j = u % splits;
        ran += (j >= prot ? j - prot : j - prot + splits) < u_tok;
      }
      const bool draws = merge_by_ticket(u_tok, least) && !row_finishes(u_tok, least, prot) &&
                         ran > 0;
      merges |= draws;
      if (threadIdx.x == tok) {
        my_draw = draws ? ran | u_tok << 16 : 0;
        my_rot = prot;
      }
    }
    rot = next_rotation(rot, used * parts, splits);
    seg = end;
  }
  if (ins[A_ATTENTION_TICKETS] > 0 && least > 0 && merges)
    attention_row_tickets(P, st, ins[A_ATTENTION_TICKET], b / splits, splits, min_chunk, ntok,
                          my_draw, my_rot);
}
#endif

__device__ void op_attention(const Params& P, OpShared& s, const int* ins, const int* st) {
  const int layer = ins[W_LAYER], b = ins[W_TILE_BEGIN], e = ins[W_TILE_END];
  const int splits = ins[A_ATTENTION_SPLITS], min_chunk = ins[A_ATTENTION_MIN_CHUNK];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int ntok = step_tokens(st);
  const float scale = 1.0f / sqrtf((float)D);
  const size_t kv_layer = (size_t)layer * MK_KV_ROWS * MK_KV_HEADS * D;
  const int least = ins[A_ATTENTION_MERGE_MIN];
#if ROTATE_ROWS
  int rot = 0;          // this row's rotation (split_slot)
  bool merges = false;  // it ran units of a row that merges by ticket (not row_finishes)
  int my_draw = 0, my_rot = 0;  // thread r: row r's draw and rotation (attention_row_tickets)
  UnitCursor next = {0, b, 0};  // the rolling prefetch's (attention_prefetch_next)
#else
  int most_used = 0;  // the most splits a row uses: the ticket is drawn when it merges
#endif
  for (int tok = 0; tok < ntok; ++tok) {  // the step's rows, each over its own context
    const int pos = row_pos(st, tok), n_pos = pos + 1, slot = row_slot(st, tok);
    // the row's segment (its sequence's rows in this step) starts at row seg, position pos0
    const int seg = row_seg(st, tok), pos0 = row_pos(st, seg);
    (void)seg;
    const int used = splits_used(n_pos, splits, min_chunk);
#if ROTATE_ROWS
    const bool finishes = row_finishes(used, least, rot);
    int ran = 0;  // this instruction's units of the row
#else
    most_used = max(most_used, used);
#endif
    const int chunk = split_chunk(n_pos, splits, min_chunk);
    for (int u = b; u < e; ++u) {
      // unit slot j of KV group g holds the row's split (j - rot) mod splits
      const int g = u / splits, j = u % splits;
#if ROTATE_ROWS
      const int split = j >= rot ? j - rot : j - rot + splits;
      if (split >= used) continue;  // no positions: no queries, no partials
      ++ran;
      attention_prefetch_next(P, st, next, tok, u, rot, layer, b, e, splits, min_chunk, ntok);
#else
      const int split = j;
#endif
      const int t0 = split * chunk, t1 = min(n_pos, t0 + chunk);
#if LATE_QK
      // warp h < GROUP: query head h of the group; warp GROUP: the new key (into s.row)
      static_assert(MK_GROUP + 1 <= NWARPS, "late q/k gives each head vector a warp");
      if (warp < MK_GROUP)
        warp_qk_norm_rope(P, P.q + (size_t)tok * MK_Q_DIM + (g * MK_GROUP + warp) * D,
                          P.q_norm + (size_t)layer * D, pos, s.q + warp * D);
      else if (warp == MK_GROUP)
        warp_qk_norm_rope(P, P.k_raw + (size_t)tok * MK_KV_DIM + g * D,
                          P.k_norm + (size_t)layer * D, pos, s.row);
      for (int i = threadIdx.x; i < MK_GROUP * D; i += MK_THREADS) s.o[i] = 0.f;
#else
      for (int i = threadIdx.x; i < MK_GROUP * D; i += MK_THREADS) {
        s.q[i] = P.q[(size_t)tok * MK_Q_DIM + g * MK_GROUP * D + i];
        s.o[i] = 0.f;
      }
#endif
      if (threadIdx.x < MK_GROUP) {
        s.m[threadIdx.x] = NEG_INF;
        s.l[threadIdx.x] = 0.f;
      }
      __syncthreads();
#if LATE_QK && MK_T_MAX > 1
      // the chunk's earlier keys in this unit's positions [c0, c1), as O_PROJ will cache them
      // after the layer's attention (bf16 of the normed, roped key): one warp per key, the
      // warp's s.vec rows as scratch (attention_values uses s.vec only later)
      const int c0 = max(t0, pos0), c1 = min(t1, pos);
      if (c0 < c1) {
        unsigned short* kc = chunk_keys();
        for (int p = c0 + warp; p < c1; p += NWARPS) {
          float* tmp = s.vec + warp * D;
          warp_qk_norm_rope(P, P.k_raw + (size_t)(seg + p - pos0) * MK_KV_DIM + g * D,
                            P.k_norm + (size_t)layer * D, p, tmp);
          for (int d = lane; d < D; d += 32) kc[(p - pos0) * D + d] = f32_to_bf16(tmp[d]);
        }
        __syncthreads();
      }
#endif
      const unsigned short* Kg = P.k_cache + kv_layer + (size_t)g * D;
      const unsigned short* Vg = P.v_cache + kv_layer + (size_t)g * D;
      for (int base = t0; base < t1; base += T_TILE) {
        const int cnt = min(T_TILE, t1 - base);
        attention_scores(P, s, slot, Kg, base, cnt, scale, pos0);
#if LATE_QK
        // the cache does not hold this step's key yet (O_PROJ writes it): score pos from s.row
        if (base <= n_pos - 1 && n_pos - 1 < base + cnt) {
          __syncthreads();
          if (warp < MK_GROUP) {
            float acc = 0.f;
            // the key as the cache will hold it (bf16), as later steps and the reference see it
            for (int d = lane; d < D; d += 32)
              acc += s.q[warp * D + d] * bf16_to_f32(f32_to_bf16(s.row[d]));
            acc = warp_sum(acc);
            if (lane == 0) s.score[warp * T_TILE + (n_pos - 1 - base)] = acc * scale;
          }
        }
#endif
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
        attention_values(P, s, slot, Vg, base, cnt);
        __syncthreads();
      }
#if MK_SLOTS
      // a row of one split: its split 0 is the only unit run (the others are empty), here in
      // slot 0
      if (finishes) {
        mk_in_t* out = P.attn + (size_t)tok * MK_Q_DIM + (size_t)g * MK_GROUP * D;
        for (int i = threadIdx.x; i < MK_GROUP * D; i += MK_THREADS)
          store_in(out + i, s.o[i] / s.l[i / D]);
      } else
#endif
      {
        const size_t unit = (size_t)tok * MK_KV_HEADS * splits + (size_t)g * splits + j;
        for (int i = threadIdx.x; i < MK_GROUP * D; i += MK_THREADS)
          P.attn_o[unit * MK_GROUP * D + i] = s.o[i];
        if (threadIdx.x < MK_GROUP) {
          P.attn_ml[(unit * MK_GROUP + threadIdx.x) * 2] = s.m[threadIdx.x];
          P.attn_ml[(unit * MK_GROUP + threadIdx.x) * 2 + 1] = s.l[threadIdx.x];
        }
      }
      __syncthreads();  // s.q / s.o are reused by the next unit
    }
#if ROTATE_ROWS
    const bool draws = merge_by_ticket(used, least) && !finishes && ran > 0;
    merges |= draws;
    if (threadIdx.x == tok) {
      my_draw = draws ? ran | used << 16 : 0;
      my_rot = rot;
    }
    rot = next_rotation(rot, used, splits);
#endif
  }
  const int tickets = ins[A_ATTENTION_TICKETS];  // > 0: the units lie in one KV group
  // a ticket is drawn when a row of the step merges splits (not one finished by its unit);
  // in a kernel of slots, a row this instruction ran units of
#if ROTATE_ROWS
  if (tickets > 0 && least > 0 && merges)
    attention_row_tickets(P, st, ins[A_ATTENTION_TICKET], b / splits, splits, min_chunk, ntok,
                          my_draw, my_rot);
#else
  if (tickets > 0 && least > 0 && merge_by_ticket(most_used, least))
    attention_ticket(P, st, ins[A_ATTENTION_TICKET], tickets, b / splits, splits, min_chunk,
                     least, ntok);
#endif
}

#if MK_MMA
// ================================================================================================
// An input slice of O_PROJ or DOWN (kernel/input_slices.py; isa Word.GROUP: log2 SLICES << 24
// | the slice j << 27; the row group's counter is the op's signal + 1 + the block's group,
// blockIdx.x / (c x SLICES)): the row group's c x SLICES members share its rows
// (Word.GROUP_TILE), member i SLICES + j over the input columns [j K / SLICES, (j + 1) K /
// SLICES): in a step of at least the group's min_tokens tokens, the group's rows by token
// share i; in a smaller one, rows part i of the group (its rows cut in c, as split_even) by
// every token. Either way the partial of (token, row, j) is the same k-loop; it goes to
// partials[token][j H + row] as fp32. Then the member signals the group's counter, waits for
// its c x SLICES members and sums its own rows (the instruction's tile) for every token over
// the slices in order, into the residual and its bf16 copy. If the wait fails (the watchdog,
// or another block's error) it returns without its sum: the error is recorded, and every
// later wait of the launch sees it and aborts.
// (prefetch_weights fetches the tile's rows whole: the members' tiles together are the op's
// rows, so every weight byte is still fetched once.)
// ================================================================================================
template <int K, int SLICES>
__device__ void slice_mma(const Params& P, OpShared& s, const int* ins, const int* st,
                          const unsigned short* W, const mk_in_t* X, int instr) {
  constexpr int KS = K / SLICES;
  static_assert(K % (16 * SLICES) == 0, "input_slices.check: whole 16-column chunks");
  // the row group's counter: the op's signal + 1 + the group (the words read where used, not
  // held through the mat-mul)
  const auto counter_of = [&] {
    return ins[W_SIGNAL_COUNTER] + 1 + blockIdx.x / (MK_GROUP_MEMBERS(ins[W_GROUP]) * SLICES);
  };
  if (last_layer_idle(st, ins[W_LAYER])) {  // its row group's counter counts every step
    signal_counter(P, counter_of());
    return;
  }
  const int ntok = step_tokens(st);
  {
    const int g = ins[W_GROUP], c = MK_GROUP_MEMBERS(g), i = MK_GROUP_INDEX(g);
    const int j = MK_GROUP_SLICE(g);
    const int tile = ins[W_GROUP_TILE], lo = MK_GROUP_TILE_BEGIN(tile);
    const int hi = MK_GROUP_TILE_END(tile);
    const bool shares = c > 1 && ntok >= MK_GROUP_MIN_TOKENS(g);
    const int b = shares ? lo : lo + i * (hi - lo) / c;
    const int rows = (shares ? hi : lo + (i + 1) * (hi - lo) / c) - b;
    const int t0 = shares ? i * ntok / c : 0, n = (shares ? (i + 1) * ntok / c : ntok) - t0;
    if (rows > 0 && n > 0) {
      // the slice's weights, input and partials from their first row, token and column
      const mk_in_t* x_in = X + (size_t)t0 * K + j * KS;
      float* part = P.partials + (size_t)t0 * MK_PARTIALS_LD + j * H + b;
      // (the k split's weights in registers, not the ring: a warp's chunks of K / SLICES are
      // mostly one, and with the ring SmolLM2's kernel of (1, 8) slices spilled 8 bytes)
      block_mma<KS, false>(
          s.mma, (rows + 15) / 16, n, tile_rows(W + (size_t)b * K + j * KS, rows, K),
          [&](int tok, int col, unsigned (&x)[4]) { load_bf16_x8(x_in + (size_t)tok * K, col, x); },
          [&](int q0, int tok0, auto sum) {
            for (int x = threadIdx.x; x < MMA_RG * 128; x += MK_THREADS) {
              const int q = x / 128, r = (x / 8) % 16, m = x % 8;
              const int k = (q0 + q) * 16 + r, tok = tok0 + m;
              if (k < rows && tok < n) part[(size_t)tok * MK_PARTIALS_LD + k] = sum(q, r, m);
            }
          });
    }
  }
  const int members = MK_GROUP_MEMBERS(ins[W_GROUP]) * SLICES;
  const int counter = counter_of();
  signal_counter(P, counter);  // (its barrier: every thread's partials are issued)
  if (!wait_counter(P, counter, members * (st[S_STEP] + 1), instr, ins[W_OP],
                    st[S_WATCHDOG_MS]))
    return;
  const int x0 = ins[W_TILE_BEGIN], w = ins[W_TILE_END] - x0;
  for (int x = threadIdx.x; x < w * ntok; x += MK_THREADS) {
    const int tok = x / w, row = x0 + x % w;
    const float* p = P.partials + (size_t)tok * MK_PARTIALS_LD + row;
    float v = p[0];
#pragma unroll
    for (int k = 1; k < SLICES; ++k) v += p[k * H];
    const size_t at = (size_t)tok * H + row;
    const float r = P.residual[at] + v;
    P.residual[at] = r;
    P.residual_in[at] = f32_to_bf16(r);
  }
}
#endif  // MK_MMA

#if LATE_QK
// Late q/k: pairs [0, pairs) of the step's (row, KV head kv0 + h) keys from row r0 on, pair i
// the row r0 + i / heads and head kv0 + i % heads, normed, roped and cached, N a warp at once
// (warp_qk_norm_rope_n: their loads issued together; segment_keys' pinned arithmetic, so the
// cache gets the bf16 value attention's K tile used), stored from the lanes.
template <int N>
__device__ __forceinline__ void cache_keys(const Params& P, const int* st, int layer, int kv0,
                                           int heads, int r0, int pairs) {
  for (int i0 = (int)(threadIdx.x >> 5) * N; i0 < pairs; i0 += NWARPS * N) {
    size_t at[N];
#pragma unroll
    for (int n = 0; n < N; ++n) {
      const int i = min(i0 + n, pairs - 1), tok = r0 + i / heads;
      at[n] = kv_at(P, layer, row_slot(st, tok), row_pos(st, tok), kv0 + i % heads);
    }
    warp_qk_norm_rope_n<N>(
        P,
        [&](int n) {
          const int i = i0 + n;
          return P.k_raw + (size_t)(r0 + i / heads) * MK_KV_DIM + (kv0 + i % heads) * D;
        },
        P.k_norm + (size_t)layer * D, [&](int n) { return row_pos(st, r0 + (i0 + n) / heads); },
        [&](int n) { return i0 + n < pairs; },
        [&](int n, int j, float v) { P.k_cache[at[n] + j] = f32_to_bf16(v); });
  }
}
#endif

// ================================================================================================
// Op: O_PROJ_RESIDUAL - merge the attention splits (every block, into shared memory), then
// residual[r] += Wo[r] . attn for the tile's rows.
// ================================================================================================
__device__ void op_o_proj_residual(const Params& P, OpShared& s, const int* ins, const int* st,
                                   int instr) {
  const int ntok = step_tokens(st);
#if MK_MMA
  const int layer = ins[W_LAYER];
#else
  const int layer = ins[W_LAYER], b = ins[W_TILE_BEGIN], e = ins[W_TILE_END];
  const int splits = ins[A_O_PROJ_RESIDUAL_SPLITS];
#endif
#if LATE_QK
  {  // this block caches the keys of KV heads [kv0, kv0 + heads) of its part of the step's
    // rows (ops/o_proj.py key_parts): its (row, head) pairs over the warps, KEY_CACHE_KEYS a
    // warp at once
    const int keys = ins[A_O_PROJ_RESIDUAL_KEYS], kv0 = MK_O_PROJ_KEYS_KV_FIRST(keys);
    const int heads = MK_O_PROJ_KEYS_KV_END(keys) - kv0, parts = MK_O_PROJ_KEYS_PARTS(keys);
    const int part = MK_O_PROJ_KEYS_PART(keys);
    const int r0 = part * ntok / parts, pairs = ((part + 1) * ntok / parts - r0) * heads;
    if (pairs <= NWARPS)  // (one key a warp: a decode step's, without the dead vectors' work)
      cache_keys<1>(P, st, layer, kv0, heads, r0, pairs);
    else
      cache_keys<KEY_CACHE_KEYS>(P, st, layer, kv0, heads, r0, pairs);
    __syncthreads();
  }
#endif
  // the tile's residual rows (of a row tile: this block's own; EMBED, O_PROJ and DOWN share
  // the row tiles) are read in the same round trip as the weights
#if MK_MMA
#if MK_O_PROJ_SLICES > 1
  // every instruction of the op with rows is sliced (Program.slices_of); one past the last
  // row group has none. The unsliced mat-mul is not compiled: a second block_mma beside the
  // slice's spilled Qwen3's kernel of 128 slots
  if (MK_GROUP_SLICES_LOG2(ins[W_GROUP]) != 0)
    slice_mma<MK_Q_DIM, MK_O_PROJ_SLICES>(P, s, ins, st, P.wo + (size_t)layer * H * MK_Q_DIM,
                                          P.attn, instr);
  return;
#endif
  (void)instr;
  if (last_layer_idle(st, layer)) return;
  // the tile's rows [b, e) for tokens [t0, t0 + n) (token_group)
  const MmaTile m = token_group(ins, ntok);
  const int b = m.b, e = m.e, t0 = m.t0, n = m.t1 - m.t0;
  if (b >= e || n <= 0) return;
  const unsigned short* W = P.wo + ((size_t)layer * H + b) * MK_Q_DIM;
  // every row's attention was merged by ticket (tensor_cores: merge_ticket_min 1)
  block_mma<MK_Q_DIM>(
      s.mma, (e - b + 15) / 16, n, tile_rows(W, e - b, MK_Q_DIM),
      [&](int tok, int col, unsigned (&x)[4]) {
        load_bf16_x8(P.attn + (size_t)(t0 + tok) * MK_Q_DIM, col, x);
      },
      [&](int q0, int tok0, auto sum) {
        mma_add_rows(P.residual + (size_t)t0 * H, P.residual_in + (size_t)t0 * H, b, e - b,
                     n, q0, tok0, sum);
      });
  store_residual_in(P, t0, b, e, n);
#else
  (void)instr;
  if (b >= e) return;
  const unsigned short* W = P.wo + ((size_t)layer * H + b) * MK_Q_DIM;
  int rot = 0;  // the row's rotation (split_slot): ATTENTION's, the rows' used splits before it
  for (int tok = 0; tok < ntok; ++tok) {
    const int used = splits_used(row_pos(st, tok) + 1, splits, ins[A_O_PROJ_RESIDUAL_MIN_CHUNK]);
    // ATTENTION merged it: read it, one round
    if (merge_by_ticket(used, ins[A_O_PROJ_RESIDUAL_MERGE_MIN])) {
      copy_to_shared<MK_Q_DIM>(s.vec, P.attn + (size_t)tok * MK_Q_DIM);
    } else {
      // MK_MERGE_WAYS (isa.merge_block_ways) lanes per output chunk: the block's threads in
      // one pass
      static_assert(MK_Q_DIM / 8 * MK_MERGE_WAYS <= MK_THREADS, "merge_block_ways: one pass");
      merge_splits<MK_MERGE_WAYS>(P, tok, s.vec, 0, MK_Q_DIM / 8, splits, used, rot);
    }
    rot = next_rotation(rot, used, splits);
    __syncthreads();
    float* res = P.residual + (size_t)tok * H;
    block_dot_rows<MK_Q_DIM>(
        e - b, [&](int k) { return W + (size_t)k * MK_Q_DIM; }, s.vec,
        [&](int k) { return res[b + k]; },
        [&](int k, float v, float before) { res[b + k] = before + v; });
    if (tok + 1 < ntok) __syncthreads();  // s.vec: the next token's input
  }
#endif
}

// ================================================================================================
// Op: RMS_GATE_UP - h[r] = silu(Wg[r] . x) * (Wu[r] . x), x = rmsnorm(residual); the gate and
// up rows of a pass are loaded together
// ================================================================================================
__device__ void op_rms_gate_up(const Params& P, OpShared& s, const int* ins, const int* st,
                               const float (&g)[RMS_PER]) {
#if MK_MMA
  // the tile's rows [b, e) for tokens [t0, t0 + nt) (token_group); a row group: 8 rows' gate
  // rows (group rows 0-7) and their up rows (8-15)
  (void)g;
  if (last_layer_idle(st, ins[W_LAYER])) return;
  const MmaTile m = token_group(ins, step_tokens(st));
  const int layer = ins[W_LAYER], b = m.b, e = m.e, t0 = m.t0, nt = m.t1 - m.t0;
  if (b >= e || nt <= 0) return;
  const size_t off = ((size_t)layer * MK_FFN + b) * H;
  const unsigned short* norm = P.post_norm + (size_t)layer * H;
  const int n = e - b;
  const int staged = mma_rms(s.mma, P.residual_in, nt, [&](int i) { return t0 + i; }, norm);
  block_mma<H>(
      s.mma, (n + 7) / 8, nt,
      [&](int q, int r) -> const unsigned short* {
        const int k = q * 8 + (r & 7);
        return k < n ? (r < 8 ? P.wg : P.wu) + off + (size_t)k * H : nullptr;
      },
      [&](int tok, int col, unsigned (&x)[4]) {
        rms_load_x(staged, tok, P.residual_in + (size_t)(t0 + tok) * H, s.mma.rms[tok], norm, col,
                   x);
      },
      [&](int q0, int tok0, auto sum) {
        for (int i = threadIdx.x; i < MMA_RG * 64; i += MK_THREADS) {
          const int q = i / 64, r = (i / 8) % 8, c = i % 8;
          const int k = (q0 + q) * 8 + r, tok = tok0 + c;
          if (k < n && tok < nt) {
            const float gv = sum(q, r, c), uv = sum(q, r + 8, c);
            store_in(P.ffn_h + (size_t)(t0 + tok) * MK_FFN + b + k,
                     gv / (1.0f + expf(-gv)) * uv);
          }
        }
      });
#else
  const int layer = ins[W_LAYER], b = ins[W_TILE_BEGIN], e = ins[W_TILE_END];
  if (b >= e) return;
  const int ntok = step_tokens(st);
  const size_t off = ((size_t)layer * MK_FFN + b) * H;
  for (int tok = 0; tok < ntok; ++tok) {
    rms_apply(P.residual + (size_t)tok * H, g, s.vec);
    float* h = P.ffn_h + (size_t)tok * MK_FFN;
    // (the next token's rms_apply writes s.vec only after its block_sum's barriers)
    block_dot_row_pairs<H>(e - b, P.wg + off, P.wu + off, s.vec, [&](int k, float gv, float uv) {
      h[b + k] = gv / (1.0f + expf(-gv)) * uv;
    });
  }
#endif
}

// ================================================================================================
// Op: DOWN_RESIDUAL - residual[r] += Wd[r] . h (the block's own residual rows, read with the
// weights)
// ================================================================================================
__device__ void op_down_residual(const Params& P, OpShared& s, const int* ins, const int* st,
                                 int instr) {
#if MK_MMA
  const int layer = ins[W_LAYER];
#if MK_DOWN_SLICES > 1
  // every instruction of the op with rows is sliced (Program.slices_of); one past the last
  // row group has none. The unsliced mat-mul is not compiled: a second block_mma beside the
  // slice's spilled Qwen3's kernel of 128 slots
  if (MK_GROUP_SLICES_LOG2(ins[W_GROUP]) != 0)
    slice_mma<MK_FFN, MK_DOWN_SLICES>(P, s, ins, st, P.wd + (size_t)layer * H * MK_FFN, P.ffn_h,
                                      instr);
  return;
#endif
  (void)instr;
  if (last_layer_idle(st, layer)) return;
  // the tile's rows [b, e) for tokens [t0, t0 + n) (token_group)
  const MmaTile m = token_group(ins, step_tokens(st));
  const int b = m.b, e = m.e, t0 = m.t0, n = m.t1 - m.t0;
  if (b >= e || n <= 0) return;
  const unsigned short* W = P.wd + ((size_t)layer * H + b) * MK_FFN;
  block_mma<MK_FFN>(
      s.mma, (e - b + 15) / 16, n, tile_rows(W, e - b, MK_FFN),
      [&](int tok, int col, unsigned (&x)[4]) {
        load_bf16_x8(P.ffn_h + (size_t)(t0 + tok) * MK_FFN, col, x);
      },
      [&](int q0, int tok0, auto sum) {
        mma_add_rows(P.residual + (size_t)t0 * H, P.residual_in + (size_t)t0 * H, b, e - b,
                     n, q0, tok0, sum);
      });
  store_residual_in(P, t0, b, e, n);
#else
  (void)instr;
  const int layer = ins[W_LAYER], b = ins[W_TILE_BEGIN], e = ins[W_TILE_END];
  if (b >= e) return;
  const int ntok = step_tokens(st);
  const unsigned short* W = P.wd + ((size_t)layer * H + b) * MK_FFN;
  for (int tok = 0; tok < ntok; ++tok) {
    copy_to_shared<MK_FFN>(s.vec, P.ffn_h + (size_t)tok * MK_FFN);
    __syncthreads();
    float* res = P.residual + (size_t)tok * H;
    block_dot_rows<MK_FFN>(
        e - b, [&](int k) { return W + (size_t)k * MK_FFN; }, s.vec,
        [&](int k) { return res[b + k]; },
        [&](int k, float v, float before) { res[b + k] = before + v; });
    if (tok + 1 < ntok) __syncthreads();  // s.vec: the next token's input
  }
#endif
}

// ================================================================================================
// Op: RMS_LM_HEAD - logits[r] = lm_head[r] . rmsnorm(residual); the tile's best score
// (logit, or logit / T + Gumbel noise when sampling) and its token go to lm_part[slot].
// ================================================================================================
// The better of two (score, token) candidates: a NaN score wins (it poisons the step), then the
// higher score, then the lower token id; id -1 is "none".
__device__ __forceinline__ void best_of(float& v, int& id, float ov, int oid) {
  if (oid < 0) return;
  if (id < 0 || (v == v && (ov != ov || ov > v || (ov == v && oid < id)))) {
    v = ov;
    id = oid;
  }
}

// The end of a step, by the one block that ends it (the LM head's last ticket):
// the token the next position embeds (the fed prompt token while the prompt lasts, else the
// sampled one, -1 if a logit was NaN) goes to out_tokens, where the host polls it, and to the
// state with the next position and step and whether the launch goes on (StopReason). Then the
// step counter moves (a release by the thread that wrote all of it: a signal), and a multi-step
// launch's blocks acquire it before their next step. host_stop is the host's stop flag as the
// LM head's first tile's block read it before its wait (read_host_stop: its PCIe round trip
// off the step's path; lm_head_ticket passes it on; a stop asked later ends the launch one
// step later). The token's store to mapped host memory is a
// volatile (strong, system-scope) store with no fence after it: nothing on the GPU waits for
// the host to see it, and the host polls until it does (a system fence here held the next step).
// The stop mask of `slot` (a kernel of slots: one per slot; else slot 0, the one mask).
__device__ __forceinline__ bool stop_token(const Params& P, int slot, int token) {
  return (P.stop_mask[(size_t)slot * MK_STOP_WORDS + (token >> 5)] >> (token & 31)) & 1u;
}

// The host's stop flag (mapped host memory, written while the launch runs): one PCIe read.
__device__ __forceinline__ int read_host_stop(const Params& P) {
  return *reinterpret_cast<volatile int*>(P.host_flags + H_STOP);
}

// ... read before the LM head's wait by its first tile's block alone, else 0 (every block
// reading it put 132 serialized round trips on the step's path); lm_head_ticket hands it on.
__device__ __forceinline__ int lm_head_host_stop(const Params& P, const int* ins) {
  return ins[A_RMS_LM_HEAD_SLOT] == 0 ? read_host_stop(P) : 0;
}

#if MK_SLOTS
// The end of a step of the token table, by every thread of the block that ends it, after its
// warps drew the rows' tokens (P.row_tokens). Every row with logits, a thread each: its drawn
// token to its slot's row of out_tokens, at the row's position; in a launch of more steps,
// the row becomes a decode row of the next table (P.rows, which every block copies after the
// step counter moves), fed that token at the next position, unless its slot stops there
// (isa.RowWord.STOP_POS). The next table keeps the rows' order (a ballot scan over the
// warps). Thread 0 then writes the state words and releases the step counter (one thread a
// row after another put two dependent L2 trips a row on the step's end: its token, then its
// slot's stop mask).
__device__ void finish_rows(const Params& P, const int* st, int host_stop) {
  static_assert(MK_T_MAX <= MK_THREADS, "finish_rows: a thread a row");
  __shared__ int s_kept[NWARPS + 1];  // each warp's kept rows; [NWARPS]: the host's stop flag
  if (threadIdx.x == 0) s_kept[NWARPS] = host_stop;  // (thread 0's: lm_head_ticket)
  __syncthreads();
  host_stop = s_kept[NWARPS];
  const bool more = st[S_STEPS] > 1 && host_stop == 0;
  const int tok = threadIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int* row = step_row(st, min(tok, max(step_tokens(st) - 1, 0)));
  bool keep = false;
  int t = 0;
  if (tok < step_tokens(st) && row[R_LOGITS] >= 0) {
    const int slot = row[R_SLOT], next_pos = row[R_POS] + 1;
    t = P.row_tokens[tok];
    *reinterpret_cast<volatile int*>(P.out_tokens + (size_t)slot * MK_MAX_SEQ + row[R_POS]) = t;
    keep = more && !(t < 0 || stop_token(P, slot, t) || next_pos >= row[R_STOP_POS] ||
                     next_pos >= MK_MAX_SEQ);
  }
  const unsigned kept = __ballot_sync(FULL_MASK, keep);
  if (lane == 0) s_kept[warp] = __popc(kept);
  __syncthreads();
  int k = __popc(kept & ((1u << lane) - 1u)), total = 0;
  for (int w = 0; w < NWARPS; ++w) {
    k += w < warp ? s_kept[w] : 0;
    total += s_kept[w];
  }
  if (keep) {
    int* next = P.rows + k * MK_ROW_WORDS;
    next[R_TOKEN] = t;
    next[R_SLOT] = row[R_SLOT];
    next[R_POS] = row[R_POS] + 1;
    next[R_SEG] = k;
    next[R_LOGITS] = k;
    next[R_TEMPERATURE] = row[R_TEMPERATURE];
    next[R_SEED] = row[R_SEED];
    next[R_STOP_POS] = row[R_STOP_POS];
  }
  __syncthreads();  // every row's stores are issued before thread 0's release
  if (threadIdx.x != 0) return;
  P.state[S_NTOK] = total;
  P.state[S_STEP] = st[S_STEP] + 1;
  P.state[S_RUN] = total > 0;
  P.state[S_STOP_REASON] = total > 0 ? STOP_NONE : host_stop ? STOP_HOST
                         : st[S_STEPS] <= 1 ? STOP_BUDGET : STOP_TOKEN;
#if MK_SYNC >= 2
  red_add_release(&P.counters[st[S_STEP_COUNTER]], 1);  // after the barrier: every row's
#else
  __threadfence();
  atomicAdd(&P.counters[st[S_STEP_COUNTER]], 1);
#endif
}
#else
__device__ __forceinline__ void finish_step(const Params& P, const int* st, int token,
                                            int host_stop) {
  // a chunk's positions pos..pos+NTOK-1: the next token of each but the last is fed
  const int first = st[S_POS], pos = first + step_tokens(st) - 1, next_pos = pos + 1;
  const bool prompt = next_pos < st[S_FEED_END];
  const int next = prompt ? P.feed[next_pos] : token;
  int reason = STOP_NONE;
  if (!prompt && token < 0) reason = STOP_NAN;
  else if (!prompt && stop_token(P, 0, token)) reason = STOP_TOKEN;
  else if ((st[S_STOP_POS] > 0 && next_pos >= st[S_STOP_POS]) || next_pos >= MK_MAX_SEQ)
    reason = STOP_POSITION;
  else if (host_stop != 0) reason = STOP_HOST;
  else if (st[S_STEPS] <= 1) reason = STOP_BUDGET;
  for (int p = first; p < pos; ++p)  // in position order: the host polls them in turn
    *reinterpret_cast<volatile int*>(P.out_tokens + p) = P.feed[p + 1];
  *reinterpret_cast<volatile int*>(P.out_tokens + pos) = next;
  P.state[S_TOKEN] = next;
  P.state[S_POS] = next_pos;
#if MK_T_MAX > 1
  P.state[S_NTOK] = prompt ? min(MK_T_MAX, st[S_FEED_END] - next_pos) : 1;
#endif
  P.state[S_STEP] = st[S_STEP] + 1;
  P.state[S_RUN] = reason == STOP_NONE;
  P.state[S_STOP_REASON] = reason;
#if MK_SYNC >= 2
  red_add_release(&P.counters[st[S_STEP_COUNTER]], 1);  // this thread wrote all of it
#else
  __threadfence();
  atomicAdd(&P.counters[st[S_STEP_COUNTER]], 1);
#endif
}
#endif

// The best of n partials (score, token id as float bits) by one warp, in one round trip:
// every lane ends with it. A lane's pairs (lane, lane + 32, ..) are loaded, BEST_LOADS at a
// time, before its first compare: with each load beside its compare (best_of's branches), the
// compiled loop waited out one L2 round a pair (5 a row on 132 blocks: benchmarks/NOTES.md
// "The LM head's reducer, a round a row"). The same pairs in the same order: the same best.
#define BEST_LOADS MK_BEST_LOADS  // isa.BEST_LOADS
__device__ __forceinline__ void warp_best_of(const float* part, int n, float& best,
                                             int& best_id) {
  const int lane = threadIdx.x & 31;
  best = NEG_INF;
  best_id = -1;
  for (int i0 = lane; i0 < n; i0 += 32 * BEST_LOADS) {
    float2 v[BEST_LOADS];
#pragma unroll
    for (int k = 0; k < BEST_LOADS; ++k)  // (past n: no token, which best_of skips)
      v[k] = i0 + 32 * k < n ? reinterpret_cast<const float2*>(part)[i0 + 32 * k]
                             : make_float2(NEG_INF, __int_as_float(-1));
#pragma unroll
    for (int k = 0; k < BEST_LOADS; ++k) best_of(best, best_id, v[k].x, __float_as_int(v[k].y));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(FULL_MASK, best, o);
    const int oid = __shfl_xor_sync(FULL_MASK, best_id, o);
    best_of(best, best_id, ov, oid);
  }
}

// The step's sample, folded into the LM head. Every block takes a ticket after its partial is
// written (ticket_add: a release, as a signal); the block that draws the step's last ticket
// acquires (as a wait would: its L1 is invalidated) and reduces all partials with one warp, in
// one round trip, while the other blocks go on. No hop, no serial walk over the partials.
__device__ void lm_head_ticket(const Params& P, OpShared& s, const int* st, int ticket,
                               int tickets, int slot, int host_stop) {
  __shared__ int s_last;
  // the first tile's block passes the host's stop flag on (read_host_stop: one read a step)
  if (slot == 0 && threadIdx.x == 0) P.state[S_HOST_STOP] = host_stop;
  __syncthreads();  // every thread's partial stores are issued
  if (threadIdx.x == 0)  // the last drawer acquires the other blocks' partials (ticket_add)
    s_last = ticket_add(&P.counters[ticket], 1) == tickets * (st[S_STEP] + 1) - 1;
  __syncthreads();
  if (!s_last) return;
  // ... and the flag (thread 0 ends the step: finish_step)
  if (threadIdx.x == 0) host_stop = P.state[S_HOST_STOP];
  const int lane = threadIdx.x & 31;
  float best;
  int best_id;
#if MK_SLOTS
  // every row with logits: its draw from its row of partials, a warp per row
  for (int tok = threadIdx.x >> 5; tok < step_tokens(st); tok += NWARPS) {
    if (step_row(st, tok)[R_LOGITS] < 0) continue;
    warp_best_of(P.lm_part + (size_t)tok * tickets * 2, tickets, best, best_id);
    if (lane == 0) P.row_tokens[tok] = best == best ? best_id : -1;
  }
  __syncthreads();  // the rows' tokens are issued before finish_rows reads them
  finish_rows(P, st, host_stop);
#else
  if (threadIdx.x >= 32) return;
  warp_best_of(P.lm_part, tickets, best, best_id);
  if (lane == 0) finish_step(P, st, best == best ? best_id : -1, host_stop);
#endif
}

// One row's LM-head tile: logits[b:e] = lm_head[b:e] . rmsnorm(x) when `run` (none stored
// where logits is null: a row drawn on the device), and the tile's best score (the logit, or
// logit / temp + Gumbel noise keyed by (seed, pos)) with its token written to part[0..1] by
// thread 0 (-inf and -1 when not `run`: a prompt step's, an empty tile's).
__device__ __forceinline__ void lm_head_tile(const Params& P, OpShared& s,
                                             const float (&g)[RMS_PER], int b, int e, bool run,
                                             const float* x, float* logits, float temp,
                                             unsigned seed, unsigned pos, float* part) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float best = NEG_INF;
  int best_id = -1;
  if (run) {
    rms_apply(x, g, s.vec);
    block_dot_rows<H>(
        e - b, [&](int k) { return P.lm_head + (size_t)(b + k) * H; }, s.vec,
        [](int) { return 0.f; },
        [&](int k, float v, float) {
          const int r = b + k;
          if (logits != nullptr) logits[r] = v;
          best_of(best, best_id, temp > 0.f ? v / temp + gumbel(seed, pos, (unsigned)r) : v, r);
        });
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {  // the warp's best: every lane ends with it
    const float ov = __shfl_xor_sync(FULL_MASK, best, o);
    const int oid = __shfl_xor_sync(FULL_MASK, best_id, o);
    best_of(best, best_id, ov, oid);
  }
  if (lane == 0) {
    s.best[warp] = best;
    s.best_id[warp] = best_id;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < NWARPS; ++w) best_of(best, best_id, s.best[w], s.best_id[w]);
    part[0] = best;
    part[1] = __int_as_float(best_id);
  }
}

#if MK_MMA
// The LM head on tensor cores: the step's rows with logits (a token group of 8 of them per
// pass), their logits over the tile (stored for the host's rows only: S_HOST_LOGITS) and each
// row's best score (logit, or logit / temp + Gumbel noise keyed by (seed, pos)) with its token
// to the row's partial: -inf and -1 for an empty tile. A row's best is kept by one thread (row
// i: thread i % 8) over the passes.
__device__ void lm_head_mma(const Params& P, MmaShared& sm, const int* st, int b, int e,
                            int slot, int parts) {
  __shared__ int s_rows;
  if (threadIdx.x == 0) {
    int m = 0;
    for (int tok = 0; tok < step_tokens(st); ++tok)
      if (step_row(st, tok)[R_LOGITS] >= 0) sm.rows[m++] = tok;
    s_rows = m;
  }
  __syncthreads();
  const int m = s_rows;
  for (int i = threadIdx.x; i < m; i += MK_THREADS) {
    sm.best[i] = NEG_INF;
    sm.best_id[i] = -1;
  }
  const int staged = mma_rms(sm, P.residual_in, m, [&](int i) { return sm.rows[i]; },
                              P.final_norm);  // (its barrier: best too)
  const int host_rows = st[S_HOST_LOGITS];  // logits rows the host reads (the drawn: none)
  if (b < e) {
    block_mma<H>(
        sm, (e - b + 15) / 16, m, tile_rows(P.lm_head + (size_t)b * H, e - b, H),
        [&](int i, int col, unsigned (&x)[4]) {
          rms_load_x(staged, i, P.residual_in + (size_t)sm.rows[i] * H, sm.rms[i], P.final_norm,
                     col, x);
        },
        [&](int q0, int tok0, auto sum) {
          for (int i = threadIdx.x; i < MMA_RG * 128; i += MK_THREADS) {
            const int q = i / 128, r = (i / 8) % 16, n = i % 8;
            const int k = (q0 + q) * 16 + r, row = tok0 + n;
            if (k < e - b && row < m) {
              const int lrow = step_row(st, sm.rows[row])[R_LOGITS];
              if (lrow < host_rows) P.logits[(size_t)lrow * MK_VOCAB + b + k] = sum(q, r, n);
            }
          }
          const int row = tok0 + (int)threadIdx.x;
          if (threadIdx.x < 8 && row < m) {
            const int* w = step_row(st, sm.rows[row]);
            const float temp = __int_as_float(w[R_TEMPERATURE]);
            float best = sm.best[row];
            int best_id = sm.best_id[row];
            for (int q = 0; q < MMA_RG; ++q)
              for (int r = 0; r < 16; ++r) {
                const int k = (q0 + q) * 16 + r;
                if (k >= e - b) break;
                const float v = sum(q, r, (int)threadIdx.x);
                best_of(best, best_id,
                        temp > 0.f ? v / temp + gumbel((unsigned)w[R_SEED], (unsigned)w[R_POS],
                                                       (unsigned)(b + k))
                                   : v,
                        b + k);
              }
            sm.best[row] = best;
            sm.best_id[row] = best_id;
          }
        });
  }
  for (int i = threadIdx.x; i < m; i += MK_THREADS) {
    float* part = P.lm_part + ((size_t)sm.rows[i] * parts + slot) * 2;
    part[0] = sm.best[i];
    part[1] = __int_as_float(sm.best_id[i]);
  }
}
#endif

// host_stop: read_host_stop() by thread 0 of the first tile's block (slot 0) before the wait,
// else 0 (lm_head_ticket hands it to the block that ends the step).
__device__ void op_rms_lm_head(const Params& P, OpShared& s, const int* ins, const int* st,
                               const float (&g)[RMS_PER], int host_stop) {
  const int b = ins[W_TILE_BEGIN], e = ins[W_TILE_END], slot = ins[A_RMS_LM_HEAD_SLOT];
#if MK_SLOTS
  // a step of the token table: every row that wants logits, each its own tile and draw
  // (isa.RowWord: its logits row, temperature, seed), its partial in its row of lm_part
  const int parts = ins[A_RMS_LM_HEAD_TICKETS];  // partials per row: one per block
#if MK_MMA
  (void)g;
  lm_head_mma(P, s.mma, st, b, e, slot, parts);
#else
  for (int tok = 0; tok < step_tokens(st); ++tok) {
    const int* row = step_row(st, tok);
    if (row[R_LOGITS] < 0) continue;
    // (a row drawn on the device: its draw only, no logits for the host)
    lm_head_tile(P, s, g, b, e, b < e, P.residual + (size_t)tok * H,
                 row[R_LOGITS] < st[S_HOST_LOGITS] ? P.logits + (size_t)row[R_LOGITS] * MK_VOCAB
                                                   : nullptr,
                 __int_as_float(row[R_TEMPERATURE]),
                 (unsigned)row[R_SEED], (unsigned)row[R_POS],
                 P.lm_part + ((size_t)tok * parts + slot) * 2);
    __syncthreads();  // s.best: the next row's
  }
#endif
#else
  // the step's last token: the only one whose next token is drawn
  const int last = step_tokens(st) - 1;
  const unsigned pos = (unsigned)(st[S_POS] + last);
  // a prompt step's sample is not used (the next position embeds the fed token): no logits
  const bool prompt = (int)pos + 1 < st[S_FEED_END];
  lm_head_tile(P, s, g, b, e, b < e && !prompt, P.residual + (size_t)last * H, P.logits,
               __int_as_float(st[S_TEMPERATURE]), (unsigned)st[S_SEED], pos,
               P.lm_part + slot * 2);
#endif
  const int ticket = ins[A_RMS_LM_HEAD_TICKET], tickets = ins[A_RMS_LM_HEAD_TICKETS];
  if (tickets > 0) lm_head_ticket(P, s, st, ticket, tickets, slot, host_stop);
}

// ================================================================================================
// Prefetch: the weight rows of one instruction (same tiling as the op sections above)
// ================================================================================================
// st: the step's state words (ATTENTION's K/V rows follow the position)
__device__ void prefetch_weights(const Params& P, const int* w, const int* st) {
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
    case OP_ATTENTION: {
      // the units' K and V rows of the positions cached before this step (the new position's
      // row is written during it), at most PREFETCH_MAX_BYTES of each per unit; late q/k: the
      // norm weights and the position's RoPE row. Of the step's first row (its sequence); in
      // a kernel of slots, of the instruction's first unit, whichever row's (the rest follow
      // one unit ahead: attention_prefetch_next)
      const int pos = row_pos(st, 0);
#if ROTATE_ROWS
      UnitCursor first = {0, b, 0};
      attention_prefetch_next(P, st, first, 0, b - 1, 0, layer, b, e, w[A_ATTENTION_SPLITS],
                              w[A_ATTENTION_MIN_CHUNK], step_tokens(st), true);
#else
      constexpr int LINES = (D * 2 + 127) / 128;  // 128-byte lines per K or V row
      const int slot = row_slot(st, 0);
      const int splits = w[A_ATTENTION_SPLITS], n_pos = pos + 1;
      const int chunk = split_chunk(n_pos, splits, w[A_ATTENTION_MIN_CHUNK]);
      for (int u = b; u < e; ++u) {
        const int t0 = (u % splits) * chunk;
        const int t1 = min(min(n_pos - 1, t0 + chunk), t0 + PREFETCH_MAX_BYTES / (D * 2));
        const size_t kv0 = ((size_t)layer * MK_KV_ROWS * MK_KV_HEADS + u / splits) * D;
        for (int k = threadIdx.x; k < (t1 - t0) * 2 * LINES; k += MK_THREADS) {
          const int t = t0 + k / (2 * LINES), r = k % (2 * LINES);
          const unsigned short* row = (r < LINES ? P.k_cache : P.v_cache) + kv0 +
                                      (size_t)kv_row(P, slot, t) * MK_KV_DIM;
          prefetch_line(row + (r % LINES) * 64);
        }
      }
#endif
#if LATE_QK
      prefetch_l2(P.q_norm + (size_t)layer * D, D * 2);
      prefetch_l2(P.k_norm + (size_t)layer * D, D * 2);
      prefetch_l2(P.rope_cos + (size_t)pos * HALF, HALF * 4);
      prefetch_l2(P.rope_sin + (size_t)pos * HALF, HALF * 4);
#endif
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

// The next instruction's norm weights into L2 while this one runs, so that its register loads
// before its wait (rms_load_weights) hit L2 on every block, the last one too (whose wait
// returns at once: HBM's latency was on the step's path).
__device__ __forceinline__ void prefetch_norm(const Params& P, const int* w) {
  const int op = w[W_OP], lay = w[W_LAYER];
  if (op == OP_RMS_QKV_ROPE) prefetch_l2(P.in_norm + (size_t)lay * H, H * 2);
  else if (op == OP_RMS_GATE_UP) prefetch_l2(P.post_norm + (size_t)lay * H, H * 2);
  else if (op == OP_RMS_LM_HEAD) prefetch_l2(P.final_norm, H * 2);
}

// ================================================================================================
// The VM loop: run this block's instructions [begin, end). ONLY != OP_NOOP compiles a loop that
// knows a single op (the multi-kernel baseline's thin kernels).
// ================================================================================================
// Instruction words reach the loop through a ring of three shared-memory slots (OpShared::
// words), n counting the instructions this launch has run: slot n % 3 holds this instruction's
// words, (n + 1) % 3 the next one's (whose norm weights are prefetched now), and threads
// 0..WIDTH-1 load the words of the one after that before this one's wait and store them into
// slot (n + 2) % 3 at its end, before its last barrier (whose reader, instruction n - 1, read
// it before its own last barrier). So no program word is loaded between one instruction's end
// and the next one's first request: v5 loaded the opcode, branched on NOOP, then loaded the
// other words, two dependent trips on every instruction, mostly L2 misses (the program is
// re-read every step after the weights have streamed through L2). Every step runs the same
// queue, so the instructions after the last are the next step's first.
__device__ __forceinline__ int program_word(const Params& P, int len, int i, int k) {
  return __ldg(P.program + ((size_t)blockIdx.x * len + i) * MK_WIDTH + k);
}

// The slot `ahead` instructions after slot i of [begin, end), wrapping to the next step.
__device__ __forceinline__ int slot_ahead(int i, int ahead, int begin, int end) {
  return begin + (i - begin + ahead) % (end - begin);
}

// The launch's first two instructions' words into ring slots 0 and 1 (begin < end).
__device__ void fetch_first(const Params& P, OpShared& s, int len, int begin, int end) {
  if (threadIdx.x < MK_WIDTH) {
    s.words[0][threadIdx.x] = program_word(P, len, begin, threadIdx.x);
    s.words[1][threadIdx.x] = program_word(P, len, slot_ahead(begin, 1, begin, end), threadIdx.x);
  }
  __syncthreads();
}

// One step: false if the launch is being aborted (an error). n: instructions run so far in
// this launch (the word ring's position), advanced by every instruction.
template <int ONLY>
__device__ bool run_step(const Params& P, OpShared& s, const int* st, int begin, int end,
                         int& n) {
  // the program's length and the step are read from the state words (shared memory) where
  // used, not held in registers through every op (with them, and the program's address they
  // give, Qwen3's tensor-core megakernel spilled)
  for (int i = begin; i < end; ++i, ++n) {
    int w[MK_WIDTH];
#pragma unroll
    for (int k = 0; k < MK_WIDTH; ++k) w[k] = s.words[n % 3][k];
    // the words of the instruction after the next: in flight during this one
    const int later = threadIdx.x < MK_WIDTH
        ? program_word(P, st[S_PROGRAM_LEN], slot_ahead(i, 2, begin, end), threadIdx.x) : 0;
    int* later_slot = s.words[(n + 2) % 3];
    const int op = w[W_OP];
    if (op == OP_NOOP) {
      if (threadIdx.x < MK_WIDTH) later_slot[threadIdx.x] = later;
      __syncthreads();
      continue;
    }
#ifdef MK_TRACE
    unsigned long long* tr =
        P.trace + ((size_t)blockIdx.x * st[S_PROGRAM_LEN] + i) * MK_TRACE_WORDS;
    if (threadIdx.x == 0) {
      tr[T_START] = global_timer_ns();
      tr[T_START_CLK] = clock64();
      tr[T_SMID] = sm_id();
    }
#endif
#if MK_PREFETCH
    prefetch_weights(P, w, st);
    prefetch_norm(P, s.words[(n + 1) % 3]);
#endif
    // norm weights never depend on counters: in registers before the wait (from L2: the
    // previous instruction prefetched them)
    float g[RMS_PER];
    const int lay = w[W_LAYER];
    if (op == OP_RMS_QKV_ROPE) rms_load_weights(P.in_norm + (size_t)lay * H, g);
    else if (op == OP_RMS_GATE_UP) rms_load_weights(P.post_norm + (size_t)lay * H, g);
    else if (op == OP_RMS_LM_HEAD) rms_load_weights(P.final_norm, g);
    // the host's stop flag for the block that will end the step: its PCIe trip under the wait
    const int host_stop = op == OP_RMS_LM_HEAD && threadIdx.x == 0 ? lm_head_host_stop(P, w) : 0;
    if (w[W_WAIT_COUNTER] >= 0 &&  // (counters are monotonic across steps)
        !wait_counter(P, w[W_WAIT_COUNTER], w[W_WAIT_COUNT] * (st[S_STEP] + 1), i, op,
                      st[S_WATCHDOG_MS]))
      return false;
#ifdef MK_TRACE
    if (threadIdx.x == 0) {
      tr[T_READY] = global_timer_ns();
      tr[T_READY_CLK] = clock64();
    }
#endif
    if (ONLY != OP_NOOP && op != ONLY) {
      if (threadIdx.x == 0) record_error(P, ERR_BAD_OPCODE, i, op, -1, ONLY, op);
      return false;
    }
    switch (ONLY == OP_NOOP ? op : ONLY) {
      case OP_EMBED:
        if (!op_embed(P, s, w, st, i)) return false;
        break;
      case OP_RMS_QKV_ROPE: op_rms_qkv_rope(P, s, w, st, g); break;
#if SEG_ATTN
      case OP_ATTENTION: op_attention_segments(P, w, st); break;
#else
      case OP_ATTENTION: op_attention(P, s, w, st); break;
#endif
      case OP_O_PROJ_RESIDUAL: op_o_proj_residual(P, s, w, st, i); break;
      case OP_RMS_GATE_UP: op_rms_gate_up(P, s, w, st, g); break;
      case OP_DOWN_RESIDUAL: op_down_residual(P, s, w, st, i); break;
      case OP_RMS_LM_HEAD: op_rms_lm_head(P, s, w, st, g, host_stop); break;
      default:
        if (threadIdx.x == 0) record_error(P, ERR_BAD_OPCODE, i, op, -1, -1, op);
        return false;
    }
    if (threadIdx.x < MK_WIDTH) later_slot[threadIdx.x] = later;
    if (w[W_SIGNAL_COUNTER] >= 0) signal_counter(P, w[W_SIGNAL_COUNTER]);
    else __syncthreads();  // shared memory is reused by the next instruction
#ifdef MK_TRACE
    if (threadIdx.x == 0) {
      tr[T_END] = global_timer_ns();
      tr[T_END_CLK] = clock64();
    }
#endif
  }
  return true;
}

// The state words into shared memory; STEPS becomes the steps left in this launch. A kernel of
// many sequences (MK_SLOTS) copies the step's token table after them (step_row), all of it:
// the host writes it before the launch.
#define ST_WORDS (MK_STATE_WORDS + (MK_SLOTS ? MK_T_MAX * MK_ROW_WORDS : 0))
__device__ __forceinline__ void load_state(const Params& P, int* st, int steps_left) {
  if (threadIdx.x < MK_STATE_WORDS) st[threadIdx.x] = P.state[threadIdx.x];
  if (threadIdx.x == S_STEPS) st[S_STEPS] = steps_left;
#if MK_SLOTS
  for (int i = threadIdx.x; i < MK_T_MAX * MK_ROW_WORDS; i += MK_THREADS)
    st[MK_STATE_WORDS + i] = P.rows[i];
#endif
  __syncthreads();
}

// The VM loop: run this block's instructions [begin, end) for each step of the launch. The
// megakernel runs up to STEPS steps: between two, every block waits for the step counter (the
// previous step's end, which comes after every block's last instruction of that step, so no
// buffer of the next step is written while one of this step is still read), reloads the state
// the step's last block wrote, and stops where it says so. ONLY != OP_NOOP compiles a loop that
// knows a single op (the multi-kernel baseline's thin kernels), one step per launch.
template <int ONLY>
__device__ void run_instructions(const Params& P, int begin, int end) {
  __shared__ OpShared s;
  __shared__ int st[ST_WORDS];
  const int steps = ONLY == OP_NOOP ? max(P.state[S_STEPS], 1) : 1;
  load_state(P, st, steps);
  if (end <= begin) return;
  fetch_first(P, s, st[S_PROGRAM_LEN], begin, end);
  int n = 0;  // instructions run (the word ring's position)
  for (;;) {
    // the steps left are read from the state words (shared memory), not held in a register
    // through every op (Qwen3's tensor-core megakernel spilled it)
    if (!run_step<ONLY>(P, s, st, begin, end, n) || st[S_STEPS] <= 1) return;
    const int left = st[S_STEPS] - 1;  // read before wait_counter's barrier, load_state's write
    if (!wait_counter(P, st[S_STEP_COUNTER], st[S_STEP] + 1, st[S_PROGRAM_LEN], OP_NOOP,
                      st[S_WATCHDOG_MS]))
      return;
    load_state(P, st, left);
    if (!st[S_RUN]) return;
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

// Programmatic dependent launch (PDL) for the thin kernels below: -DMK_PDL=1, built only for
// the cuda-multi-graph-pdl backend, which launches every op with the programmatic stream
// serialization attribute. A kernel first lets its successor launch (launch_dependents: the
// next op's blocks may be placed on SMs while this op still runs, where resources allow; it
// orders no memory), then issues what does not depend on the previous launch (the L2
// prefetch of its weight rows and norm weights), and only then waits for the previous launch
// to complete with its writes visible (griddepcontrol.wait). Every block waits, work or not:
// a kernel that could finish before its predecessor would break the chain for the kernel
// after it. The counter waits inside run_instructions stay and then succeed at once. Reading
// the program length from the state words before the wait is safe: only the host writes
// S_PROGRAM_LEN. Without MK_PDL, below sm_90 and in the CPU emulator this is an empty
// function: those builds are unchanged.
#ifndef MK_PDL
#define MK_PDL 0
#endif
template <int ONLY>
__device__ __forceinline__ void pdl_prologue(const Params& P) {
#if MK_PDL && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int len = P.state[S_PROGRAM_LEN];
  for (int i = P.begin; i < P.end; ++i) {
    const int* ins = P.program + ((size_t)blockIdx.x * len + i) * MK_WIDTH;
    int w[MK_WIDTH];
#pragma unroll
    for (int k = 0; k < MK_WIDTH; ++k) w[k] = __ldg(ins + k);
    if (w[W_OP] != ONLY) continue;  // NOOP padding; a wrong opcode is reported after the wait
    w[W_OP] = ONLY;  // a constant: only this op's case of prefetch_weights is compiled
#if MK_PREFETCH
    // ATTENTION's prefetch follows the position, which the previous kernel writes: not before
    // griddepcontrol.wait
    if (ONLY != OP_ATTENTION) prefetch_weights(P, w, nullptr);
#endif
    prefetch_norm(P, w);
  }
  asm volatile("griddepcontrol.wait;" ::: "memory");
#else
  (void)P;
#endif
}

// The multi-kernel baseline: one thin kernel per op; the host launches instruction slots
// [P.begin, P.end) of one op at a time, in order.
#define MK_OP_ENTRY(NAME)                                                    \
  extern "C" __global__ void __launch_bounds__(MK_THREADS, 1)                \
  op_##NAME(const Params P) {                                                \
    pdl_prologue<OP_##NAME>(P);                                              \
    run_instructions<OP_##NAME>(P, P.begin, P.end);                          \
  }
MK_OP_ENTRY(EMBED)
MK_OP_ENTRY(RMS_QKV_ROPE)
MK_OP_ENTRY(ATTENTION)
MK_OP_ENTRY(O_PROJ_RESIDUAL)
MK_OP_ENTRY(RMS_GATE_UP)
MK_OP_ENTRY(DOWN_RESIDUAL)
MK_OP_ENTRY(RMS_LM_HEAD)
