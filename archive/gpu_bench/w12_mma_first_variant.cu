// The first variant of the 12-bit tensor-core kernel, kept as it ran on the H200 on 2026-12-02
// (gpu_bench/w12_mma_h200_2026-12-02_first.json: the 36-layer step at 1.11 / 1.06 / 0.91 / 0.34x the
// best bf16 path at M = 1 / 4 / 16 / 64, better at M = 16 than the packaged kernel,
// src/specpilot/kernels/w12_mma.cu). Not part of the package; a reference for rebuilding it.
//
// Differences from the packaged kernel: the warps of a block share one 16-row W tile and split its
// K slice among them (warp w takes chunks i0 + w, i0 + w + WARPS, ...), summed in order through
// shared memory; K slices over blocks are summed in order by the tile's last block to finish (a
// global fp32 workspace and an atomic ticket per tile, reset by that block). The fragment layout,
// the decode and the numerics are the packaged kernel's (same FragW12 arrays). The reduction order
// depends on (split, warps).
//
// How it ran: built with torch.utils.cpp_extension.load(name=..., sources=[this file],
// extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90", "-lineinfo"]) and called as
// ext.w12_mma(x, f.fm, f.fc, f.rowptr, f.col, f.val, y, ws, tickets, f.base, split, warps, unroll),
// ws a zeroed fp32 buffer of split * (N/16) * 8 * 4 * 32 floats, tickets a zeroed int32 buffer of
// N/16 (both cached per device), split in 1..16, warps in 1..8, unroll in 1..4 with
// split * warps * unroll <= K / 32.

#include <cuda_bf16.h>
#include <stdint.h>
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

#include "../src/specpilot/kernels/w12_frag.cuh"  // the device helpers it ran with

namespace {

using w12frag::dec_pair;
using w12frag::ld_stream16;
using w12frag::ld_stream8;
using w12frag::mma16816;

template <int NT, int WARPS, int U>
__global__ void __launch_bounds__(WARPS * 32) w12_mma_kernel(
    const __nv_bfloat16* __restrict__ x, int M, int ldx,
    const uint4* __restrict__ fm, const uint2* __restrict__ fc, int KI,
    const int* __restrict__ rowptr, const int* __restrict__ ecol, const __nv_bfloat16* __restrict__ eval,
    float scale, float v0, __nv_bfloat16* __restrict__ y, int N,
    float* __restrict__ ws, int* __restrict__ tickets, int split) {
  const int tile = blockIdx.x, s = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, tig = lane & 3;
  const int i0 = (int)(((long long)s * KI) / split), i1 = (int)(((long long)(s + 1) * KI) / split);

  float acc[NT][4];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;

  const uint4* xr[NT];
  bool xok[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int m = t * 8 + g;
    xok[t] = m < M;
    xr[t] = reinterpret_cast<const uint4*>(x + (long long)(xok[t] ? m : 0) * ldx) + tig;
  }
  const uint4* fmt = fm + (long long)tile * KI * 32 + lane;
  const uint2* fct = fc + (long long)tile * KI * 32 + lane;

  for (int ib = i0 + warp; ib < i1; ib += WARPS * U) {
    uint4 mw[U];
    uint2 cw[U];
    uint4 xv[U][NT];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = ib + u * WARPS;
      if (i < i1) {
        mw[u] = ld_stream16(fmt + (long long)i * 32);
        cw[u] = ld_stream8(fct + (long long)i * 32);
#pragma unroll
        for (int t = 0; t < NT; ++t) xv[u][t] = xok[t] ? __ldg(xr[t] + (long long)i * 4) : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = ib + u * WARPS;
      if (i < i1) {
        const uint32_t a0 = dec_pair<0x9180u, 7>(mw[u].x, cw[u].x);
        const uint32_t a1 = dec_pair<0xB3A2u, 3>(mw[u].x, cw[u].x);
        const uint32_t a2 = dec_pair<0x9180u, -1>(mw[u].y, cw[u].x);
        const uint32_t a3 = dec_pair<0xB3A2u, -5>(mw[u].y, cw[u].x);
#pragma unroll
        for (int t = 0; t < NT; ++t) mma16816(acc[t], a0, a1, a2, a3, xv[u][t].x, xv[u][t].y);
        const uint32_t b0 = dec_pair<0x9180u, 7>(mw[u].z, cw[u].y);
        const uint32_t b1 = dec_pair<0xB3A2u, 3>(mw[u].z, cw[u].y);
        const uint32_t b2 = dec_pair<0x9180u, -1>(mw[u].w, cw[u].y);
        const uint32_t b3 = dec_pair<0xB3A2u, -5>(mw[u].w, cw[u].y);
#pragma unroll
        for (int t = 0; t < NT; ++t) mma16816(acc[t], b0, b1, b2, b3, xv[u][t].z, xv[u][t].w);
      }
    }
  }

  if (WARPS > 1) {
    __shared__ float red[WARPS][NT * 4][32];
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int j = 0; j < 4; ++j) red[warp][t * 4 + j][lane] = acc[t][j];
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float v = red[0][t * 4 + j][lane];
#pragma unroll
        for (int w = 1; w < WARPS; ++w) v += red[w][t * 4 + j][lane];
        acc[t][j] = v;
      }
  }

  if (split > 1) {
    float* mine = ws + ((long long)s * gridDim.x + tile) * (NT * 4 * 32);
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int j = 0; j < 4; ++j) mine[(t * 4 + j) * 32 + lane] = acc[t][j];
    __threadfence();
    __syncwarp();
    int ticket = 0;
    if (lane == 0) ticket = atomicAdd(tickets + tile, 1);
    ticket = __shfl_sync(0xffffffffu, ticket, 0);
    if (ticket != split - 1) return;
    __threadfence();
    if (lane == 0) tickets[tile] = 0;
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float v = 0.f;
        for (int q = 0; q < split; ++q)
          v += __ldcg(ws + ((long long)q * gridDim.x + tile) * (NT * 4 * 32) + (t * 4 + j) * 32 + lane);
        acc[t][j] = v;
      }
  }

#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int m = t * 8 + 2 * tig + (j & 1);
      const int n = tile * 16 + g + (j >> 1) * 8;
      if (m >= M) continue;
      float v = acc[t][j] * scale;
      const int e1 = rowptr[n + 1];
      for (int e = rowptr[n]; e < e1; ++e) {
        const float xv = __bfloat162float(x[(long long)m * ldx + ecol[e]]);
        v += xv * __bfloat162float(eval[e]) - xv * v0;
      }
      y[(long long)m * N + n] = __float2bfloat16_rn(v);
    }
}

template <int NT, int WARPS>
void launch_u(int u, dim3 grid, cudaStream_t st, const __nv_bfloat16* x, int M, int ldx, const uint4* fm,
              const uint2* fc, int KI, const int* rowptr, const int* ecol, const __nv_bfloat16* eval,
              float scale, float v0, __nv_bfloat16* y, int N, float* ws, int* tickets, int split) {
  if (u == 1)
    w12_mma_kernel<NT, WARPS, 1><<<grid, WARPS * 32, 0, st>>>(x, M, ldx, fm, fc, KI, rowptr, ecol, eval, scale, v0,
                                                                 y, N, ws, tickets, split);
  else if (u == 2)
    w12_mma_kernel<NT, WARPS, 2><<<grid, WARPS * 32, 0, st>>>(x, M, ldx, fm, fc, KI, rowptr, ecol, eval, scale, v0,
                                                                 y, N, ws, tickets, split);
  else
    w12_mma_kernel<NT, WARPS, 4><<<grid, WARPS * 32, 0, st>>>(x, M, ldx, fm, fc, KI, rowptr, ecol, eval, scale, v0,
                                                                 y, N, ws, tickets, split);
}

template <int NT>
void launch_w(int warps, int u, dim3 grid, cudaStream_t st, const __nv_bfloat16* x, int M, int ldx,
              const uint4* fm, const uint2* fc, int KI, const int* rowptr, const int* ecol,
              const __nv_bfloat16* eval, float scale, float v0, __nv_bfloat16* y, int N, float* ws, int* tickets,
              int split) {
  switch (warps) {
    case 1: launch_u<NT, 1>(u, grid, st, x, M, ldx, fm, fc, KI, rowptr, ecol, eval, scale, v0, y, N, ws, tickets, split); break;
    case 2: launch_u<NT, 2>(u, grid, st, x, M, ldx, fm, fc, KI, rowptr, ecol, eval, scale, v0, y, N, ws, tickets, split); break;
    case 4: launch_u<NT, 4>(u, grid, st, x, M, ldx, fm, fc, KI, rowptr, ecol, eval, scale, v0, y, N, ws, tickets, split); break;
    default: launch_u<NT, 8>(u, grid, st, x, M, ldx, fm, fc, KI, rowptr, ecol, eval, scale, v0, y, N, ws, tickets, split); break;
  }
}

}  // namespace

void w12_mma(torch::Tensor x, torch::Tensor fm, torch::Tensor fc, torch::Tensor rowptr, torch::Tensor ecol,
             torch::Tensor eval, torch::Tensor y, torch::Tensor ws, torch::Tensor tickets, int64_t base,
             int64_t split, int64_t warps, int64_t unroll) {
  const int M = x.size(0), K = x.size(1), N = y.size(1);
  const int KI = K / 32, tiles = N / 16;
  TORCH_CHECK(M >= 1 && M <= 64, "w12_mma: M must be in 1..64, got ", M);
  const int NT = (M + 7) / 8;
  const float scale = ldexpf(1.f, (int)base - 112), v0 = ldexpf(1.f, (int)base - 127);
  dim3 grid(tiles, (unsigned)split);
  cudaStream_t st = at::cuda::getCurrentCUDAStream();
  auto xp = reinterpret_cast<const __nv_bfloat16*>(x.data_ptr());
  auto fmp = reinterpret_cast<const uint4*>(fm.data_ptr());
  auto fcp = reinterpret_cast<const uint2*>(fc.data_ptr());
  auto yp = reinterpret_cast<__nv_bfloat16*>(y.data_ptr());
  auto evp = reinterpret_cast<const __nv_bfloat16*>(eval.data_ptr());
  const int ldx = x.stride(0);
  const int w = (int)warps, u = (int)unroll, sp = (int)split;
#define W12_ARGS w, u, grid, st, xp, M, ldx, fmp, fcp, KI, rowptr.data_ptr<int>(), ecol.data_ptr<int>(), evp, scale, \
                 v0, yp, N, ws.data_ptr<float>(), tickets.data_ptr<int>(), sp
  if (NT <= 1) launch_w<1>(W12_ARGS);
  else if (NT <= 2) launch_w<2>(W12_ARGS);
  else if (NT <= 4) launch_w<4>(W12_ARGS);
  else launch_w<8>(W12_ARGS);
#undef W12_ARGS
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("w12_mma", &w12_mma, "y = x @ W.T, W in the fragment-ordered 12-bit format (tensor cores, M <= 64)");
}
