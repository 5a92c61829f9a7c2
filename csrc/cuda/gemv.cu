// Decode GEMV: y[M, N] = x[M, K] @ W[N, K]^T for 1..8 activation rows, W read once in its GGUF block form
// and dequantized in registers (the per-type math is in gemv_types.cuh).
//
// Shape of the work: a CTA of 4 warps owns R rows (R = 1 for M = 1, else 2, as ggml's mmvq: two rows share
// each activation load once M > 1) of one of the launch's parts (matrices sharing x: q/k/v, gate/up).  Its 128
// threads walk the row's slots (16- or 32-value pieces of blocks) with stride 128, so each warp reads a
// contiguous run of the row; partial sums are reduced across the warp by shuffles and across the 4 warps through
// shared memory.  Accumulation is fp32 per slot, int32 inside.
//
// Why this shape: at batch 1 the GEMV is a stream over W; one row per CTA gives N CTAs (>= 4096 for every
// Llama-3 matrix), enough independent loads in flight to cover HBM latency without a split-K reduction.
#include <cfloat>
#include <cstdlib>

#include "cuda_kernels.h"
#include "gemv_types.cuh"

namespace pyllm {
namespace cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;

// x -> int8 codes per 32 values.  8 lanes own one 32-value block (4 values each), so the block's max and
// code sum are 3 shuffles away; groups of 8 lanes never straddle a block because K % 32 == 0.
__global__ void __launch_bounds__(256) quantize_act_kernel(const float* __restrict__ x, int8_t* __restrict__ xq,
                                                           float2* __restrict__ xds, int64_t n_vals) {
    pdl_trigger();
    pdl_wait();
    const int64_t i4 = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 4;
    const bool live = i4 < n_vals;
    float4 v = live ? *reinterpret_cast<const float4*>(x + i4) : make_float4(0.f, 0.f, 0.f, 0.f);
    float amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
    // NaN or +-inf anywhere in the block: zero codes and a NaN scale, so the GEMV's sums are NaN rather than a
    // broken activation rounded into finite codes (fmaxf drops NaN).  The CPU quantizers do the same.
    int bad = !(fabsf(v.x) <= FLT_MAX && fabsf(v.y) <= FLT_MAX && fabsf(v.z) <= FLT_MAX && fabsf(v.w) <= FLT_MAX);
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        bad |= __shfl_xor_sync(0xffffffffu, bad, o);
    }
    // __fdiv_rn: IEEE division even under --use_fast_math, so scales and codes are reproducible by a numpy reference
    const float d = bad ? __int_as_float(0x7fc00000) : __fdiv_rn(amax, 127.0f);
    const bool live_codes = !bad && d > 0.f;
    const int q0 = live_codes ? __float2int_rn(__fdiv_rn(v.x, d)) : 0;
    const int q1 = live_codes ? __float2int_rn(__fdiv_rn(v.y, d)) : 0;
    const int q2 = live_codes ? __float2int_rn(__fdiv_rn(v.z, d)) : 0;
    const int q3 = live_codes ? __float2int_rn(__fdiv_rn(v.w, d)) : 0;
    int sum = q0 + q1 + q2 + q3;
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (!live) return;
    const uint32_t packed = (static_cast<uint32_t>(q0) & 0xffu) | ((static_cast<uint32_t>(q1) & 0xffu) << 8) |
                            ((static_cast<uint32_t>(q2) & 0xffu) << 16) | ((static_cast<uint32_t>(q3) & 0xffu) << 24);
    *reinterpret_cast<uint32_t*>(xq + i4) = packed;
    if ((threadIdx.x & 7) == 0) xds[i4 / kActBlock] = make_float2(d, d * static_cast<float>(sum));
}

// The parts of one launch (gemv_parts_cuda): part p owns CTAs [cta_end[p - 1], cta_end[p]).
// prefetch_l2: the CTA asks L2 for its weight rows before it waits for the activations (set when the launch is
// programmatic, pdl_requested(): the rows then stream in while the kernel before drains).
struct Parts {
    GemvPart p[CUDA_GEMV_MAX_PARTS];
    int cta_end[CUDA_GEMV_MAX_PARTS];
    int n;
    int prefetch_l2;
};

// R rows of one matrix from row row0 for this CTA: the body every GEMV kernel of this file shares.  w: N rows of
// row_bytes; xq / xds: M activation rows of K codes; y: [M, N].
template <QType T, int M, int R>
__device__ __forceinline__ void gemv_rows(const uint8_t* w, size_t row_bytes, float* y, int N, int row0,
                                          const int8_t* __restrict__ xq, const float2* __restrict__ xds, int K,
                                          int prefetch) {
    using Ty = GemvType<T>;
    const int n_slots = (K / Ty::kElems) * Ty::kSlots;
    const int nds = K / kActBlock;
    const uint8_t* wr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) wr[r] = w + static_cast<size_t>(min(row0 + r, N - 1)) * row_bytes;  // tail rows read row N-1, never written
    if (prefetch)  // the weights are constant: nothing to wait for
#pragma unroll
        for (int r = 0; r < R; ++r) prefetch_l2(wr[r], row_bytes);
    pdl_wait();

    float acc[M][R];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[m][r] = 0.f;

    for (int s = threadIdx.x; s < n_slots; s += kThreads) {
        const int kb = s / Ty::kSlots, sl = s % Ty::kSlots;
        const int8_t* xb = xq + static_cast<size_t>(kb) * Ty::kElems;
        const float2* db = xds + static_cast<size_t>(kb) * (Ty::kElems / kActBlock);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const typename Ty::Frag f = Ty::load(wr[r] + static_cast<size_t>(kb) * Ty::kBytes, sl);
#pragma unroll
            for (int m = 0; m < M; ++m)
                acc[m][r] += Ty::dot(f, sl, xb + static_cast<size_t>(m) * K, db + static_cast<size_t>(m) * nds);
        }
    }

    __shared__ float red[kWarps][M * R];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const float v = warp_sum(acc[m][r]);
            if (lane == 0) red[warp][m * R + r] = v;
        }
    __syncthreads();
    if (threadIdx.x < M * R) {
        const int m = threadIdx.x / R, r = threadIdx.x % R;
        float v = 0.f;
#pragma unroll
        for (int i = 0; i < kWarps; ++i) v += red[i][threadIdx.x];
        if (row0 + r < N) y[static_cast<size_t>(m) * N + row0 + r] = v;
    }
}

template <QType T, int M, int R>
__global__ void __launch_bounds__(kThreads, 1) gemv_kernel(const Parts parts, const int8_t* __restrict__ xq,
                                                        const float2* __restrict__ xds, int K) {
    pdl_trigger();
    // this CTA's part, by selects (a dynamic index into the parameter struct would copy it to local memory)
    int pi = 0;
#pragma unroll
    for (int i = 0; i + 1 < CUDA_GEMV_MAX_PARTS; ++i) pi += i + 1 < parts.n && blockIdx.x >= parts.cta_end[i];
    static_assert(CUDA_GEMV_MAX_PARTS == 3, "the selects below name each part");
    const uint8_t* const w = pi == 0 ? parts.p[0].w : pi == 1 ? parts.p[1].w : parts.p[2].w;
    const size_t row_bytes = pi == 0 ? parts.p[0].row_bytes : pi == 1 ? parts.p[1].row_bytes : parts.p[2].row_bytes;
    float* const y = pi == 0 ? parts.p[0].y : pi == 1 ? parts.p[1].y : parts.p[2].y;
    const int N = pi == 0 ? parts.p[0].N : pi == 1 ? parts.p[1].N : parts.p[2].N;
    const int cta0 = pi == 0 ? 0 : pi == 1 ? parts.cta_end[0] : parts.cta_end[1];
    gemv_rows<T, M, R>(w, row_bytes, y, N, (static_cast<int>(blockIdx.x) - cta0) * R, xq, xds, K,
                       parts.prefetch_l2);
}

// MUL_MAT_ID for decode (gemv_experts_cuda): CTA column blockIdx.y is selection a, whose expert ids[a] (read on
// the device: no host sync, so a captured graph can hold it) is the slice at w + ids[a] * expert_bytes, against
// activation row a / rows_per_x, into y row a.
template <QType T, int R>
__global__ void __launch_bounds__(kThreads, 1) gemv_experts_kernel(const uint8_t* __restrict__ w, size_t expert_bytes,
                                                                size_t row_bytes, const int64_t* __restrict__ ids,
                                                                int rows_per_x, const int8_t* __restrict__ xq,
                                                                const float2* __restrict__ xds, float* __restrict__ y,
                                                                int N, int K, int prefetch) {
    pdl_trigger();
    const int a = static_cast<int>(blockIdx.y), xr = a / rows_per_x;
    gemv_rows<T, 1, R>(w + static_cast<size_t>(ids[a]) * expert_bytes, row_bytes, y + static_cast<size_t>(a) * N, N,
                       static_cast<int>(blockIdx.x) * R, xq + static_cast<size_t>(xr) * K,
                       xds + static_cast<size_t>(xr) * (K / kActBlock), K, prefetch);
}

// The same shape for AWQ rows (GemvAwq): the row, not a block, is what load() indexes.
template <int M, int R>
__global__ void __launch_bounds__(kThreads, 1) gemv_awq_kernel(const uint8_t* __restrict__ w, size_t row_bytes,
                                                            const int8_t* __restrict__ xq,
                                                            const float2* __restrict__ xds, float* __restrict__ y,
                                                            int N, int K, int G) {
    pdl_trigger();
    pdl_wait();
    const int row0 = blockIdx.x * R;
    const int ng = K / G, n_slots = (K / GemvAwq::kElems) * GemvAwq::kSlots, nds = K / kActBlock;
    const uint8_t* wr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) wr[r] = w + static_cast<size_t>(min(row0 + r, N - 1)) * row_bytes;

    float acc[M][R];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[m][r] = 0.f;

    for (int s = threadIdx.x; s < n_slots; s += kThreads) {
        const int kb = s / GemvAwq::kSlots, sl = s % GemvAwq::kSlots;
        const int8_t* xb = xq + static_cast<size_t>(kb) * GemvAwq::kElems;
        const float2* db = xds + kb;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const GemvAwq::Frag f = GemvAwq::load(wr[r], ng, G, kb, sl);
#pragma unroll
            for (int m = 0; m < M; ++m)
                acc[m][r] += GemvAwq::dot(f, sl, xb + static_cast<size_t>(m) * K, db + static_cast<size_t>(m) * nds);
        }
    }

    __shared__ float red[kWarps][M * R];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const float v = warp_sum(acc[m][r]);
            if (lane == 0) red[warp][m * R + r] = v;
        }
    __syncthreads();
    if (threadIdx.x < M * R) {
        const int m = threadIdx.x / R, r = threadIdx.x % R;
        float v = 0.f;
#pragma unroll
        for (int i = 0; i < kWarps; ++i) v += red[i][threadIdx.x];
        if (row0 + r < N) y[static_cast<size_t>(m) * N + row0 + r] = v;
    }
}

template <int M>
void launch_awq_m(const uint8_t* w, size_t row_bytes, const int8_t* xq, const float2* xds, float* y, int N, int K,
                  int G, cudaStream_t stream) {
    constexpr int R = M == 1 ? 1 : 2;
    launch_kernel("gemv_cuda", gemv_awq_kernel<M, R>, (N + R - 1) / R, kThreads, 0, stream, w, row_bytes, xq, xds, y,
                  N, K, G);
}

void launch_awq(int M, const uint8_t* w, size_t row_bytes, const int8_t* xq, const float2* xds, float* y, int N,
                int K, int G, cudaStream_t stream) {
    switch (M) {
        case 1: launch_awq_m<1>(w, row_bytes, xq, xds, y, N, K, G, stream); break;
        case 2: launch_awq_m<2>(w, row_bytes, xq, xds, y, N, K, G, stream); break;
        case 3: launch_awq_m<3>(w, row_bytes, xq, xds, y, N, K, G, stream); break;
        case 4: launch_awq_m<4>(w, row_bytes, xq, xds, y, N, K, G, stream); break;
        case 5: launch_awq_m<5>(w, row_bytes, xq, xds, y, N, K, G, stream); break;
        case 6: launch_awq_m<6>(w, row_bytes, xq, xds, y, N, K, G, stream); break;
        case 7: launch_awq_m<7>(w, row_bytes, xq, xds, y, N, K, G, stream); break;
        case 8: launch_awq_m<8>(w, row_bytes, xq, xds, y, N, K, G, stream); break;
        default: throw std::invalid_argument("gemv_cuda: M=" + std::to_string(M) + " is outside 1.." +
                                             std::to_string(CUDA_GEMV_MAX_M));
    }
}

// Rows per CTA at M = 1: 4, or 1 / 2 where PYLLM_CUDA_GEMV_ROWS asks.  On the H200 one row per CTA ran at 36-73%
// of copy bandwidth, bound by each CTA's short life (one or two slots per thread, then a reduction); more rows per
// CTA put R independent loads per thread in flight and cut the CTAs R-fold.  Measured there (tests/gpu/bench_cuda.py
// times all three): 4 rows were the fastest or within 2% on 23 of 28 (type, shape) pairs, and a synthetic
// Llama-3-8B token took 3.36 / 3.14 / 3.12 ms (Q4_K_M) and 3.24 / 2.93 / 2.86 ms (Q4_0) at 1 / 2 / 4 rows.
int rows_per_cta_m1() {
    const char* e = std::getenv("PYLLM_CUDA_GEMV_ROWS");
    return e != nullptr && (e[0] == '1' || e[0] == '2') && e[1] == 0 ? e[0] - '0' : 4;
}

template <QType T, int M>
void launch_m(Parts parts, const int8_t* xq, const float2* xds, int K, cudaStream_t stream) {
    const int R = M == 1 ? rows_per_cta_m1() : 2;
    int ctas = 0;
    for (int i = 0; i < parts.n; ++i) parts.cta_end[i] = ctas += (parts.p[i].N + R - 1) / R;
    parts.prefetch_l2 = pdl_requested();
    if constexpr (M == 1) {
        auto* kernel = R == 2 ? gemv_kernel<T, 1, 2> : R == 4 ? gemv_kernel<T, 1, 4> : gemv_kernel<T, 1, 1>;
        launch_kernel("gemv_cuda", kernel, ctas, kThreads, 0, stream, parts, xq, xds, K);
    } else {
        launch_kernel("gemv_cuda", gemv_kernel<T, M, 2>, ctas, kThreads, 0, stream, parts, xq, xds, K);
    }
}

template <QType T>
void launch_type(int M, const Parts& parts, const int8_t* xq, const float2* xds, int K, cudaStream_t stream) {
    switch (M) {
        case 1: launch_m<T, 1>(parts, xq, xds, K, stream); break;
        case 2: launch_m<T, 2>(parts, xq, xds, K, stream); break;
        case 3: launch_m<T, 3>(parts, xq, xds, K, stream); break;
        case 4: launch_m<T, 4>(parts, xq, xds, K, stream); break;
        case 5: launch_m<T, 5>(parts, xq, xds, K, stream); break;
        case 6: launch_m<T, 6>(parts, xq, xds, K, stream); break;
        case 7: launch_m<T, 7>(parts, xq, xds, K, stream); break;
        case 8: launch_m<T, 8>(parts, xq, xds, K, stream); break;
        default: throw std::invalid_argument("gemv_cuda: M=" + std::to_string(M) + " is outside 1.." +
                                             std::to_string(CUDA_GEMV_MAX_M));
    }
}

template <QType T>
void launch_experts(const uint8_t* w, size_t expert_bytes, size_t row_bytes, const int64_t* ids, int n_sel,
                    int rows_per_x, const int8_t* xq, const float2* xds, float* y, int N, int K, cudaStream_t stream) {
    const int R = rows_per_cta_m1();
    auto* kernel = R == 2 ? gemv_experts_kernel<T, 2> : R == 4 ? gemv_experts_kernel<T, 4> : gemv_experts_kernel<T, 1>;
    const dim3 grid(static_cast<unsigned>((N + R - 1) / R), static_cast<unsigned>(n_sel));
    launch_kernel("gemv_experts_cuda", kernel, grid, kThreads, 0, stream, w, expert_bytes, row_bytes, ids,
                  rows_per_x, xq, xds, y, N, K, static_cast<int>(pdl_requested()));
}

}  // namespace
}  // namespace cuda

void gemv_experts_cuda(QType t, const uint8_t* w, size_t expert_bytes, size_t row_bytes, const int64_t* ids,
                       int n_sel, int rows_per_x, const int8_t* xq, const float2* xds, float* y, int N, int K,
                       cudaStream_t stream) {
    using cuda::launch_experts;
    switch (t) {
        case QType::Q4_0: launch_experts<QType::Q4_0>(w, expert_bytes, row_bytes, ids, n_sel, rows_per_x, xq, xds, y, N, K, stream); break;
        case QType::Q4_1: launch_experts<QType::Q4_1>(w, expert_bytes, row_bytes, ids, n_sel, rows_per_x, xq, xds, y, N, K, stream); break;
        case QType::Q5_0: launch_experts<QType::Q5_0>(w, expert_bytes, row_bytes, ids, n_sel, rows_per_x, xq, xds, y, N, K, stream); break;
        case QType::Q8_0: launch_experts<QType::Q8_0>(w, expert_bytes, row_bytes, ids, n_sel, rows_per_x, xq, xds, y, N, K, stream); break;
        case QType::Q4_K: launch_experts<QType::Q4_K>(w, expert_bytes, row_bytes, ids, n_sel, rows_per_x, xq, xds, y, N, K, stream); break;
        case QType::Q5_K: launch_experts<QType::Q5_K>(w, expert_bytes, row_bytes, ids, n_sel, rows_per_x, xq, xds, y, N, K, stream); break;
        case QType::Q6_K: launch_experts<QType::Q6_K>(w, expert_bytes, row_bytes, ids, n_sel, rows_per_x, xq, xds, y, N, K, stream); break;
        default:
            throw std::invalid_argument(std::string("gemv_experts_cuda: weight type ") + qtype_name(t) +
                                        " has no CUDA expert GEMV (supported: Q4_0 Q4_1 Q5_0 Q8_0 Q4_K Q5_K Q6_K)");
    }
}

bool gemv_cuda_supported(QType t) {
    switch (t) {
        case QType::Q4_0: case QType::Q4_1: case QType::Q5_0: case QType::Q8_0:
        case QType::Q4_K: case QType::Q5_K: case QType::Q6_K:
        case QType::AWQ_G32: case QType::AWQ_G64: case QType::AWQ_G128: case QType::AWQ_G256:
        case QType::Q4_0_TILED: case QType::Q8_0_TILED: case QType::Q4_K_TILED: case QType::Q6_K_TILED:
        case QType::AWQ_G32_TILED: case QType::AWQ_G64_TILED: case QType::AWQ_G128_TILED: case QType::AWQ_G256_TILED:
            return true;
        default:
            return false;
    }
}

int gemv_cuda_alignment(QType t) {
    switch (t) {
        case QType::Q4_K: case QType::Q5_K: return 16;
        case QType::Q4_0_TILED: case QType::Q8_0_TILED: case QType::Q4_K_TILED: case QType::Q6_K_TILED: return 16;
        case QType::AWQ_G32_TILED: case QType::AWQ_G64_TILED: case QType::AWQ_G128_TILED: case QType::AWQ_G256_TILED:
            return 16;
        case QType::Q4_1: return 4;
        case QType::AWQ_G32: case QType::AWQ_G64: case QType::AWQ_G128: case QType::AWQ_G256: return 1;
        default: return 2;
    }
}

void quantize_act_cuda(const float* x, int8_t* xq, float2* xds, int M, int K, cudaStream_t stream) {
    const int64_t n = static_cast<int64_t>(M) * K;
    const int64_t threads = n / 4;
    const unsigned grid = static_cast<unsigned>((threads + 255) / 256);
    cuda::launch_kernel("quantize_act_cuda", cuda::quantize_act_kernel, grid, 256, 0, stream, x, xq, xds, n);
}

void gemv_parts_cuda(QType t, const GemvPart* parts, int n_parts, const int8_t* xq, const float2* xds, int M, int K,
                     cudaStream_t stream) {
    if (n_parts < 1 || n_parts > CUDA_GEMV_MAX_PARTS)
        throw std::invalid_argument("gemv_parts_cuda: " + std::to_string(n_parts) + " parts (1.." +
                                    std::to_string(CUDA_GEMV_MAX_PARTS) + ")");
    cuda::Parts P{};
    for (int i = 0; i < n_parts; ++i) P.p[i] = parts[i];
    P.n = n_parts;
    using cuda::launch_type;
    switch (t) {
        case QType::Q4_0: launch_type<QType::Q4_0>(M, P, xq, xds, K, stream); break;
        case QType::Q4_1: launch_type<QType::Q4_1>(M, P, xq, xds, K, stream); break;
        case QType::Q5_0: launch_type<QType::Q5_0>(M, P, xq, xds, K, stream); break;
        case QType::Q8_0: launch_type<QType::Q8_0>(M, P, xq, xds, K, stream); break;
        case QType::Q4_K: launch_type<QType::Q4_K>(M, P, xq, xds, K, stream); break;
        case QType::Q5_K: launch_type<QType::Q5_K>(M, P, xq, xds, K, stream); break;
        case QType::Q6_K: launch_type<QType::Q6_K>(M, P, xq, xds, K, stream); break;
        case QType::AWQ_G32: case QType::AWQ_G64: case QType::AWQ_G128: case QType::AWQ_G256:
            for (int i = 0; i < n_parts; ++i)  // AWQ rows keep a launch per matrix
                cuda::launch_awq(M, parts[i].w, parts[i].row_bytes, xq, xds, parts[i].y, parts[i].N, K,
                                 qtype_traits(static_cast<int>(t))->block_size, stream);
            break;
        case QType::Q4_0_TILED: case QType::Q8_0_TILED: case QType::Q4_K_TILED: case QType::Q6_K_TILED:
        case QType::AWQ_G32_TILED: case QType::AWQ_G64_TILED: case QType::AWQ_G128_TILED: case QType::AWQ_G256_TILED:
            gemv_tiled_parts_cuda(t, parts, n_parts, xq, xds, M, K, stream);  // gemv_tiled.cu
            break;
        default:
            throw std::invalid_argument(std::string("gemv_cuda: weight type ") + qtype_name(t) +
                                        " has no CUDA GEMV kernel (supported: Q4_0 Q4_1 Q5_0 Q8_0 Q4_K Q5_K Q6_K AWQ)");
    }
}

}  // namespace pyllm
