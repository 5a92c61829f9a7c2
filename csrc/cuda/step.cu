// The row operations of the graph-captured decode step (pyllm/backends/cuda_step.py CudaDecodeStep) between its
// GEMVs, each one kernel where torch takes several: a step of an 8B model is ~14 launches per layer instead of
// ~50, and at batch 1 on a GPU every launch costs microseconds the weights' stream does not hide.
//
// - residual_norm_quant: x += a (or + rms_norm(a) * post_w), then h = rms_norm(x) * w and h's int8 codes for
//   the next GEMV (quantize_act's codes: 32 values per scale, one warp per 32 values, one value per lane);
// - act_quant: h = act(g) * u (SiLU or tanh-GELU) and its codes, for the down projection;
// - rope_store: bias, per-head RMS norm, RoPE of q and k at the device-held position, and the new K/V rows
//   written into a float cache (f32 / f16 / bf16) at that position.
// Every value is float32 and computed in the order of the torch code it replaces, so the step's logits stay
// within float rounding of the torch path (tests/gpu/test_step_kernels.py).  Sizes and constants come from the
// model's ArchDims (csrc/common/arch.h), taken by value; the row kernels run M rows (one CTA, or one stretch of
// threads, per row), each exactly as alone, so a batched step's row is its sequence's own step bit for bit.
#include <cuda_bf16.h>

#include <cfloat>

#include "act_codes.cuh"
#include "common.cuh"
#include "cuda_kernels.h"

namespace pyllm {
namespace cuda {
namespace {

// Sum over the CTA (blockDim.x a multiple of 32, at most 1024); every thread gets it.  red: 32 floats of
// shared memory, free for the next call once this one returns (the leading barrier guards its reuse).
__device__ float block_sum(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    return warp_sum(lane < nw ? red[lane] : 0.f);
}

// Thread t owns elements t + k * blockDim.x (k < P, P * blockDim.x >= D): all its loads are issued first, so the
// kernel waits for memory once, not once per loop and element (the loop form below took 5.7 us per call on an
// H200 for D = 4096); the sums run in the loop form's order, so both give the same bits.
template <int P>
__global__ void __launch_bounds__(1024) residual_norm_quant_regs_kernel(ArchDims arch, float* __restrict__ x,
                                                                        const float* __restrict__ a,
                                                                        const float* __restrict__ post_w,
                                                                        const float* __restrict__ w,
                                                                        float* __restrict__ h,
                                                                        int8_t* __restrict__ xq,
                                                                        float2* __restrict__ xds) {
    pdl_trigger();
    pdl_wait();
    __shared__ float red[32];
    const int D = static_cast<int>(arch.n_embd);
    const float eps = static_cast<float>(arch.rms_eps);
    // this CTA's row (blockIdx.x) of x, a, h and the codes: D values each, D / 32 scales
    const size_t row0 = static_cast<size_t>(blockIdx.x) * D;
    x += row0;
    if (a != nullptr) a += row0;
    h += row0;
    xq += row0;
    xds += row0 / 32;
    const int t = threadIdx.x, nt = blockDim.x;
    float xv[P], av[P], pv[P], wv[P];
#pragma unroll
    for (int k = 0; k < P; ++k) {  // elements past D load element D - 1 and are never used
        const int i = min(t + k * nt, D - 1);
        xv[k] = x[i];
        wv[k] = w[i];
        av[k] = a != nullptr ? a[i] : 0.f;
        pv[k] = post_w != nullptr ? post_w[i] : 0.f;
    }
    if (a != nullptr) {
        float ra = 1.f;
        if (post_w != nullptr) {
            float ss = 0.f;
#pragma unroll
            for (int k = 0; k < P; ++k)
                if (t + k * nt < D) ss += av[k] * av[k];
            ra = rsqrtf(block_sum(ss, red) / static_cast<float>(D) + eps);
        }
#pragma unroll
        for (int k = 0; k < P; ++k)
            if (t + k * nt < D) {
                xv[k] += post_w != nullptr ? av[k] * ra * pv[k] : av[k];
                x[t + k * nt] = xv[k];
            }
    }
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < P; ++k)
        if (t + k * nt < D) ss += xv[k] * xv[k];
    const float r = rsqrtf(block_sum(ss, red) / static_cast<float>(D) + eps);
    // Warp-uniform: D % 32 == 0 and blockDim.x % 32 == 0, so a warp's 32 elements are one block (or all past D).
#pragma unroll
    for (int k = 0; k < P; ++k) {
        const int base = (t & ~31) + k * nt;
        if (base < D) {
            const float v = xv[k] * r * wv[k];
            h[base + (t & 31)] = v;
            quantize_block(v, xq, xds, base);
        }
    }
}

// The same for any D (rows longer than the register form's 8 x 1024 values: 64 registers a thread at most).
__global__ void __launch_bounds__(1024) residual_norm_quant_kernel(ArchDims arch, float* __restrict__ x,
                                                                   const float* __restrict__ a,
                                                                   const float* __restrict__ post_w,
                                                                   const float* __restrict__ w,
                                                                   float* __restrict__ h, int8_t* __restrict__ xq,
                                                                   float2* __restrict__ xds) {
    pdl_trigger();
    pdl_wait();
    __shared__ float red[32];
    const int D = static_cast<int>(arch.n_embd);
    const float eps = static_cast<float>(arch.rms_eps);
    // this CTA's row (blockIdx.x) of x, a, h and the codes: D values each, D / 32 scales
    const size_t row0 = static_cast<size_t>(blockIdx.x) * D;
    x += row0;
    if (a != nullptr) a += row0;
    h += row0;
    xq += row0;
    xds += row0 / 32;
    // Each thread touches elements threadIdx.x + k * blockDim.x in every loop, so x needs no barrier between them.
    if (a != nullptr) {
        float ra = 1.f;
        if (post_w != nullptr) {
            float ss = 0.f;
            for (int i = threadIdx.x; i < D; i += blockDim.x) ss += a[i] * a[i];
            ra = rsqrtf(block_sum(ss, red) / static_cast<float>(D) + eps);
        }
        for (int i = threadIdx.x; i < D; i += blockDim.x) x[i] += post_w != nullptr ? a[i] * ra * post_w[i] : a[i];
    }
    float ss = 0.f;
    for (int i = threadIdx.x; i < D; i += blockDim.x) ss += x[i] * x[i];
    const float r = rsqrtf(block_sum(ss, red) / static_cast<float>(D) + eps);
    // Warp-uniform trip count: D % 32 == 0 and blockDim.x % 32 == 0, so a warp's 32 elements are one block.
    for (int base = threadIdx.x & ~31; base < D; base += blockDim.x) {
        const int i = base + (threadIdx.x & 31);
        const float v = x[i] * r * w[i];
        h[i] = v;
        quantize_block(v, xq, xds, base);
    }
}

// M rows of n_ff values back to back: n_ff % 32 == 0, so a warp's 32 values are one block of one row, and the
// codes' scales of all rows are one array ([M, n_ff / 32]).
template <int Act>  // 0: SiLU, 1: GELU (tanh approximation)
__global__ void __launch_bounds__(256) act_quant_kernel(ArchDims arch, int M, const float* __restrict__ g,
                                                        const float* __restrict__ u, float* __restrict__ h,
                                                        int8_t* __restrict__ xq, float2* __restrict__ xds) {
    pdl_trigger();
    pdl_wait();
    const int n = M * static_cast<int>(arch.n_ff);
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const int base = i & ~31;
    if (base >= n) return;  // the whole warp: n % 32 == 0
    const float gv = g[i];
    const float act = Act == 0 ? gv / (1.0f + __expf(-gv))
                               : 0.5f * gv * (1.0f + tanhf(0.7978845608028654f * (gv + 0.044715f * gv * gv * gv)));
    const float v = act * u[i];
    h[i] = v;
    quantize_block(v, xq, xds, base);
}

__device__ __forceinline__ void store_row_value(KVRow t, uint8_t* row, int j, float v) {
    switch (t) {
        case KVRow::F32: reinterpret_cast<float*>(row)[j] = v; break;
        case KVRow::F16: reinterpret_cast<__half*>(row)[j] = __float2half_rn(v); break;
        case KVRow::BF16: reinterpret_cast<__nv_bfloat16*>(row)[j] = __float2bfloat16_rn(v); break;
        default: break;  // block rows are written by the torch path (the binding refuses them)
    }
}

// One CTA per head: H query heads, then Hkv key heads, then Hkv value heads; one thread per value.
__global__ void rope_store_kernel(ArchDims arch, RopeStoreArgs p) {
    pdl_trigger();
    pdl_wait();
    extern __shared__ float row[];  // the head's values before RoPE: each output reads its pair partner
    __shared__ float red[32];
    const int H = static_cast<int>(arch.n_head), Hkv = static_cast<int>(arch.n_kv_head);
    const int hd = static_cast<int>(arch.head_dim);
    const int rope_half = p.cos != nullptr ? static_cast<int>(arch.rope_dim / 2) : 0;
    const float eps = static_cast<float>(arch.rms_eps);
    const int b = blockIdx.x, j = threadIdx.x;
    const bool is_q = b < H, is_k = !is_q && b < H + Hkv;
    const int head = is_q ? b : is_k ? b - H : b - H - Hkv;
    const float* src = is_q ? p.q : is_k ? p.k : p.v;
    const float* bias = is_q ? p.q_bias : is_k ? p.k_bias : p.v_bias;
    const int64_t pos = *p.pos;
    float x = src[head * hd + j];
    if (bias != nullptr) x += bias[head * hd + j];
    if (is_q || is_k) {
        const float* nw = is_q ? p.q_norm : p.k_norm;
        if (nw != nullptr) x = x * rsqrtf(block_sum(x * x, red) / static_cast<float>(hd) + eps) * nw[j];
        row[j] = x;
        __syncthreads();
        if (j < 2 * rope_half && pos < p.max_pos) {
            const float* cs = p.cos + pos * rope_half;
            const float* sn = p.sin + pos * rope_half;
            if (arch.neox) {  // pairs (i, i + half)
                const int i = j < rope_half ? j : j - rope_half;
                x = j < rope_half ? row[j] * cs[i] - row[j + rope_half] * sn[i]
                                  : row[j] * cs[i] + row[j - rope_half] * sn[i];
            } else {  // pairs (2i, 2i + 1)
                const int i = j >> 1;
                x = (j & 1) == 0 ? row[j] * cs[i] - row[j + 1] * sn[i] : row[j] * cs[i] + row[j - 1] * sn[i];
            }
        }
    }
    if (is_q) {
        p.q_out[head * hd + j] = x;
    } else if (pos < p.max_seq) {  // the runtime checks room before a step; never write past the cache
        const KVRow t = is_k ? p.k_type : p.v_type;
        uint8_t* base = is_k ? p.k_cache : p.v_cache;
        store_row_value(t, base + (static_cast<size_t>(head) * p.max_seq + pos) * kv_row_size(t, hd), j, x);
    }
}

}  // namespace
}  // namespace cuda

void residual_norm_quant_cuda(const ArchDims& arch, int M, float* x, const float* a, const float* post_w,
                              const float* w, float* h, int8_t* xq, float2* xds, cudaStream_t stream) {
    const int D = static_cast<int>(arch.n_embd);
    const int threads = D < 1024 ? D : 1024;  // D % 32 == 0
    const int per = (D + threads - 1) / threads;
    auto* kernel = per == 1   ? cuda::residual_norm_quant_regs_kernel<1>
                   : per == 2 ? cuda::residual_norm_quant_regs_kernel<2>
                   : per <= 4 ? cuda::residual_norm_quant_regs_kernel<4>
                   : per <= 8 ? cuda::residual_norm_quant_regs_kernel<8>
                              : cuda::residual_norm_quant_kernel;
    cuda::launch_kernel("residual_norm_quant_cuda", kernel, static_cast<unsigned>(M), threads, 0, stream, arch, x, a,
                        post_w, w, h, xq, xds);
}

void act_quant_cuda(const ArchDims& arch, int M, const float* g, const float* u, float* h, int8_t* xq, float2* xds,
                    cudaStream_t stream) {
    const int64_t n = M * arch.n_ff;
    const unsigned grid = static_cast<unsigned>((n + 255) / 256);
    cuda::launch_kernel("act_quant_cuda", arch.gelu_tanh ? cuda::act_quant_kernel<1> : cuda::act_quant_kernel<0>,
                        grid, 256, 0, stream, arch, M, g, u, h, xq, xds);
}

void rope_store_cuda(const ArchDims& arch, const RopeStoreArgs& args, cudaStream_t stream) {
    const unsigned grid = static_cast<unsigned>(arch.n_head + 2 * arch.n_kv_head);
    const int hd = static_cast<int>(arch.head_dim);
    cuda::launch_kernel("rope_store_cuda", cuda::rope_store_kernel, grid, hd, hd * sizeof(float), stream, arch,
                        args);
}

}  // namespace pyllm
