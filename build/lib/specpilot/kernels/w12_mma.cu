// Tensor-core matmul y = x @ W.T with W in the lossless 12-bit format, fragment-ordered storage.
//
// Layout and algorithm: src/specpilot/kernels/w12_mma.py (module docstring). In short, for each
// 16-row tile of W and each 32-column chunk of K ("iteration"), lane l of a warp reads one 16-byte
// word of sign+mantissa bytes and one 8-byte word of exponent codes: exactly the 16 weights of its
// two m16n8k16 A fragments (two k-steps), decoded in registers (4 integer ops per bf16 pair: one
// byte permute with sign replication, one shift, two LOP3) and fed to mma.sync without any
// shared-memory reshuffle. x rows are read as 16-byte words straight into the B fragments (the
// k order inside a 32-chunk is permuted identically for W and x, so each lane's 8 x values are
// contiguous). The fp32 accumulator of the raw weights (exponent field 112 + code) is scaled by
// 2**(base - 112) once, then the escapes (code 0, decoded as 2**(base-127)) are corrected in fp32.
//
// Reduction order is fixed by split alone: a warp accumulates the chunks of its K slice in order
// (mma.sync, fp32); the K slices 0..split-1 (the blocks of one thread-block cluster) are summed in
// order by the cluster's block 0 through distributed shared memory. So a row of y does not depend on
// M, on the other rows, or on the launch shape (tiles per warp, warps per block, unroll).

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "w12_frag.cuh"

namespace cg = cooperative_groups;

// W12_PIPE 0 (default): each group of `unroll` chunks is loaded, then computed. 1: the loads of the
// next group are in flight (a second register buffer) during the math of this one; 2: cp.async
// copies through a ring of 2 x unroll chunk slots per warp in shared memory. On an H200 (2026-12-03,
// gpu_bench/w12_variants_h200_2026-12-03/) both 1 and 2 were slower than 0 at every M (36-layer step
// at M = 1 / 4 / 16: 0.948 / 0.900 / 0.635x and 0.944 / 0.894 / 0.697x bf16, against 1.078 / 1.030 /
// 0.818x for 0); they are kept, selectable at build time, as measured alternatives.
#ifndef W12_PIPE
#define W12_PIPE 0
#endif

namespace {

using w12frag::dec_pair;
using w12frag::ld_stream16;
using w12frag::ld_stream8;
using w12frag::mma16816;

// Escapes of one output (n, m): the first ESC_PRE of row n are fetched while the main loop streams
// W (two dependent loads: columns/values, then x at those columns), the rest (rare) at the end.
constexpr int ESC_PRE = 2;
constexpr int MAX_SPLIT = 8;  // K slices = blocks of one cluster (the portable cluster size)

// One k-step of a 16-row W tile: its A fragment decoded from two mantissa words and one code word,
// multiplied into every 8-row x tile (B fragment: words 2j, 2j+1 of the lane's 16-byte x chunk).
template <int NT>
__device__ __forceinline__ void kstep(float (&acc)[NT][4], uint32_t m0, uint32_t m1, uint32_t c,
                                      const uint4 (&xv)[NT], int j) {
  const uint32_t a0 = dec_pair<0x9180u, 7>(m0, c);
  const uint32_t a1 = dec_pair<0xB3A2u, 3>(m0, c);
  const uint32_t a2 = dec_pair<0x9180u, -1>(m1, c);
  const uint32_t a3 = dec_pair<0xB3A2u, -5>(m1, c);
#pragma unroll
  for (int t = 0; t < NT; ++t)
    mma16816(acc[t], a0, a1, a2, a3, j ? xv[t].z : xv[t].x, j ? xv[t].w : xv[t].y);
}

// The first ESC_PRE escapes (column, value) of each of a lane's W rows, -1 / 0 where there are fewer.
template <int TN>
__device__ __forceinline__ void fetch_escapes(const int (&e_lo)[TN][2], const int (&e_hi)[TN][2],
                                              const int* __restrict__ ecol, const __nv_bfloat16* __restrict__ eval,
                                              int (&e_col)[TN][2][ESC_PRE], float (&e_val)[TN][2][ESC_PRE]) {
#pragma unroll
  for (int a = 0; a < TN; ++a)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int q = 0; q < ESC_PRE; ++q) {
        const int e = e_lo[a][h] + q;
        const bool ok = e < e_hi[a][h];
        e_col[a][h][q] = ok ? __ldg(ecol + e) : -1;
        e_val[a][h][q] = ok ? __bfloat162float(eval[e]) : 0.f;
      }
}

// The loads of U chunks starting at chunk ib (those below i1): each live W tile's mantissa and code
// words, and each x tile's 16-byte B-fragment word.
template <int NT, int TN, int U>
__device__ __forceinline__ void load_group(int ib, int i1, const bool (&tok)[TN], const uint4* const (&fmt)[TN],
                                           const uint2* const (&fct)[TN], const bool (&xok)[NT],
                                           const uint4* const (&xr)[NT], uint4 (&mw)[U][TN], uint2 (&cw)[U][TN],
                                           uint4 (&xv)[U][NT]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int i = ib + u;
    if (i < i1) {
#pragma unroll
      for (int a = 0; a < TN; ++a) {
        if (tok[a]) {
          mw[u][a] = ld_stream16(fmt[a] + (long long)i * 32);
          cw[u][a] = ld_stream8(fct[a] + (long long)i * 32);
        }
      }
#pragma unroll
      for (int t = 0; t < NT; ++t) xv[u][t] = xok[t] ? __ldg(xr[t] + (long long)i * 4) : make_uint4(0, 0, 0, 0);
    }
  }
}

// The math of the U chunks loaded by load_group(ib, ...), in chunk order (the reduction order).
template <int NT, int TN, int U>
__device__ __forceinline__ void math_group(int ib, int i1, const bool (&tok)[TN], const uint4 (&mw)[U][TN],
                                           const uint2 (&cw)[U][TN], const uint4 (&xv)[U][NT],
                                           float (&acc)[TN][NT][4]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (ib + u < i1) {
#pragma unroll
      for (int a = 0; a < TN; ++a) {
        if (!tok[a]) continue;
        // k-step 0: mantissa words x (rows g / g+8, k 0-1) and y (k 2-3), codes word x, x words x, y;
        // k-step 1: mantissa words z, w, codes word y, x words z, w
        kstep<NT>(acc[a], mw[u][a].x, mw[u][a].y, cw[u][a].x, xv[u], 0);
        kstep<NT>(acc[a], mw[u][a].z, mw[u][a].w, cw[u][a].y, xv[u], 1);
      }
    }
  }
}

// NT: 8-row tiles of x (M <= 8 * NT); TN: 16-row tiles of W per warp (they share the warp's x
// fragments); WARPS: warps per block, each its own TN tiles over the same K slice (so they read the
// same x chunks close together); U: chunks whose loads a warp issues before their math.
// The K slices are the blocks of one thread-block cluster (gridDim.y = split = cluster size): each
// block leaves its fp32 partials in its shared memory, and block 0 of the cluster sums them in
// order 0..split-1 through distributed shared memory (no global workspace, fences or atomics).
template <int NT, int TN, int WARPS, int U>
__global__ void __launch_bounds__(WARPS * 32) w12_mma_kernel(
    const __nv_bfloat16* __restrict__ x, int M, int ldx,
    const uint4* __restrict__ fm, const uint2* __restrict__ fc, int KI, int tiles,
    const int* __restrict__ rowptr, const int* __restrict__ ecol, const __nv_bfloat16* __restrict__ eval,
    float scale, float v0, __nv_bfloat16* __restrict__ y, int N, int split) {
  constexpr int PER = TN * NT * 4;  // accumulators per lane
  __shared__ float part[WARPS][PER][32];
  const int s = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, tig = lane & 3;
  const int tile0 = (blockIdx.x * WARPS + warp) * TN;
  const bool live = tile0 < tiles;  // a dead warp still takes part in the cluster barriers
  const int i0 = (int)(((long long)s * KI) / split), i1 = (int)(((long long)(s + 1) * KI) / split);

  float acc[TN][NT][4];
#pragma unroll
  for (int a = 0; a < TN; ++a)
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[a][t][0] = acc[a][t][1] = acc[a][t][2] = acc[a][t][3] = 0.f;

  const uint4* xr[NT];
  bool xok[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int m = t * 8 + g;
    xok[t] = m < M;
    xr[t] = reinterpret_cast<const uint4*>(x + (long long)(xok[t] ? m : 0) * ldx) + tig;
  }
  bool tok[TN];
  const uint4* fmt[TN];
  const uint2* fct[TN];
#pragma unroll
  for (int a = 0; a < TN; ++a) {
    tok[a] = live && tile0 + a < tiles;
    const long long tt = tok[a] ? tile0 + a : 0;
    fmt[a] = fm + tt * KI * 32 + lane;
    fct[a] = fc + tt * KI * 32 + lane;
  }
  // escape prefetch state (only the cluster's block 0 writes y, so only it needs them)
  const bool fin = s == 0;
  int e_lo[TN][2], e_hi[TN][2];  // per W row (j >> 1): escape range
  int e_col[TN][2][ESC_PRE];
  float e_val[TN][2][ESC_PRE];
  if (fin) {
#pragma unroll
    for (int a = 0; a < TN; ++a)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int n = tok[a] ? (tile0 + a) * 16 + g + h * 8 : 0;
        e_lo[a][h] = tok[a] ? __ldg(rowptr + n) : 0;
        e_hi[a][h] = tok[a] ? __ldg(rowptr + n + 1) : 0;
      }
  }

#if W12_PIPE == 1
  // Software pipeline over groups of U chunks, two register buffers: the loads of group g + 1 are
  // issued before the math of group g, so a warp always has one group's bytes in flight.
  uint4 mwA[U][TN], mwB[U][TN];
  uint2 cwA[U][TN], cwB[U][TN];
  uint4 xvA[U][NT], xvB[U][NT];
  load_group<NT, TN, U>(i0, i1, tok, fmt, fct, xok, xr, mwA, cwA, xvA);
  bool first = true;
  for (int ib = i0; ib < i1; ib += 2 * U) {
    load_group<NT, TN, U>(ib + U, i1, tok, fmt, fct, xok, xr, mwB, cwB, xvB);
    if (fin && first) fetch_escapes<TN>(e_lo, e_hi, ecol, eval, e_col, e_val);
    first = false;
    math_group<NT, TN, U>(ib, i1, tok, mwA, cwA, xvA, acc);
    load_group<NT, TN, U>(ib + 2 * U, i1, tok, fmt, fct, xok, xr, mwA, cwA, xvA);
    math_group<NT, TN, U>(ib + U, i1, tok, mwB, cwB, xvB, acc);
  }
  if (fin && first) fetch_escapes<TN>(e_lo, e_hi, ecol, eval, e_col, e_val);
#elif W12_PIPE == 2
  // Asynchronous copies through shared memory: each lane copies its own W words and x word of
  // chunk i + R - 1 (cp.async, R = 2U chunk slots per warp) while it computes chunk i, so R - 1
  // chunks per lane are in flight with only one chunk's registers. A lane reads back only the bytes
  // it copied itself, so no barrier is needed (cp.async.wait_group orders them for that lane).
  constexpr int R = 2 * U;
  constexpr int SLOT = TN * 768 + NT * 512;  // bytes per chunk slot: mantissa, codes, x words
  extern __shared__ __align__(16) unsigned char w12_dsm[];
  unsigned char* ring = w12_dsm + (size_t)warp * R * SLOT;
  auto issue = [&](int i) {
    if (i < i1) {
      unsigned char* sl = ring + (i % R) * SLOT;
#pragma unroll
      for (int a = 0; a < TN; ++a) {
        if (tok[a]) {
          w12frag::cp_async16(sl + a * 512 + lane * 16, fmt[a] + (long long)i * 32);
          w12frag::cp_async8(sl + TN * 512 + a * 256 + lane * 8, fct[a] + (long long)i * 32);
        }
      }
#pragma unroll
      for (int t = 0; t < NT; ++t)
        w12frag::cp_async16_zfill(sl + TN * 768 + t * 512 + lane * 16, xr[t] + (long long)i * 4, xok[t] ? 16 : 0);
    }
    w12frag::cp_async_commit();  // one group per chunk, empty past the slice (uniform counting)
  };
#pragma unroll
  for (int d = 0; d < R - 1; ++d) issue(i0 + d);
  if (fin) fetch_escapes<TN>(e_lo, e_hi, ecol, eval, e_col, e_val);
  for (int i = i0; i < i1; ++i) {
    w12frag::cp_async_wait<R - 2>();  // chunk i's group is complete
    const unsigned char* sl = ring + (i % R) * SLOT;
    uint4 mw[1][TN];
    uint2 cw[1][TN];
    uint4 xv[1][NT];
#pragma unroll
    for (int a = 0; a < TN; ++a) {
      mw[0][a] = *reinterpret_cast<const uint4*>(sl + a * 512 + lane * 16);
      cw[0][a] = *reinterpret_cast<const uint2*>(sl + TN * 512 + a * 256 + lane * 8);
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) xv[0][t] = *reinterpret_cast<const uint4*>(sl + TN * 768 + t * 512 + lane * 16);
    issue(i + R - 1);  // into the slot of chunk i - 1, read back by this lane one iteration ago
    math_group<NT, TN, 1>(i, i1, tok, mw, cw, xv, acc);
  }
  w12frag::cp_async_wait<0>();
#else
  // loads of U chunks, then their math (the variant measured on 2026-12-02)
  bool first = true;
  for (int ib = i0; ib < i1; ib += U) {
    uint4 mw[U][TN];
    uint2 cw[U][TN];
    uint4 xv[U][NT];
    load_group<NT, TN, U>(ib, i1, tok, fmt, fct, xok, xr, mw, cw, xv);
    // the escape rows' ranges have arrived by now: fetch their columns and values
    if (fin && first) fetch_escapes<TN>(e_lo, e_hi, ecol, eval, e_col, e_val);
    first = false;
    math_group<NT, TN, U>(ib, i1, tok, mw, cw, xv, acc);
  }
  // an empty K slice (cannot happen with split * unroll <= K/32): fetch now
  if (fin && first) fetch_escapes<TN>(e_lo, e_hi, ecol, eval, e_col, e_val);
#endif

  // K slices of the cluster, summed in order 0..split-1 by block 0
  if (split > 1) {
    cg::cluster_group cluster = cg::this_cluster();
#pragma unroll
    for (int a = 0; a < TN; ++a)
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int j = 0; j < 4; ++j) part[warp][(a * NT + t) * 4 + j][lane] = acc[a][t][j];
    cluster.sync();
    if (fin) {  // every remote value requested before the first is added (no round trip per block)
      const float* rp[MAX_SPLIT];
#pragma unroll
      for (int q = 1; q < MAX_SPLIT; ++q) rp[q] = cluster.map_shared_rank(&part[warp][0][0], q < split ? q : 0);
#pragma unroll
      for (int a = 0; a < TN; ++a)
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int idx = ((a * NT + t) * 4 + j) * 32 + lane;
            float v[MAX_SPLIT];
#pragma unroll
            for (int q = 1; q < MAX_SPLIT; ++q) v[q] = q < split ? rp[q][idx] : 0.f;
#pragma unroll
            for (int q = 1; q < MAX_SPLIT; ++q)
              if (q < split) acc[a][t][j] += v[q];  // in order 1..split-1
          }
    }
    cluster.sync();  // the other blocks' shared memory stays alive until block 0 has read it
    if (!fin) return;
  }
  if (!live) return;

  // scale, escapes, bf16 out. c0,c1: W row g, x rows 2tig, 2tig+1; c2,c3: W row g+8.
#pragma unroll
  for (int a = 0; a < TN; ++a) {
    if (!tok[a]) continue;
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int m = t * 8 + 2 * tig + (j & 1);
        const int h = j >> 1;
        const int n = (tile0 + a) * 16 + g + h * 8;
        if (m >= M) continue;
        float v = acc[a][t][j] * scale;
        const __nv_bfloat16* xm = x + (long long)m * ldx;
#pragma unroll
        for (int q = 0; q < ESC_PRE; ++q) {
          if (e_col[a][h][q] >= 0) {
            const float xv = __bfloat162float(xm[e_col[a][h][q]]);
            v += xv * e_val[a][h][q] - xv * v0;
          }
        }
        for (int e = e_lo[a][h] + ESC_PRE; e < e_hi[a][h]; ++e) {
          const float xv = __bfloat162float(xm[ecol[e]]);
          v += xv * __bfloat162float(eval[e]) - xv * v0;
        }
        y[(long long)m * N + n] = __float2bfloat16_rn(v);
      }
  }
}

struct Args {
  const __nv_bfloat16* x; int M, ldx; const uint4* fm; const uint2* fc; int KI, tiles;
  const int* rowptr; const int* ecol; const __nv_bfloat16* eval; float scale, v0; __nv_bfloat16* y; int N;
  int split;
};

template <int NT, int TN, int WARPS, int U>
void launch(const Args& a, cudaStream_t st) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((a.tiles + WARPS * TN - 1) / (WARPS * TN), a.split, 1);
  cfg.blockDim = dim3(WARPS * 32, 1, 1);
#if W12_PIPE == 2
  const int smem = WARPS * 2 * U * (TN * 768 + NT * 512);
  static bool attr_set = false;  // once per instantiation (above 48 KB needs the opt-in)
  if (!attr_set) {
    cudaFuncSetAttribute(w12_mma_kernel<NT, TN, WARPS, U>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    attr_set = true;
  }
  cfg.dynamicSmemBytes = smem;
#else
  cfg.dynamicSmemBytes = 0;
#endif
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 1;
  attr[0].val.clusterDim.y = a.split;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  cudaLaunchKernelEx(&cfg, w12_mma_kernel<NT, TN, WARPS, U>, a.x, a.M, a.ldx, a.fm, a.fc, a.KI, a.tiles, a.rowptr,
                     a.ecol, a.eval, a.scale, a.v0, a.y, a.N, a.split);
}

template <int NT, int TN, int WARPS>
bool launch_u(int u, const Args& a, cudaStream_t st) {
  if (u == 2) { launch<NT, TN, WARPS, 2>(a, st); return true; }
  if (u == 4) { launch<NT, TN, WARPS, 4>(a, st); return true; }
  if constexpr (NT * TN <= 2) {
    if (u == 8) { launch<NT, TN, WARPS, 8>(a, st); return true; }
  }
  return false;
}

template <int NT, int TN>
bool launch_w(int warps, int u, const Args& a, cudaStream_t st) {
  if (warps == 2) return launch_u<NT, TN, 2>(u, a, st);
  if (warps == 4) return launch_u<NT, TN, 4>(u, a, st);
  return false;
}

template <int NT>
bool launch_t(int tn, int warps, int u, const Args& a, cudaStream_t st) {
  if (tn == 1) return launch_w<NT, 1>(warps, u, a, st);
  if (tn == 2) return launch_w<NT, 2>(warps, u, a, st);
  return false;
}

bool dispatch(int NT, int tn, int warps, int u, const Args& a, cudaStream_t st) {
  if (NT <= 1) return launch_t<1>(tn, warps, u, a, st);
  if (NT <= 2) return launch_t<2>(tn, warps, u, a, st);
  if (NT <= 4) return launch_t<4>(tn, warps, u, a, st);
  return launch_t<8>(tn, warps, u, a, st);
}

}  // namespace

// y[M, N] = x[M, K] @ W.T for M in 1..64 on `stream`. A plain C entry point (no PyTorch ABI), called
// through ctypes by w12_mma.py, which checks shapes, dtypes and devices first. Returns 0, or -1 when
// no kernel exists for the launch shape, or the CUDA error code of the launch.
extern "C" int w12_mma_launch(const void* x, int M, int ldx, const void* fm, const void* fc, int K, int N,
                              const int* rowptr, const int* ecol, const void* eval, int base, void* y, int split,
                              int tn, int warps, int unroll, void* stream) {
  if (M < 1 || M > 64 || split < 1 || split > 8) return -1;
  Args a{reinterpret_cast<const __nv_bfloat16*>(x), M, ldx, reinterpret_cast<const uint4*>(fm),
         reinterpret_cast<const uint2*>(fc), K / 32, N / 16, rowptr, ecol, reinterpret_cast<const __nv_bfloat16*>(eval),
         ldexpf(1.f, base - 112), ldexpf(1.f, base - 127), reinterpret_cast<__nv_bfloat16*>(y), N, split};
  if (!dispatch((M + 7) / 8, tn, warps, unroll, a, reinterpret_cast<cudaStream_t>(stream))) return -1;
  return (int)cudaGetLastError();
}
