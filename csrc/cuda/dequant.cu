// GGUF blocks -> fp16/fp32 rows: the prefill path (dequantize a layer's weight, then cuBLAS through
// torch.matmul) and embedding lookups (selected rows only).
//
// Each thread writes 8 consecutive values (one 16-byte fp16 store), decoding them with the shared integer
// code decoders of csrc/common/decode.h.  The float math is spelled with __fmul_rn/__fadd_rn because those
// are never contracted into FMAs (even under --use_fast_math): the fp32 results then equal
// gguf.quants.dequantize bit for bit, the same order of operations as the CPU decoders.
#include "common.cuh"
#include "cuda_kernels.h"

namespace pyllm {
namespace cuda {
namespace {

constexpr int kPerThread = 8;

template <QType T>
struct Deq;  // value of element e (0 <= e < block size) of one block

template <>
struct Deq<QType::Q4_0> {
    using B = block_q4_0;
    __device__ static float at(const B& b, int e) { return __fmul_rn(h2f(b.d), static_cast<float>(q4_0_code(b, e) - 8)); }
};
template <>
struct Deq<QType::Q4_1> {
    using B = block_q4_1;
    __device__ static float at(const B& b, int e) {
        return __fadd_rn(__fmul_rn(h2f(b.d), static_cast<float>(q4_1_code(b, e))), h2f(b.m));
    }
};
template <>
struct Deq<QType::Q5_0> {
    using B = block_q5_0;
    __device__ static float at(const B& b, int e) { return __fmul_rn(h2f(b.d), static_cast<float>(q5_0_code(b, e) - 16)); }
};
template <>
struct Deq<QType::Q5_1> {
    using B = block_q5_1;
    __device__ static float at(const B& b, int e) {
        return __fadd_rn(__fmul_rn(h2f(b.d), static_cast<float>(q5_1_code(b, e))), h2f(b.m));
    }
};
template <>
struct Deq<QType::Q8_0> {
    using B = block_q8_0;
    __device__ static float at(const B& b, int e) { return __fmul_rn(static_cast<float>(b.qs[e]), h2f(b.d)); }
};
template <>
struct Deq<QType::Q2_K> {
    using B = block_q2_K;
    __device__ static float at(const B& b, int e) {
        const uint8_t sc = b.scales[e / 16];
        const float dl = __fmul_rn(h2f(b.d), static_cast<float>(sc & 0xF));
        const float ml = __fmul_rn(h2f(b.dmin), static_cast<float>(sc >> 4));
        return __fsub_rn(__fmul_rn(dl, static_cast<float>(q2_k_code(b, e))), ml);
    }
};
template <>
struct Deq<QType::Q3_K> {
    using B = block_q3_K;
    __device__ static float at(const B& b, int e) {
        const float dl = __fmul_rn(h2f(b.d), static_cast<float>(q3_k_scale(b.scales, e / 16)));
        return __fmul_rn(dl, static_cast<float>(q3_k_code(b, e)));
    }
};
// Q4_K and Q5_K share the 6-bit (scale, min) pairs: value = (d*sc)*q - (dmin*m)
template <class B>
__device__ inline float k4_value(const B& b, int e, int code) {
    uint8_t sc, m;
    get_scale_min_k4(e / 32, b.scales, &sc, &m);
    const float dl = __fmul_rn(h2f(b.d), static_cast<float>(sc)), ml = __fmul_rn(h2f(b.dmin), static_cast<float>(m));
    return __fsub_rn(__fmul_rn(dl, static_cast<float>(code)), ml);
}
template <>
struct Deq<QType::Q4_K> {
    using B = block_q4_K;
    __device__ static float at(const B& b, int e) { return k4_value(b, e, q4_k_code(b, e)); }
};
template <>
struct Deq<QType::Q5_K> {
    using B = block_q5_K;
    __device__ static float at(const B& b, int e) { return k4_value(b, e, q5_k_code(b, e)); }
};
template <>
struct Deq<QType::Q6_K> {
    using B = block_q6_K;
    __device__ static float at(const B& b, int e) {
        const float dl = __fmul_rn(h2f(b.d), static_cast<float>(b.scales[e / 16]));
        return __fmul_rn(dl, static_cast<float>(q6_k_code(b, e)));
    }
};
// Plain float rows, so embeddings and tied outputs stored as F16/BF16/F32 take the same path.
struct F16Elem { uint16_t v; };
struct BF16Elem { uint16_t v; };
template <>
struct Deq<QType::F16> {
    using B = F16Elem;
    __device__ static float at(const B& b, int) { return h2f(b.v); }
};
template <>
struct Deq<QType::BF16> {
    using B = BF16Elem;
    __device__ static float at(const B& b, int) { return bf16_to_fp32(b.v); }
};
template <>
struct Deq<QType::F32> {
    using B = float;
    __device__ static float at(const B& b, int) { return b; }
};

template <QType T>
__host__ __device__ constexpr int block_elems() {
    return (T == QType::F16 || T == QType::BF16 || T == QType::F32) ? 1
           : (T == QType::Q4_0 || T == QType::Q4_1 || T == QType::Q5_0 || T == QType::Q5_1 || T == QType::Q8_0)
               ? QK
               : QK_K;
}

// One thread per 8 outputs; grid covers n_out * K / 8 threads (K % 8 == 0 for every type handled).
template <QType T, class Out>
__global__ void __launch_bounds__(256) dequant_kernel(const uint8_t* __restrict__ w, size_t row_bytes,
                                                      const int64_t* __restrict__ ids, int64_t n_out, int K,
                                                      Out* __restrict__ out) {
    using B = typename Deq<T>::B;
    constexpr int BE = block_elems<T>();
    const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    const int per_row = K / kPerThread;
    if (t >= n_out * per_row) return;
    const int64_t i = t / per_row;
    const int k0 = static_cast<int>(t % per_row) * kPerThread;
    const int64_t src = ids ? ids[i] : i;
    const B* blocks = reinterpret_cast<const B*>(w + static_cast<size_t>(src) * row_bytes);
    float v[kPerThread];
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
        const int k = k0 + j;
        v[j] = Deq<T>::at(blocks[k / BE], k % BE);
    }
    Out* o = out + static_cast<size_t>(i) * K + k0;
    if constexpr (sizeof(Out) == 2) {
        __half2 h[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) h[j] = __floats2half2_rn(v[2 * j], v[2 * j + 1]);
        *reinterpret_cast<int4*>(o) = *reinterpret_cast<const int4*>(h);
    } else {
        reinterpret_cast<float4*>(o)[0] = make_float4(v[0], v[1], v[2], v[3]);
        reinterpret_cast<float4*>(o)[1] = make_float4(v[4], v[5], v[6], v[7]);
    }
}

// AWQ rows (blocks.h AwqRow): value = (q - z) * s, one fp32 multiply as dequant_awq_row on the CPU.
template <class Out>
__global__ void __launch_bounds__(256) dequant_awq_kernel(const uint8_t* __restrict__ w, size_t row_bytes,
                                                          const int64_t* __restrict__ ids, int64_t n_out, int K,
                                                          int G, Out* __restrict__ out) {
    const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    const int per_row = K / kPerThread;
    if (t >= n_out * per_row) return;
    const int64_t i = t / per_row;
    const int k0 = static_cast<int>(t % per_row) * kPerThread;
    const int64_t src = ids ? ids[i] : i;
    const AwqRow r = awq_row(w + static_cast<size_t>(src) * row_bytes, K, G);
    const int g = k0 / G;  // G % 8 == 0: the 8 values share a group
    const float s = h2f(ld_u16_b(r.s + 2 * g));
    const int z = r.z[g];
    float v[kPerThread];
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) v[j] = __fmul_rn(static_cast<float>(awq_code(r.qs, k0 + j) - z), s);
    Out* o = out + static_cast<size_t>(i) * K + k0;
    if constexpr (sizeof(Out) == 2) {
        __half2 h[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) h[j] = __floats2half2_rn(v[2 * j], v[2 * j + 1]);
        *reinterpret_cast<int4*>(o) = *reinterpret_cast<const int4*>(h);
    } else {
        reinterpret_cast<float4*>(o)[0] = make_float4(v[0], v[1], v[2], v[3]);
        reinterpret_cast<float4*>(o)[1] = make_float4(v[4], v[5], v[6], v[7]);
    }
}

void launch_awq(const uint8_t* w, size_t row_bytes, const int64_t* ids, int64_t n_out, int K, int G, __half* of16,
                float* of32, cudaStream_t stream) {
    const int64_t threads = n_out * (K / kPerThread);
    if (threads == 0) return;
    const unsigned grid = static_cast<unsigned>((threads + 255) / 256);
    if (of16)
        dequant_awq_kernel<__half><<<grid, 256, 0, stream>>>(w, row_bytes, ids, n_out, K, G, of16);
    else
        dequant_awq_kernel<float><<<grid, 256, 0, stream>>>(w, row_bytes, ids, n_out, K, G, of32);
}

template <QType T>
void launch(const uint8_t* w, size_t row_bytes, const int64_t* ids, int64_t n_out, int K, __half* of16,
            float* of32, cudaStream_t stream) {
    const int64_t threads = n_out * (K / kPerThread);
    if (threads == 0) return;
    const unsigned grid = static_cast<unsigned>((threads + 255) / 256);
    if (of16)
        dequant_kernel<T, __half><<<grid, 256, 0, stream>>>(w, row_bytes, ids, n_out, K, of16);
    else
        dequant_kernel<T, float><<<grid, 256, 0, stream>>>(w, row_bytes, ids, n_out, K, of32);
}

}  // namespace
}  // namespace cuda

bool dequant_cuda_supported(QType t) {
    switch (t) {
        case QType::F32: case QType::F16: case QType::BF16:
        case QType::Q4_0: case QType::Q4_1: case QType::Q5_0: case QType::Q5_1: case QType::Q8_0:
        case QType::Q2_K: case QType::Q3_K: case QType::Q4_K: case QType::Q5_K: case QType::Q6_K:
        case QType::AWQ_G32: case QType::AWQ_G64: case QType::AWQ_G128: case QType::AWQ_G256:
        case QType::Q4_0_TILED: case QType::Q8_0_TILED: case QType::Q4_K_TILED: case QType::Q6_K_TILED:
        case QType::AWQ_G32_TILED: case QType::AWQ_G64_TILED: case QType::AWQ_G128_TILED: case QType::AWQ_G256_TILED:
            return true;
        default:
            return false;
    }
}

void dequantize_cuda(QType t, const uint8_t* w, size_t row_bytes, const int64_t* ids, int64_t n_out, int K,
                     __half* out_f16, float* out_f32, cudaStream_t stream) {
    using cuda::launch;
#define PYLLM_DEQ_CASE(T) \
    case QType::T: launch<QType::T>(w, row_bytes, ids, n_out, K, out_f16, out_f32, stream); break;
    switch (t) {
        PYLLM_DEQ_CASE(F32)
        PYLLM_DEQ_CASE(F16)
        PYLLM_DEQ_CASE(BF16)
        PYLLM_DEQ_CASE(Q4_0)
        PYLLM_DEQ_CASE(Q4_1)
        PYLLM_DEQ_CASE(Q5_0)
        PYLLM_DEQ_CASE(Q5_1)
        PYLLM_DEQ_CASE(Q8_0)
        PYLLM_DEQ_CASE(Q2_K)
        PYLLM_DEQ_CASE(Q3_K)
        PYLLM_DEQ_CASE(Q4_K)
        PYLLM_DEQ_CASE(Q5_K)
        PYLLM_DEQ_CASE(Q6_K)
        case QType::AWQ_G32: case QType::AWQ_G64: case QType::AWQ_G128: case QType::AWQ_G256:
            cuda::launch_awq(w, row_bytes, ids, n_out, K, qtype_traits(static_cast<int>(t))->block_size, out_f16,
                             out_f32, stream);
            break;
        case QType::Q4_0_TILED: case QType::Q8_0_TILED: case QType::Q4_K_TILED: case QType::Q6_K_TILED:
        case QType::AWQ_G32_TILED: case QType::AWQ_G64_TILED: case QType::AWQ_G128_TILED: case QType::AWQ_G256_TILED:
            dequantize_tiled_cuda(t, w, row_bytes, ids, n_out, K, out_f16, out_f32, stream);  // gemv_tiled.cu
            break;
        default:
            throw std::invalid_argument(std::string("dequantize_cuda: type ") + qtype_name(t) +
                                        " has no CUDA dequantize kernel");
    }
#undef PYLLM_DEQ_CASE
    cuda::check_launch("dequantize_cuda");
}

}  // namespace pyllm
