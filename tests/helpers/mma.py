"""The tensor-core tests' shared pieces (tests/kernel/test_mma.py, test_mma_sanitizers.py): the
test kernels (valid CUDA, including kernel/mma.cuh the way the megakernel will, through
kernel/includes.py), this file's own copy of the PTX ISA's fragment tables, the NumPy reference
and its tolerance, and runners that launch the same kernels on the emulator or, through CuPy, on
a GPU."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np

from monokernel.kernel.includes import inline_includes

KERNEL_DIR = Path(__file__).resolve().parents[2] / "monokernel" / "kernel"

KERNELS = r"""
// Test kernels for kernel/mma.cuh: the CPU emulator runs them, nvcc and NVRTC compile them.
#include "mma.cuh"

#ifndef MMA_TEST_ROW_SHIFT  // ASan negative control: warp w's X tile moves this many rows on
#define MMA_TEST_ROW_SHIFT 0
#endif

// ---- layout pinning: fragments in, D out, one case after another (one warp)
struct FragParams {
  const unsigned* a;  // (cases, 32, 4)
  const unsigned* b;  // (cases, 32, 2)
  const float* c;     // (cases, 32, 4)
  float* d;           // (cases, 32, 4)
  int cases;
};
extern "C" __global__ void mma_fragments(const FragParams p) {
  const int lane = threadIdx.x & 31;
  for (int s = 0; s < p.cases; ++s) {
    unsigned a[4], b[2];
    float c[4], d[4];
    for (int i = 0; i < 4; ++i) a[i] = p.a[(s * 32 + lane) * 4 + i];
    for (int i = 0; i < 2; ++i) b[i] = p.b[(s * 32 + lane) * 2 + i];
    for (int i = 0; i < 4; ++i) c[i] = p.c[(s * 32 + lane) * 4 + i];
    mma_m16n8k16_bf16(d, a, b, c);
    for (int i = 0; i < 4; ++i) p.d[(s * 32 + lane) * 4 + i] = d[i];
  }
}

// ---- ldmatrix: 32 distinct rows staged in shared memory; lane l passes row row_of_lane[l]
struct __align__(16) Rows32 {
  unsigned short v[32][8];
};
struct LdmParams {
  const unsigned short* src;  // (32, 8)
  const int* row_of_lane;     // (32,)
  unsigned* out4;             // (32, 4)
  unsigned* out2;             // (32, 2)
  unsigned* out2t;            // (32, 2): .x2.trans
};
extern "C" __global__ void ldmatrix_fragments(const LdmParams p) {
  __shared__ Rows32 rows;
  const int lane = threadIdx.x & 31;
  for (int i = lane; i < 32 * 8; i += 32) rows.v[i / 8][i % 8] = p.src[i];
  __syncwarp();
  unsigned r4[4], r2[2];
  ldmatrix_x4(r4, rows.v[p.row_of_lane[lane]]);
  ldmatrix_x2(r2, rows.v[p.row_of_lane[lane]]);
  unsigned r2t[2];
  ldmatrix_x2_at<true>(r2t, smem_addr(rows.v[p.row_of_lane[lane]]));
  for (int i = 0; i < 4; ++i) p.out4[lane * 4 + i] = r4[i];
  for (int i = 0; i < 2; ++i) p.out2[lane * 2 + i] = r2[i];
  for (int i = 0; i < 2; ++i) p.out2t[lane * 2 + i] = r2t[i];
}

// ---- cp.async: each thread copies 16-byte chunks of src (+ offset bytes) into shared memory,
// waits for its copies, then the block writes shared memory back out
struct CpParams {
  const unsigned char* src;  // (chunks * 16 + offset) bytes
  unsigned char* out;        // (chunks * 16)
  int chunks, offset;
};
extern "C" __global__ void cp_async_chunks(const CpParams p) {
  __shared__ uint4 tile[64];
  for (int i = threadIdx.x; i < p.chunks; i += blockDim.x)
    cp_async_16(&tile[i], p.src + p.offset + 16 * i);
  cp_async_wait();
  __syncthreads();
  for (int i = threadIdx.x; i < p.chunks; i += blockDim.x)
    *reinterpret_cast<uint4*>(p.out + 16 * i) = tile[(i + 1) % p.chunks];  // another thread's
}

// ---- a thread's own chunk read before its copy's wait (out: chunks x 16 bytes) and after it
// (out + chunks x 16): the emulator's twin lands a copy at the wait, not before
extern "C" __global__ void cp_async_before_wait(const CpParams p) {
  __shared__ uint4 tile[64];
  for (int i = threadIdx.x; i < p.chunks; i += blockDim.x)
    cp_async_16(&tile[i], p.src + p.offset + 16 * i);
  for (int i = threadIdx.x; i < p.chunks; i += blockDim.x)
    *reinterpret_cast<uint4*>(p.out + 16 * i) = tile[i];
  cp_async_wait();
  for (int i = threadIdx.x; i < p.chunks; i += blockDim.x)
    *reinterpret_cast<uint4*>(p.out + 16 * (p.chunks + i)) = tile[i];
}

// ---- a thread's chunks j * blockDim + t in four rounds, the first three committed as groups:
// read back after cp_async_wait_group<1> (out: chunks x 16 bytes) and after cp_async_wait
// (out + chunks x 16)
extern "C" __global__ void cp_async_groups(const CpParams p) {
  __shared__ uint4 tile[64];
  const int rounds = p.chunks / blockDim.x;
  for (int j = 0; j < rounds; ++j) {
    const int i = j * blockDim.x + threadIdx.x;
    cp_async_16(&tile[i], p.src + p.offset + 16 * i);
    if (j < 3) cp_async_commit();
  }
  cp_async_wait_group<1>();
  for (int j = 0; j < rounds; ++j) {
    const int i = j * blockDim.x + threadIdx.x;
    *reinterpret_cast<uint4*>(p.out + 16 * i) = tile[i];
  }
  cp_async_wait();
  for (int j = 0; j < rounds; ++j) {
    const int i = j * blockDim.x + threadIdx.x;
    *reinterpret_cast<uint4*>(p.out + 16 * (p.chunks + i)) = tile[i];
  }
}

// ---- Y [tokens, n_out] = X [tokens, k] W [n_out, k]^T, as mma.cuh's header describes: each
// block takes 16 rows of W, each of its WX_WARPS warps 8 tokens. W's k16 tile is staged once per
// block (shared by both warps), each warp's X tile by that warp.
constexpr int WX_WARPS = 2;
constexpr int LDS = 24;  // shared row stride in bf16: rows stay 16-byte aligned, banks rotate
struct __align__(16) WxSmem {
  unsigned short w[16 * LDS];
  unsigned short x[WX_WARPS][8 * LDS];
};
struct WxParams {
  const unsigned short* w;  // (n_out, k) bf16
  const unsigned short* x;  // (tokens, k) bf16
  float* y;                 // (tokens, n_out)
  int n_out, k, tokens;
  int mode;                 // bit 0: A by ldmatrix from shared memory (else global); bit 1: B
};

// Dynamic shared memory (sized exactly at launch), so AddressSanitizer sees its end.
__device__ __forceinline__ WxSmem& wx_smem() {
#ifdef __CUDA_ARCH__
  extern __shared__ uint4 wx_dyn[];
  return *reinterpret_cast<WxSmem*>(wx_dyn);
#else
  return *static_cast<WxSmem*>(emu::dynamic_shared(sizeof(WxSmem)));
#endif
}

extern "C" __global__ void mma_wx(const WxParams p) {
  WxSmem& s = wx_smem();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int t_groups = (p.tokens + 8 * WX_WARPS - 1) / (8 * WX_WARPS);
  const int n0 = (blockIdx.x / t_groups) * 16;
  const int t0 = ((blockIdx.x % t_groups) * WX_WARPS + warp) * 8;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int k0 = 0; k0 < p.k; k0 += 16) {
    if (p.mode & 1)
      for (int i = threadIdx.x; i < 16 * 16; i += blockDim.x) {
        const int r = i / 16, c = i % 16;
        s.w[r * LDS + c] = n0 + r < p.n_out && k0 + c < p.k ? p.w[(size_t)(n0 + r) * p.k + k0 + c] : 0;
      }
    if (p.mode & 2)
      for (int i = lane; i < 8 * 16; i += 32) {
        const int r = i / 16, c = i % 16;
        s.x[warp][r * LDS + c] = t0 + r < p.tokens && k0 + c < p.k ? p.x[(size_t)(t0 + r) * p.k + k0 + c] : 0;
      }
#ifndef MMA_TEST_NO_SYNC  // TSan negative control: the tiles are read before every store is seen
    __syncthreads();
#endif
    unsigned a[4], b[2];
    if (p.mode & 1) ldmatrix_a(a, s.w, LDS);
    else load_a_global(a, p.w, p.k, p.n_out, p.k, n0, k0);
    if (p.mode & 2) ldmatrix_b(b, s.x[warp] + MMA_TEST_ROW_SHIFT * LDS, LDS);
    else load_b_global(b, p.x, p.k, p.tokens, p.k, t0, k0);
    mma_m16n8k16_bf16(acc, a, b, acc);
    __syncthreads();  // the next k16 step restages the tiles
  }
  for (int i = 0; i < 4; ++i) {
    const int n = n0 + mma_d_row(i), t = t0 + mma_d_col(i);
    if (n < p.n_out && t < p.tokens) p.y[(size_t)t * p.n_out + n] = acc[i];
  }
}

// ---- lane 7 leaves before the mma: an error naming the mma, not a hang
extern "C" __global__ void mma_missing_lane(const FragParams p) {
  if ((threadIdx.x & 31) == 7) return;
  unsigned a[4] = {0, 0, 0, 0}, b[2] = {0, 0};
  float c[4] = {0.f, 0.f, 0.f, 0.f}, d[4];
  mma_m16n8k16_bf16(d, a, b, c);
  p.d[threadIdx.x] = d[0];
}
"""
KERNEL_NAMES = ["mma_fragments", "ldmatrix_fragments", "cp_async_chunks", "cp_async_before_wait",
                "cp_async_groups", "mma_wx", "mma_missing_lane"]
WX_THREADS = 64  # WX_WARPS warps
WX_SMEM_BYTES = (16 * 24 + 2 * 8 * 24) * 2


def kernel_source() -> str:
    return inline_includes(KERNELS, KERNEL_DIR, "test_mma.cu")


# ================================================================================================
# Reference: the PTX ISA's fragment tables ("Matrix Fragments for mma.m16n8k16 with floating
# point type", .bf16; ldmatrix), written out here independently of the C++ twin.
# ================================================================================================
def a_coord(lane: int, reg: int, half: int) -> tuple[int, int]:
    """(row, k) of A held in half `half` of a[reg] of `lane`."""
    g, t = lane >> 2, lane & 3
    return g + 8 * (reg & 1), 2 * t + 8 * (reg >> 1) + half


def b_coord(lane: int, reg: int, half: int) -> tuple[int, int]:
    """(k, n) of B held in half `half` of b[reg] of `lane`."""
    g, t = lane >> 2, lane & 3
    return 2 * t + 8 * reg + half, g


def cd_coord(lane: int, i: int) -> tuple[int, int]:
    """(row, n) of C and D held in c[i] / d[i] of `lane`."""
    g, t = lane >> 2, lane & 3
    return g + 8 * (i >> 1), 2 * t + (i & 1)


def bf16_bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, np.uint32) << 16).view(np.float32)


def to_regs(m: np.ndarray, coord, nregs: int) -> np.ndarray:
    """A 16x16 A or 16x8 B matrix (values exact in bf16) -> (32, nregs) uint32 registers."""
    bits = bf16_bits(m).astype(np.uint32)
    regs = np.zeros((32, nregs), np.uint32)
    for lane in range(32):
        for r in range(nregs):
            lo, hi = coord(lane, r, 0), coord(lane, r, 1)
            regs[lane, r] = bits[lo] | bits[hi] << 16
    return regs


def from_regs(regs: np.ndarray, coord, shape) -> np.ndarray:
    m = np.full(shape, np.nan, np.float64)
    for lane in range(32):
        for r in range(regs.shape[1]):
            for half in (0, 1):
                m[coord(lane, r, half)] = bits_to_f32((int(regs[lane, r]) >> (16 * half)) & 0xFFFF)
    return m


def cd_regs(m: np.ndarray) -> np.ndarray:
    return np.array([[m[cd_coord(lane, i)] for i in range(4)] for lane in range(32)], np.float32)


def mma_reference(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """D registers (32, 4) of one case, in float64 from the ISA's tables."""
    am, bm = from_regs(a, a_coord, (16, 16)), from_regs(b, b_coord, (16, 8))
    cm = np.zeros((16, 8))
    for lane in range(32):
        for i in range(4):
            cm[cd_coord(lane, i)] = c[lane, i]
    return cd_regs(am @ bm + cm)


def pinning_cases() -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """One case per (lane, register, half) of A, of B, and per (lane, element) of C: that one is
    1, the other operand holds distinct small integers (exact in bf16 and fp32), so D shows
    exactly which matrix element the twin took it for."""
    one = int(bf16_bits(1.0))
    b_ids = to_regs(1 + np.arange(16)[:, None] + 16 * np.arange(8)[None, :], b_coord, 2)  # 1..128
    a_ids = to_regs(1 + np.arange(16)[:, None] + 16 * np.arange(16)[None, :], a_coord, 4)  # 1..256
    a, b, c, names = [], [], [], []
    zero_a, zero_b, zero_c = np.zeros((32, 4), np.uint32), np.zeros((32, 2), np.uint32), np.zeros((32, 4), np.float32)
    for lane in range(32):
        for reg in range(4):
            for half in (0, 1):
                x = zero_a.copy()
                x[lane, reg] = one << (16 * half)
                a.append(x), b.append(b_ids), c.append(zero_c), names.append(f"A lane {lane} a[{reg}] half {half}")
    for lane in range(32):
        for reg in range(2):
            for half in (0, 1):
                x = zero_b.copy()
                x[lane, reg] = one << (16 * half)
                a.append(a_ids), b.append(x), c.append(zero_c), names.append(f"B lane {lane} b[{reg}] half {half}")
    for lane in range(32):
        for i in range(4):
            x = zero_c.copy()
            x[lane, i] = 1.0
            a.append(zero_a), b.append(zero_b), c.append(x), names.append(f"C lane {lane} c[{i}]")
    return np.array(a), np.array(b), np.array(c), names


# ================================================================================================
# Launch helpers: the same kernels and params on the emulator or, through CuPy, on a GPU
# ================================================================================================
# The kernels' by-value params structs (pointers are device addresses).
FRAG_PARAMS = np.dtype([("a", np.uint64), ("b", np.uint64), ("c", np.uint64), ("d", np.uint64),
                        ("cases", np.int32)], align=True)
LDM_PARAMS = np.dtype([("src", np.uint64), ("row_of_lane", np.uint64), ("out4", np.uint64),
                       ("out2", np.uint64), ("out2t", np.uint64)], align=True)
CP_PARAMS = np.dtype([("src", np.uint64), ("out", np.uint64), ("chunks", np.int32),
                      ("offset", np.int32)], align=True)
WX_PARAMS = np.dtype([("w", np.uint64), ("x", np.uint64), ("y", np.uint64), ("n_out", np.int32),
                      ("k", np.int32), ("tokens", np.int32), ("mode", np.int32)], align=True)


class EmulatorRunner:
    """Buffers are the NumPy arrays themselves; a launch blocks until the kernel is done."""

    name = "emulator"

    def __init__(self, module):
        self.module = module

    def buffer(self, host: np.ndarray):
        return np.ascontiguousarray(host).copy()

    def ptr(self, buf) -> int:
        return buf.ctypes.data

    def read(self, buf) -> np.ndarray:
        return buf.copy()

    def launch(self, name: str, grid: int, block: int, params: np.ndarray, smem_bytes: int = 0) -> None:
        self.module.launch(name, grid, block, params.ctypes.data, 60.0)


class CupyRunner:
    """The kernels compiled by NVRTC through CuPy (as CupyDevice.compile does) and launched on
    the current device with their params struct by value (as CupyDevice.launch does)."""

    name = "cuda"

    def __init__(self):
        import cupy as cp

        self.cp = cp
        self.module = cp.RawModule(code=kernel_source(), options=("-std=c++17", "--generate-line-info"))

    def buffer(self, host: np.ndarray):
        return self.cp.asarray(np.ascontiguousarray(host))

    def ptr(self, buf) -> int:
        return buf.data.ptr

    def read(self, buf) -> np.ndarray:
        return self.cp.asnumpy(buf)

    def launch(self, name: str, grid: int, block: int, params: np.ndarray, smem_bytes: int = 0) -> None:
        func = self.module.get_function(name).kernel.ptr
        kparams = np.array([params.ctypes.data], dtype=np.uintp)  # one pointer per kernel argument
        self.cp.cuda.driver.launchKernel(func, grid, 1, 1, block, 1, 1, smem_bytes, 0, kparams.ctypes.data, 0)
        self.cp.cuda.runtime.deviceSynchronize()


def struct(dtype: np.dtype, **fields) -> np.ndarray:
    p = np.zeros(1, dtype)
    for k, v in fields.items():
        p[k] = v
    return p


# The product's awkward sizes (n_out, k, tokens): K not a multiple of 16, N_out not of 16, T not of 8.
SIZES = [(17, 16, 1), (40, 48, 3), (100, 200, 8), (17, 200, 17), (40, 16, 17), (100, 48, 1)]


def wx_grid(n_out: int, tokens: int) -> int:
    return -(-n_out // 16) * -(-tokens // 16)


def wx_inputs(n_out: int, k: int, tokens: int, seed: int = 0):
    rng = np.random.default_rng(seed + 1000 * n_out + 10 * k + tokens)
    w = bf16_bits(rng.standard_normal((n_out, k)))
    x = bf16_bits(rng.standard_normal((tokens, k)))
    return w, x


def wx_reference(w: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Y = X W^T in float64 from the bf16 inputs, and the tolerance of an fp32 accumulation of K
    exact products: each of its K roundings costs at most 2^-24 of the running sum, bounded by
    sum_k |w x| (a K u bound, u = 2^-24), with a 2x margin for the GPU's unspecified order and
    rounding inside a k16 step."""
    wf, xf = bits_to_f32(w).astype(np.float64), bits_to_f32(x).astype(np.float64)
    k = w.shape[1]
    return xf @ wf.T, 2.0 * k * 2.0**-24 * (np.abs(xf) @ np.abs(wf).T)


def run_wx(runner, n_out: int, k: int, tokens: int, mode: int) -> np.ndarray:
    w, x = (runner.buffer(a) for a in wx_inputs(n_out, k, tokens))
    y = runner.buffer(np.full((tokens, n_out), np.nan, np.float32))  # poisoned: unwritten shows
    params = struct(WX_PARAMS, w=runner.ptr(w), x=runner.ptr(x), y=runner.ptr(y), n_out=n_out, k=k,
                    tokens=tokens, mode=mode)
    runner.launch("mma_wx", wx_grid(n_out, tokens), WX_THREADS, params, WX_SMEM_BYTES)
    return runner.read(y)


def layout_mismatches(runner) -> list[str]:
    a, b, c, names = pinning_cases()
    bufs = [runner.buffer(v) for v in (a, b, c, np.full(c.shape, np.nan, np.float32))]
    params = struct(FRAG_PARAMS, a=runner.ptr(bufs[0]), b=runner.ptr(bufs[1]), c=runner.ptr(bufs[2]),
                    d=runner.ptr(bufs[3]), cases=len(names))
    runner.launch("mma_fragments", 1, 32, params)
    d = runner.read(bufs[3])
    bad = []
    for s, name in enumerate(names):
        want = mma_reference(a[s], b[s], c[s])
        if not np.array_equal(d[s], want):
            lane, i = map(int, np.argwhere(d[s] != want)[0])
            bad.append(f"{name}: lane {lane} d[{i}] = {d[s][lane, i]}, want {want[lane, i]}")
    return bad


def run_cp_async(runner, chunks: int = 64, offset: int = 0, block: int = 32):
    """cp_async_chunks: (the source bytes past ``offset``, what came back), each output chunk
    the one after it in the source (read back by another thread after the barrier)."""
    src = np.random.default_rng(7).integers(0, 256, chunks * 16 + 16, dtype=np.uint8)
    bufs = [runner.buffer(v) for v in (src, np.zeros(chunks * 16, np.uint8))]
    params = struct(CP_PARAMS, src=runner.ptr(bufs[0]), out=runner.ptr(bufs[1]), chunks=chunks,
                    offset=offset)
    runner.launch("cp_async_chunks", 1, block, params)
    return src[offset:offset + chunks * 16], runner.read(bufs[1])


def run_ldmatrix(runner, block: int = 32):
    src = (np.arange(32 * 8, dtype=np.uint16) * 7 + 3).reshape(32, 8)
    row_of_lane = np.random.default_rng(5).permutation(32).astype(np.int32)
    bufs = [runner.buffer(v) for v in (src, row_of_lane, np.full((block, 4), 0xDEADBEEF, np.uint32),
                                         np.full((block, 2), 0xDEADBEEF, np.uint32),
                                         np.full((block, 2), 0xDEADBEEF, np.uint32))]
    params = struct(LDM_PARAMS, src=runner.ptr(bufs[0]), row_of_lane=runner.ptr(bufs[1]),
                    out4=runner.ptr(bufs[2]), out2=runner.ptr(bufs[3]), out2t=runner.ptr(bufs[4]))
    runner.launch("ldmatrix_fragments", 1, block, params)
    return src, row_of_lane, runner.read(bufs[2]), runner.read(bufs[3]), runner.read(bufs[4])
