// cuda_cpu_mma.h: warp-level CPU twins of the tensor-core instructions that kernel/mma.cuh wraps
// in inline PTX, for both runtimes of cuda_cpu.h (included at its end):
//   mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32   -> emu::mma_m16n8k16_bf16
//   ldmatrix.sync.aligned.m8n8.x{2,4}.shared.b16          -> emu::ldmatrix<N>
//   ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16        -> emu::ldmatrix<2, true>
// Each lane deposits its fragment (or its ldmatrix row) in the warp's exchange buffer
// (warp_exchange, a wide collective: all 32 lanes, so a missing or divergent lane is the
// runtime's usual warp error naming the instruction); the last lane to arrive computes the whole
// warp's result and every lane takes its own fragment back.
//
// Fragment layouts are the PTX ISA's ("Matrix Fragments for mma.m16n8k16 with floating point
// type", .bf16; "Warp-level matrix load instruction: ldmatrix"), with lane = 4 * g + t
// (g = groupID = lane >> 2, t = threadID_in_group = lane & 3); a 32-bit register holds two bf16,
// the lower column (or k) in its low half:
//   A (16 x 16, row-major):  a[r] = A[g + 8 * (r & 1)][2t + 8 * (r >> 1) + {0, 1}]
//   B (16 x 8, "col"):       b[r] = B[2t + 8r + {0, 1}][g]
//   C, D (16 x 8, fp32):     c[i] = C[g + 8 * (i >> 1)][2t + (i & 1)]
//   ldmatrix: lanes 8i..8i+7 give the row addresses of 8x8 matrix i (16 bytes each); lane l
//   receives r[i] = matrix i's row g, elements 2t and 2t + 1; with .trans, of its transpose:
//   rows 2t and 2t + 1, element g of each.
// tests/kernel/test_mma.py pins every (lane, register, half) of these against its own NumPy copy
// of the ISA's tables; EMU_MMA_MUTANT_SWAP_A12 (a fault for that test's negative control only)
// swaps a[1] and a[2].
#pragma once

namespace emu {
namespace detail {

inline float bf16_bits_to_float(unsigned int bits16) { return std::bit_cast<float>(bits16 << 16); }

struct MmaLaneIn {
  unsigned int a[4], b[2];
  float c[4];
};
static_assert(sizeof(MmaLaneIn) <= Warp::kLaneInBytes, "an mma lane's fragments fit the exchange");

// D = A B + C for the whole warp. Accumulation order (fixed, so runs are reproducible): for each
// element, start from C and add the 16 products k = 0..15 in turn, rounding each sum to fp32
// (nearest even); a product of two bf16 is exact in fp32. The hardware's order and rounding
// inside one k16 step are not specified by the ISA (and differ between architectures), so a GPU
// result matches this one only within fp32 accumulation error: tests compare with a tolerance.
inline void mma_m16n8k16_bf16_warp(Warp& w) {
  float A[16][16], B[16][8], D[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    MmaLaneIn in;
    std::memcpy(&in, w.wide_in[lane], sizeof in);
#ifdef EMU_MMA_MUTANT_SWAP_A12
    std::swap(in.a[1], in.a[2]);
#endif
    const int g = lane >> 2, t = lane & 3;
    for (int r = 0; r < 4; ++r) {
      float* row = &A[g + 8 * (r & 1)][2 * t + 8 * (r >> 1)];
      row[0] = bf16_bits_to_float(in.a[r] & 0xffffu);
      row[1] = bf16_bits_to_float(in.a[r] >> 16);
    }
    for (int r = 0; r < 2; ++r) {
      B[2 * t + 8 * r][g] = bf16_bits_to_float(in.b[r] & 0xffffu);
      B[2 * t + 8 * r + 1][g] = bf16_bits_to_float(in.b[r] >> 16);
    }
    for (int i = 0; i < 4; ++i) D[g + 8 * (i >> 1)][2 * t + (i & 1)] = in.c[i];
  }
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 8; ++n) {
      float acc = D[m][n];
      for (int k = 0; k < 16; ++k) acc += A[m][k] * B[k][n];
      D[m][n] = acc;
    }
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, t = lane & 3;
    float d[4];
    for (int i = 0; i < 4; ++i) d[i] = D[g + 8 * (i >> 1)][2 * t + (i & 1)];
    std::memcpy(w.wide_out[lane], d, sizeof d);
  }
}

// ldmatrix: lane 8i + j deposited row j of matrix i (8 bf16); hand each lane its pairs (Trans:
// of the transposed matrix, element g of rows 2t and 2t + 1).
template <int N, bool Trans>
inline void ldmatrix_warp(Warp& w) {
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, t = lane & 3;
    unsigned int r[N];
    for (int i = 0; i < N; ++i) {
      if (Trans) {
        unsigned short lo, hi;
        std::memcpy(&lo, &w.wide_in[8 * i + 2 * t][2 * g], 2);
        std::memcpy(&hi, &w.wide_in[8 * i + 2 * t + 1][2 * g], 2);
        r[i] = static_cast<unsigned int>(lo) | static_cast<unsigned int>(hi) << 16;
      } else {
        std::memcpy(&r[i], &w.wide_in[8 * i + g][4 * t], 4);
      }
    }
    std::memcpy(w.wide_out[lane], r, sizeof r);
  }
}

template <int N, bool Trans>
constexpr const char* ldmatrix_name() {
  return Trans ? (N == 4 ? "ldmatrix.x4.trans" : "ldmatrix.x2.trans")
               : (N == 4 ? "ldmatrix.x4" : "ldmatrix.x2");
}

}  // namespace detail

// The twin of mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {d}, {a}, {b}, {c}.
inline void mma_m16n8k16_bf16(float d[4], const unsigned int a[4], const unsigned int b[2], const float c[4]) {
  detail::MmaLaneIn in;
  std::memcpy(in.a, a, sizeof in.a);
  std::memcpy(in.b, b, sizeof in.b);
  std::memcpy(in.c, c, sizeof in.c);
  detail::warp_exchange("mma_m16n8k16_bf16", &in, sizeof in, d, 4 * sizeof(float), detail::mma_m16n8k16_bf16_warp);
}

// The twin of ldmatrix.sync.aligned.m8n8.x{N}.shared.b16 {r}, [row]. Each lane that supplies a
// row address (lanes 0 .. 8N-1; the others' are ignored, as on the GPU) reads its own 16-byte row
// before the exchange, so ThreadSanitizer and AddressSanitizer see that read as the lane's own:
// a row stored by another thread without a barrier is a data race, a row past a buffer's end an
// overflow.
template <int N, bool Trans = false>
inline void ldmatrix(unsigned int (&r)[N], const void* row) {
  static_assert(N == 2 || N == 4, "mma.cuh uses ldmatrix .x2 and .x4 (an .x1 twin would need its own test)");
  const unsigned int lane = threadIdx.x & 31u;
  alignas(16) unsigned char bytes[16] = {};
  if (lane < 8u * N) {
    if (reinterpret_cast<std::uintptr_t>(row) % 16 != 0)
      detail::fail_here(kTrap, detail::fmt("block %u thread %u: %s row address %p is not 16-byte aligned",
                                           blockIdx.x, threadIdx.x, detail::ldmatrix_name<N, Trans>(), row));
    std::memcpy(bytes, row, 16);
  }
  detail::warp_exchange(detail::ldmatrix_name<N, Trans>(), bytes, sizeof bytes, r, sizeof r,
                        detail::ldmatrix_warp<N, Trans>);
}

// The twin of cp.async.cg.shared.global [smem], [gmem], 16. On a GPU the copy lands some time
// before the issuing thread's cp.async.wait_all returns, not before: so here it reads its 16
// source bytes now, fills the destination with 0xff bytes (a NaN as bf16 and as fp32, so a read
// of it before the wait shows in the numbers), and lands by this thread's cp_async_wait_all.
// ThreadSanitizer and ASan see the source read and a destination write at the issue, and the
// destination written again at the landing: both ends of the copy's window.
inline void cp_async_16(void* smem, const void* gmem) {
  if (reinterpret_cast<std::uintptr_t>(smem) % 16 != 0 ||
      reinterpret_cast<std::uintptr_t>(gmem) % 16 != 0)
    detail::fail_here(kTrap,
                      detail::fmt("block %u thread %u: cp.async addresses %p <- %p are not "
                                  "16-byte aligned", blockIdx.x, threadIdx.x, smem, gmem));
  detail::AsyncCopy c{smem, {}};
  std::memcpy(c.bytes, gmem, 16);
  std::memset(smem, 0xff, 16);
  detail::async_copies().pending.push_back(c);
}

// The twin of cp.async.commit_group: this thread's copies since its last commit are a group.
inline void cp_async_commit() {
  detail::AsyncCopies& q = detail::async_copies();
  q.group_ends.push_back(q.pending.size());
}

// The twin of cp.async.wait_group n: every group this thread committed but its newest n lands,
// in issue order (the copies of no group stay pending, as the ISA says).
inline void cp_async_wait_group(int n) {
  detail::AsyncCopies& q = detail::async_copies();
  const std::size_t groups = q.group_ends.size();
  if (groups <= static_cast<std::size_t>(n)) return;
  const std::size_t landed = q.group_ends[groups - n - 1];
  for (std::size_t i = 0; i < landed; ++i) std::memcpy(q.pending[i].dst, q.pending[i].bytes, 16);
  q.pending.erase(q.pending.begin(), q.pending.begin() + static_cast<std::ptrdiff_t>(landed));
  q.group_ends.erase(q.group_ends.begin(), q.group_ends.end() - n);
  for (std::size_t& e : q.group_ends) e -= landed;
}

// The twin of cp.async.wait_all: every copy this thread issued lands, in issue order.
inline void cp_async_wait_all() {
  detail::AsyncCopies& q = detail::async_copies();
  for (const detail::AsyncCopy& c : q.pending) std::memcpy(c.dst, c.bytes, 16);
  q.clear();
}

}  // namespace emu
