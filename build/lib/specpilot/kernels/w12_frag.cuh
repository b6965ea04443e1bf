// Device helpers of the 12-bit tensor-core kernels (w12_mma.cu; gpu_bench/w12_mma_first_variant.cu):
// the fragment decode, the m16n8k16 MMA and the streaming loads. Layout: w12_mma.py's docstring.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

namespace w12frag {

template <uint32_t SEL>
__device__ __forceinline__ uint32_t prmt_sext(uint32_t a) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %1, %2;" : "=r"(d) : "r"(a), "n"(SEL));
  return d;
}

// One bf16x2 register from a mantissa word (its byte pair picked by SEL, sign replicated into the
// high byte of each lane) and a code word shifted so the pair's codes sit at bits 7..10 / 23..26.
template <uint32_t SEL, int SH>
__device__ __forceinline__ uint32_t dec_pair(uint32_t mw, uint32_t cw) {
  const uint32_t p = prmt_sext<SEL>(mw);
  const uint32_t c = SH >= 0 ? (cw << (SH >= 0 ? SH : 0)) : (cw >> (SH < 0 ? -SH : 0));
  return (p & 0x807F807Fu) | (c & 0x07800780u) | 0x38003800u;
}

__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint4 ld_stream16(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ uint2 ld_stream8(const uint2* p) {
  uint2 v;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

// Asynchronous global -> shared copies (sm_80+), one commit group per call of cp_async_commit.
__device__ __forceinline__ void cp_async16(void* smem, const void* g) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(s), "l"(g));
}

__device__ __forceinline__ void cp_async8(void* smem, const void* g) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(s), "l"(g));
}

// 16 bytes, of which the first `n` (0 or 16) are read from `g`, the rest zero-filled.
__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* g, int n) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(g), "r"(n));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

}  // namespace w12frag
