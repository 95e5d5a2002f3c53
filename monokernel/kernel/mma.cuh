// mma.cuh: tensor-core helpers for the mat-muls of T-token steps (weights x tokens).
//
// Small __device__ helpers around inline PTX (sm_80 and newer), each with a CPU twin in the
// emulator (kernel/emulator/cuda_cpu_mma.h) behind `#ifndef __CUDA_ARCH__`:
//   mma_m16n8k16_bf16   D = A B + C, A 16x16 bf16 (row), B 16x8 bf16 (col), C and D fp32
//   ldmatrix_x4/_x2     four / two 8x8 bf16 matrices from shared memory into fragments (_at: at
//                       a smem_addr, so constant offsets fold into the instruction)
//   ldmatrix_a / _b     the lane's row address for an A (16x16) / B (8 tokens x 16) tile; _bt:
//                       a B tile stored k-major (16 k rows of 8 n), by ldmatrix .trans
//   cp_async_16         16 bytes global -> shared without registers (cp.async.cg), cp_async_wait;
//                       cp_async_commit / cp_async_wait_group<N>: a thread's copies in groups
//   load_a_global / load_b_global   the same fragments straight from global memory, zero padded
//   mma_d_row / mma_d_col           where element i of a lane's D fragment sits
// The twins can share a bug with this file's reading of the ISA; only a GPU run proves the PTX
// path (docs/tensor-cores.md says what to run).
//
// Orientation: Y^T [N_out, T] = W [N_out, K] . X^T [K, T], i.e. A = W and B = X^T.
//   - At T = 1..128 tokens the weight rows fill mma's M = 16 side and the tokens its N = 8 side:
//     a T = 1 step wastes 7/8 of each mma instead of 15/16 (tokens on M), and every weight byte
//     is loaded once per 8 tokens, not once per 16.
//   - Both operands are K-contiguous in memory: W [N_out, K] row-major is mma's row-major A, and
//     X [T, K] row-major is mma's column-major ("col") B (column n = token n, its K values
//     contiguous). So no operand needs ldmatrix .trans, and a B register (two consecutive k of one
//     token) is one aligned 32-bit load of X.
//   - D's fragment holds Y^T: element i of lane l is Y[token 2t + (i & 1)][row g + 8 (i >> 1)]
//     (mma_d_row / mma_d_col), stored transposed into Y [T, N_out].
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type", .bf16),
// with g = lane >> 2 (groupID) and t = lane & 3 (threadID_in_group); a 32-bit register holds two
// bf16, the lower column (or k) in its low 16 bits:
//   a[r] = A[g + 8 (r & 1)][2t + 8 (r >> 1) + {0, 1}]     r = 0..3
//   b[r] = B[2t + 8r + {0, 1}][g]                           r = 0..1   (B[k][n] = X[n][k])
//   c[i] = C[g + 8 (i >> 1)][2t + (i & 1)]                  i = 0..3   (D alike)
//
// Where each path pays:
//   - A (weights, streamed once per step, the bytes that bound a decode step): stage a
//     [16 x k-chunk] tile in shared memory with wide coalesced copies (16 bytes per lane; cp.async
//     on the GPU) and read fragments with ldmatrix.x4: one instruction per 16x16 tile instead of
//     four 32-bit loads that each touch 8 rows. load_a_global is for short K or a tile used once
//     where a shared-memory round trip (and its __syncthreads) costs more than it saves.
//   - B (activations X, a few KB, read by every warp, L1/L2-resident): load_b_global, straight
//     from global memory (32-bit loads, no staging, no barrier). ldmatrix_b is for when X is
//     already staged in shared memory (e.g. by the op before, or reused across many N tiles).
//   Weights go through the read-only path (__ldg: constant during a launch); activations do not,
//   since an earlier op of the same launch wrote them.
//
// All helpers are warp-collective in the sense of the PTX: every lane of the warp calls them
// together (the `.sync.aligned` instructions; the loaders only because their results feed one).
// The lane is threadIdx.x & 31 (one-dimensional blocks, as the megakernel's).
#pragma once

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "mma.cuh: mma.sync m16n8k16 with bf16 needs sm_80 or newer"
#endif

// D = A B + C (row.col, fp32 accumulate). d may alias c.
__device__ __forceinline__ void mma_m16n8k16_bf16(float d[4], const unsigned a[4], const unsigned b[2],
                                                  const float c[4]) {
#ifdef __CUDA_ARCH__
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%10, %11, %12, %13};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
        "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
#elif defined(__CUDACC__)  // nvcc's host pass parses device bodies but never runs them
  for (int i = 0; i < 4; ++i) d[i] = c[i];
#else
  emu::mma_m16n8k16_bf16(d, a, b, c);
#endif
}

// A shared-memory address as ldmatrix takes it: the 32-bit shared-window offset on the GPU (the
// emulator's: the pointer). Computing it once for a tile and adding byte offsets to it lets
// ptxas fold constant offsets into the instruction (LDSM [R + imm]) instead of keeping an
// address register for every ldmatrix of an unrolled loop.
#ifdef __CUDA_ARCH__
typedef unsigned smem_addr_t;
__device__ __forceinline__ smem_addr_t smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
#else
typedef unsigned long long smem_addr_t;
__device__ __forceinline__ smem_addr_t smem_addr(const void* p) {
  return reinterpret_cast<smem_addr_t>(p);
}
#endif

// Four 8x8 bf16 matrices from shared memory (at smem_addr): lanes 8i..8i+7 pass the addresses
// of matrix i's rows (16 bytes each, 16-byte aligned); lane l gets r[i] = matrix i's row l >> 2,
// elements 2 (l & 3) and 2 (l & 3) + 1.
__device__ __forceinline__ void ldmatrix_x4_at(unsigned r[4], smem_addr_t addr) {
#ifdef __CUDA_ARCH__
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
#elif defined(__CUDACC__)
  (void)addr;
  for (int i = 0; i < 4; ++i) r[i] = 0u;
#else
  unsigned out[4];
  emu::ldmatrix<4>(out, reinterpret_cast<const void*>(addr));
  for (int i = 0; i < 4; ++i) r[i] = out[i];
#endif
}

// Two 8x8 bf16 matrices: lanes 0..15 pass row addresses (lanes 16..31's are ignored). Trans
// (.trans): of the transposed matrices, lane l gets r[i] = matrix i's rows 2t and 2t + 1,
// element g of each (g = l >> 2, t = l & 3).
template <bool Trans = false>
__device__ __forceinline__ void ldmatrix_x2_at(unsigned r[2], smem_addr_t addr) {
#ifdef __CUDA_ARCH__
  if (Trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(addr)
                 : "memory");
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(addr)
                 : "memory");
#elif defined(__CUDACC__)
  (void)addr;
  r[0] = r[1] = 0u;
#else
  unsigned out[2];
  emu::ldmatrix<2, Trans>(out, reinterpret_cast<const void*>(addr));
  r[0] = out[0];
  r[1] = out[1];
#endif
}

__device__ __forceinline__ void ldmatrix_x4(unsigned r[4], const void* smem_row) {
  ldmatrix_x4_at(r, smem_addr(smem_row));
}
__device__ __forceinline__ void ldmatrix_x2(unsigned r[2], const void* smem_row) {
  ldmatrix_x2_at(r, smem_addr(smem_row));
}

// 16 bytes from global memory into shared memory without passing through registers
// (cp.async.cg: cached in L2 only, so a line another SM wrote before the reader's acquire is
// read from L2, as a plain load after the acquire would be); both addresses 16-byte aligned.
// The copy lands by this thread's cp_async_wait(); a barrier after it shows it to the block.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
#ifdef __CUDA_ARCH__
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(addr), "l"(gmem) : "memory");
#elif defined(__CUDACC__)
  (void)smem;
  (void)gmem;
#else
  emu::cp_async_16(smem, gmem);
#endif
}

// Every cp_async_16 of this thread has landed.
__device__ __forceinline__ void cp_async_wait() {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.wait_all;" ::: "memory");
#elif !defined(__CUDACC__)
  emu::cp_async_wait_all();
#endif
}

// This thread's cp_async_16 copies since its last commit are a group (a ring's round).
__device__ __forceinline__ void cp_async_commit() {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.commit_group;" ::: "memory");
#elif !defined(__CUDACC__)
  emu::cp_async_commit();
#endif
}

// Every group this thread committed but its newest N has landed (copies in no group need not).
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#elif !defined(__CUDACC__)
  emu::cp_async_wait_group(N);
#endif
}

// A fragment of a 16x16 tile at shared-memory address `tile` (row-major bf16, `ld` elements
// per row, ld a multiple of 8 so rows stay 16-byte aligned): matrices (rows 0-7, k 0-7), (rows
// 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15) are a[0..3].
__device__ __forceinline__ void ldmatrix_a_at(unsigned a[4], smem_addr_t tile, int ld) {
  const int lane = threadIdx.x & 31;
  ldmatrix_x4_at(a, tile + 2u * ((lane & 15) * ld + (lane >> 4) * 8));
}

// B fragment of an 8-token x 16-k tile at shared-memory address `tile` (X's rows, bf16, `ld` a
// multiple of 8): matrices (tokens 0-7, k 0-7) and (tokens 0-7, k 8-15) are b[0] and b[1].
__device__ __forceinline__ void ldmatrix_b_at(unsigned b[2], smem_addr_t tile, int ld) {
  const int lane = threadIdx.x & 31;
  ldmatrix_x2_at(b, tile + 2u * ((lane & 7) * ld + ((lane >> 3) & 1) * 8));
}

// B fragment of a 16-k x 8-n tile stored k-major at shared-memory address `tile` (row k holds
// its 8 n values; bf16, `ld` a multiple of 8), e.g. V's rows [position][d] for probabilities x
// V: lanes 0-7 pass rows k 0-7, lanes 8-15 rows k 8-15, and .trans hands lane (g, t) B[2t..2t +
// 1][g] (b[0]) and B[8 + 2t..][g] (b[1]), the "col" layout mma takes.
__device__ __forceinline__ void ldmatrix_bt_at(unsigned b[2], smem_addr_t tile, int ld) {
  const int lane = threadIdx.x & 31;
  ldmatrix_x2_at<true>(b, tile + 2u * ((lane & 15) * ld));
}

// ldmatrix_a_at / ldmatrix_b_at of a tile given by its pointer.
__device__ __forceinline__ void ldmatrix_a(unsigned a[4], const unsigned short* tile, int ld) {
  ldmatrix_a_at(a, smem_addr(tile), ld);
}
__device__ __forceinline__ void ldmatrix_b(unsigned b[2], const unsigned short* tile, int ld) {
  ldmatrix_b_at(b, smem_addr(tile), ld);
}

// Two consecutive bf16 m[r][c], m[r][c + 1] of a row-major [rows, cols] matrix (ld elements per
// row) as one register, zero outside the matrix. c is even; one 32-bit load when the pair is
// inside and 4-byte aligned (ld even; m itself must be 4-byte aligned, as every buffer is), else
// two 16-bit loads. `Ldg`: through the read-only path.
template <bool Ldg>
__device__ __forceinline__ unsigned bf16_pair(const unsigned short* m, int ld, int rows, int cols, int r, int c) {
  if (r >= rows || c >= cols) return 0u;
  const unsigned short* p = m + static_cast<size_t>(r) * ld + c;
  if (c + 1 < cols && (ld & 1) == 0) {
    const unsigned* w = reinterpret_cast<const unsigned*>(p);
    return Ldg ? __ldg(w) : *w;
  }
  const unsigned lo = Ldg ? __ldg(p) : p[0];
  const unsigned hi = c + 1 < cols ? (Ldg ? __ldg(p + 1) : p[1]) : 0u;
  return lo | hi << 16;
}

// A fragment of rows [row0, row0 + 16) x k [k0, k0 + 16) of W [rows, cols] (row-major bf16,
// weights: read-only path), zero padded past the edges.
__device__ __forceinline__ void load_a_global(unsigned a[4], const unsigned short* w, int ld, int rows, int cols,
                                              int row0, int k0) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int r = 0; r < 4; ++r)
    a[r] = bf16_pair<true>(w, ld, rows, cols, row0 + g + 8 * (r & 1), k0 + 2 * t + 8 * (r >> 1));
}

// B fragment of tokens [tok0, tok0 + 8) x k [k0, k0 + 16) of X [tokens, cols] (row-major bf16,
// activations: coherent loads), zero padded past the edges.
__device__ __forceinline__ void load_b_global(unsigned b[2], const unsigned short* x, int ld, int tokens, int cols,
                                              int tok0, int k0) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int r = 0; r < 2; ++r) b[r] = bf16_pair<false>(x, ld, tokens, cols, tok0 + g, k0 + 2 * t + 8 * r);
}

// Element i (0..3) of this lane's C/D fragment is D[mma_d_row(i)][mma_d_col(i)]: with A = W and
// B = X^T, the output row (of W) and the token.
__device__ __forceinline__ int mma_d_row(int i) { return ((threadIdx.x & 31) >> 2) + 8 * (i >> 1); }
__device__ __forceinline__ int mma_d_col(int i) { return 2 * (threadIdx.x & 3) + (i & 1); }
