// The int8 activation codes of one 32-value block made by a warp that holds the block one value per lane: what
// the step's row kernels (step.cu) and the attention's merge (attention.cu) hand the next GEMV, the same codes and
// scales as quantize_act_kernel (gemv.cu) makes from the same values.
#pragma once

#include <cfloat>

#include "common.cuh"
#include "gemv_types.cuh"  // kActBlock

namespace pyllm {
namespace cuda {

#if defined(__CUDACC__)
__device__ __forceinline__ int warp_sum_int(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The 32 values of one activation block, value i in lane i: its codes and (d, d * sum(codes)) as
// quantize_act_kernel (gemv.cu) computes them.  The whole warp calls it.
__device__ __forceinline__ void quantize_block(float v, int8_t* __restrict__ xq, float2* __restrict__ xds,
                                               int base) {
    const int lane = threadIdx.x & 31;
    // NaN or +-inf in the block: zero codes and a NaN scale, as quantize_act_kernel (gemv.cu)
    const bool bad = __any_sync(0xffffffffu, !(fabsf(v) <= FLT_MAX));
    const float d = bad ? __int_as_float(0x7fc00000) : __fdiv_rn(warp_max(fabsf(v)), 127.0f);
    const int q = !bad && d > 0.f ? __float2int_rn(__fdiv_rn(v, d)) : 0;
    const int sum = warp_sum_int(q);
    xq[base + lane] = static_cast<int8_t>(q);
    if (lane == 0) xds[base / kActBlock] = make_float2(d, d * static_cast<float>(sum));
}
#endif

}  // namespace cuda
}  // namespace pyllm
