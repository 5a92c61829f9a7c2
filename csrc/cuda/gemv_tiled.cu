// Decode GEMV over the tiled weight layout (csrc/common/gemv_tiled.h): y[M, N] = x[M, K] @ W[N, K]^T for 1..8
// activation rows, W made at upload from Q4_0 / Q8_0 / Q4_K / Q6_K blocks or AWQ rows (QType::*_TILED).
//
// Shape of the work: a warp owns RW rows of one tile (rows_per_warp: 4 at M <= 2, else 2) and a slice of their K:
// lane l takes unit 32 g + l of groups g = s, s + W, ... (slice s of W).  Per group it issues RW * P 16-byte plane
// loads and the scales of its rows first (the first group's before griddepcontrol.wait), each load contiguous across
// the warp (512 bytes), then the activations of its unit once for all RW rows, then the dp4a dots.  A CTA is 4 warps:
// 4 / W row groups of W slices; the slices' sums meet in
// shared memory.  W (1, 2, 4) is picked per launch so the grid has at least ~24 warps per SM (the short-K shapes
// split K, the long-N ones do not); gemv_tiled_set_split forces it (tests, benchmarks).
//
// Why: at batch 1 the GEMV is a stream over W, so what matters is enough bytes in flight per SM (~30 KB on an
// H200) with every sector used.  The GGUF-order kernel (gemv.cu) puts one row (2-14 KB) behind each CTA and loads
// 2-byte-aligned blocks; here each warp has RW * P * 16 bytes per lane in flight per group and never a partial
// sector.  Sums are fp32 per lane in unit order, then the xor butterfly, then the slices in order: the host emulation
// (tiled::emulate_row) reproduces them bit for bit.
#include <string>

#include "../common/gemv_tiled.h"
#include "common.cuh"
#include "cuda_kernels.h"

namespace pyllm {
namespace cuda {
namespace {

using tiled::Act;
using tiled::Tiled;
using tiled::kLanes;
using tiled::kTileRows;

constexpr int kTiledThreads = 128;
constexpr int kTiledWarps = kTiledThreads / 32;

struct TiledParts {
    GemvPart p[CUDA_GEMV_MAX_PARTS];
    int cta_end[CUDA_GEMV_MAX_PARTS];
    int n;
};

// Rows per warp: 4 while the M activation rows' dots fit beside 4 rows' planes without spilling (M = 1, and M = 2
// for the 32-value units of Q4_0 / Q8_0 / AWQ), else 2 (the K-quants' 64-value units at M = 2: the output
// projection's two halves).
__host__ __device__ constexpr int rows_per_warp(QType t, int M) {
    return M == 1 || (M == 2 && (t == QType::Q4_0 || t == QType::Q8_0 || tiled::is_awq_rows(t))) ? 4 : 2;
}

// At M <= 2 at least 4 / 3 CTAs (16 / 12 warps) per SM: register room for a group's loads in flight with enough warps
// to hide their latency (left to itself the compiler double-buffers the planes at ~180 registers, 8 warps per SM).
__host__ __device__ constexpr int min_ctas(int M) {
    return M == 1 ? 4 : M == 2 ? 3 : 1;
}

template <QType T, int M, int RW, int W>
__global__ void __launch_bounds__(kTiledThreads, min_ctas(M)) gemv_tiled_kernel(const TiledParts parts, const int8_t* __restrict__ xq,
                                                                   const float2* __restrict__ xds, int K) {
    using Ty = Tiled<T>;
    constexpr int kGroupsPerCta = kTiledWarps / W;  // row groups of RW rows
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

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int slice = warp % W;
    int row0 = ((static_cast<int>(blockIdx.x) - cta0) * kGroupsPerCta + warp / W) * RW;
    const bool live = row0 < N;
    if (!live) row0 = N - RW;  // a last CTA's spare row groups redo the last rows and write nothing (N % 8 == 0)
    const auto tile = tiled::tile_at<T>(w, row_bytes, row0 / kTileRows);
    const int r0 = row0 % kTileRows;
    const int NU = K / Ty::kE, NG = (NU + kLanes - 1) / kLanes;
    const float* ds = reinterpret_cast<const float*>(xds);
    // The first group's weights are loaded before the wait: they are constant, so under a programmatic launch
    // (PYLLM_CUDA_PDL=1) they stream in while the kernel before this one drains.
    typename Ty::Frag f[RW] = {};
    if (slice < NG && kLanes * slice + lane < NU)
#pragma unroll
        for (int r = 0; r < RW; ++r) f[r] = Ty::load(tile, NU, kLanes * slice + lane, r0 + r);
    pdl_wait();

    float acc[M][RW];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < RW; ++r) acc[m][r] = 0.f;

    for (int g = slice; g < NG; g += W) {
        const int u = kLanes * g + lane;
        if (u < NU) {
            if (g != slice)
#pragma unroll
                for (int r = 0; r < RW; ++r) f[r] = Ty::load(tile, NU, u, r0 + r);
#pragma unroll
            for (int m = 0; m < M; ++m) {
                const typename Ty::X x = Ty::act(Act{xq + static_cast<size_t>(m) * K, ds + static_cast<size_t>(m) * (K / 16)}, u);
#pragma unroll
                for (int r = 0; r < RW; ++r) acc[m][r] = Ty::dot(f[r], u, x, acc[m][r]);
            }
        }
    }

    if constexpr (W == 1) {
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
            for (int r = 0; r < RW; ++r) {
                const float v = warp_sum(acc[m][r]);
                if (lane == m * RW + r && live) y[static_cast<size_t>(m) * N + row0 + r] = v;
            }
    } else {
        __shared__ float red[kTiledWarps][M * RW];
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
            for (int r = 0; r < RW; ++r) {
                const float v = warp_sum(acc[m][r]);
                if (lane == 0) red[warp][m * RW + r] = v;
            }
        __syncthreads();
        if (threadIdx.x < kGroupsPerCta * M * RW) {
            const int grp = threadIdx.x / (M * RW), i = threadIdx.x % (M * RW);
            const int row = ((static_cast<int>(blockIdx.x) - cta0) * kGroupsPerCta + grp) * RW + i % RW;
            float v = 0.f;
#pragma unroll
            for (int s = 0; s < W; ++s) v += red[grp * W + s][i];
            if (row < N) y[static_cast<size_t>(i / RW) * N + row] = v;
        }
    }
}

int forced_split = 0;  // gemv_tiled_set_split: 0 = pick_split's choice

// Weight slices per row group (see the file comment).
int pick_split(int64_t row_groups, int NG) {
    if (forced_split) return forced_split;
    static const int sms = [] {  // the first device's count: a launch (or a graph capture) asks no driver query
        int dev = 0, n = 0;
        return cudaGetDevice(&dev) == cudaSuccess &&
                       cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess && n > 0
                   ? n
                   : 132;
    }();
    int W = 1;
    while (W < 4 && 2 * W <= NG && row_groups * W < static_cast<int64_t>(sms) * 24) W *= 2;
    return W;
}

template <QType T, int M, int W>
void launch_split(TiledParts P, const int8_t* xq, const float2* xds, int K, cudaStream_t stream) {
    constexpr int RW = rows_per_warp(T, M);
    constexpr int rows_per_cta = kTiledWarps / W * RW;
    int ctas = 0;
    for (int i = 0; i < P.n; ++i) P.cta_end[i] = ctas += (P.p[i].N + rows_per_cta - 1) / rows_per_cta;
    launch_kernel("gemv_tiled_cuda", gemv_tiled_kernel<T, M, RW, W>, ctas, kTiledThreads, 0, stream, P, xq, xds, K);
}

template <QType T>
int split_of(int64_t rows, int K, int M) {
    const int NU = K / Tiled<T>::kE;
    return pick_split(rows / rows_per_warp(T, M), (NU + kLanes - 1) / kLanes);
}

template <QType T, int M>
void launch_m(const TiledParts& P, const int8_t* xq, const float2* xds, int K, cudaStream_t stream) {
    int64_t rows = 0;
    for (int i = 0; i < P.n; ++i) rows += P.p[i].N;
    switch (split_of<T>(rows, K, M)) {
        case 1: launch_split<T, M, 1>(P, xq, xds, K, stream); break;
        case 2: launch_split<T, M, 2>(P, xq, xds, K, stream); break;
        default: launch_split<T, M, 4>(P, xq, xds, K, stream); break;
    }
}

template <QType T>
void launch_type(int M, const TiledParts& P, const int8_t* xq, const float2* xds, int K, cudaStream_t stream) {
    switch (M) {
        case 1: launch_m<T, 1>(P, xq, xds, K, stream); break;
        case 2: launch_m<T, 2>(P, xq, xds, K, stream); break;
        case 3: launch_m<T, 3>(P, xq, xds, K, stream); break;
        case 4: launch_m<T, 4>(P, xq, xds, K, stream); break;
        case 5: launch_m<T, 5>(P, xq, xds, K, stream); break;
        case 6: launch_m<T, 6>(P, xq, xds, K, stream); break;
        case 7: launch_m<T, 7>(P, xq, xds, K, stream); break;
        case 8: launch_m<T, 8>(P, xq, xds, K, stream); break;
        default: throw std::invalid_argument("gemv_tiled_cuda: M=" + std::to_string(M) + " is outside 1.." +
                                             std::to_string(CUDA_GEMV_MAX_M));
    }
}

// One thread per (output row, unit): the unit's E values, exactly as gguf.quants (the tiled dequant() helpers use
// unfused products), stored as 16-byte vectors.
template <QType T, class Out>
__global__ void __launch_bounds__(256) dequant_tiled_kernel(const uint8_t* __restrict__ w, size_t row_bytes,
                                                            const int64_t* __restrict__ ids, int64_t n_out, int K,
                                                            Out* __restrict__ out) {
    using Ty = Tiled<T>;
    const int NU = K / Ty::kE;
    const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (t >= n_out * NU) return;
    const int64_t i = t / NU;
    const int u = static_cast<int>(t % NU);
    const int64_t src = ids ? ids[i] : i;
    float v[Ty::kE];
    Ty::dequant(tiled::tile_at<T>(w, row_bytes, src / kTileRows), NU, u, static_cast<int>(src % kTileRows), v);
    int first, second;
    tiled::unit_value_spans<T>(u, &first, &second);
#pragma unroll
    for (int span = 0; span < Ty::kE / 32; ++span) {
        Out* o = out + static_cast<size_t>(i) * K + (span ? second : first);
        const float* s = v + 32 * span;
        if constexpr (sizeof(Out) == 2) {
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                __half2 h[4];
#pragma unroll
                for (int j = 0; j < 4; ++j) h[j] = __floats2half2_rn(s[8 * q + 2 * j], s[8 * q + 2 * j + 1]);
                reinterpret_cast<int4*>(o)[q] = *reinterpret_cast<const int4*>(h);
            }
        } else {
#pragma unroll
            for (int q = 0; q < 8; ++q)
                reinterpret_cast<float4*>(o)[q] = make_float4(s[4 * q], s[4 * q + 1], s[4 * q + 2], s[4 * q + 3]);
        }
    }
}

template <QType T>
void launch_dequant(const uint8_t* w, size_t row_bytes, const int64_t* ids, int64_t n_out, int K, __half* of16,
                    float* of32, cudaStream_t stream) {
    const int64_t threads = n_out * (K / Tiled<T>::kE);
    if (threads == 0) return;
    const unsigned grid = static_cast<unsigned>((threads + 255) / 256);
    if (of16)
        dequant_tiled_kernel<T, __half><<<grid, 256, 0, stream>>>(w, row_bytes, ids, n_out, K, of16);
    else
        dequant_tiled_kernel<T, float><<<grid, 256, 0, stream>>>(w, row_bytes, ids, n_out, K, of32);
}

}  // namespace
}  // namespace cuda

void gemv_tiled_parts_cuda(QType t, const GemvPart* parts, int n_parts, const int8_t* xq, const float2* xds, int M,
                           int K, cudaStream_t stream) {
    if (n_parts < 1 || n_parts > CUDA_GEMV_MAX_PARTS)
        throw std::invalid_argument("gemv_tiled_cuda: " + std::to_string(n_parts) + " parts (1.." +
                                    std::to_string(CUDA_GEMV_MAX_PARTS) + ")");
    cuda::TiledParts P{};
    for (int i = 0; i < n_parts; ++i) P.p[i] = parts[i];
    P.n = n_parts;
    using cuda::launch_type;
    switch (t) {
        case QType::Q4_0_TILED: launch_type<QType::Q4_0>(M, P, xq, xds, K, stream); break;
        case QType::Q8_0_TILED: launch_type<QType::Q8_0>(M, P, xq, xds, K, stream); break;
        case QType::Q4_K_TILED: launch_type<QType::Q4_K>(M, P, xq, xds, K, stream); break;
        case QType::Q6_K_TILED: launch_type<QType::Q6_K>(M, P, xq, xds, K, stream); break;
        case QType::AWQ_G32_TILED: launch_type<QType::AWQ_G32>(M, P, xq, xds, K, stream); break;
        case QType::AWQ_G64_TILED: launch_type<QType::AWQ_G64>(M, P, xq, xds, K, stream); break;
        case QType::AWQ_G128_TILED: launch_type<QType::AWQ_G128>(M, P, xq, xds, K, stream); break;
        case QType::AWQ_G256_TILED: launch_type<QType::AWQ_G256>(M, P, xq, xds, K, stream); break;
        default:
            throw std::invalid_argument(std::string("gemv_tiled_cuda: weight type ") + qtype_name(t) +
                                        " is not a tiled layout (Q4_0_TILED Q8_0_TILED Q4_K_TILED Q6_K_TILED "
                                        "AWQ_G*_TILED)");
    }
}

void gemv_tiled_set_split(int split) {
    if (split != 0 && split != 1 && split != 2 && split != 4)
        throw std::invalid_argument("gemv_tiled_set_split: split " + std::to_string(split) + " is not 0 (auto), 1, 2 or 4");
    cuda::forced_split = split;
}

int gemv_tiled_split(QType t, int64_t rows, int K, int M) {
    switch (t) {
        case QType::Q4_0_TILED: return cuda::split_of<QType::Q4_0>(rows, K, M);
        case QType::Q8_0_TILED: return cuda::split_of<QType::Q8_0>(rows, K, M);
        case QType::Q4_K_TILED: return cuda::split_of<QType::Q4_K>(rows, K, M);
        case QType::Q6_K_TILED: return cuda::split_of<QType::Q6_K>(rows, K, M);
        case QType::AWQ_G32_TILED: return cuda::split_of<QType::AWQ_G32>(rows, K, M);
        case QType::AWQ_G64_TILED: return cuda::split_of<QType::AWQ_G64>(rows, K, M);
        case QType::AWQ_G128_TILED: return cuda::split_of<QType::AWQ_G128>(rows, K, M);
        case QType::AWQ_G256_TILED: return cuda::split_of<QType::AWQ_G256>(rows, K, M);
        default: throw std::invalid_argument(std::string("gemv_tiled_split: ") + qtype_name(t) + " is not a tiled layout");
    }
}

void dequantize_tiled_cuda(QType t, const uint8_t* w, size_t row_bytes, const int64_t* ids, int64_t n_out, int K,
                           __half* out_f16, float* out_f32, cudaStream_t stream) {
    using cuda::launch_dequant;
    switch (t) {
        case QType::Q4_0_TILED: launch_dequant<QType::Q4_0>(w, row_bytes, ids, n_out, K, out_f16, out_f32, stream); break;
        case QType::Q8_0_TILED: launch_dequant<QType::Q8_0>(w, row_bytes, ids, n_out, K, out_f16, out_f32, stream); break;
        case QType::Q4_K_TILED: launch_dequant<QType::Q4_K>(w, row_bytes, ids, n_out, K, out_f16, out_f32, stream); break;
        case QType::Q6_K_TILED: launch_dequant<QType::Q6_K>(w, row_bytes, ids, n_out, K, out_f16, out_f32, stream); break;
        case QType::AWQ_G32_TILED: launch_dequant<QType::AWQ_G32>(w, row_bytes, ids, n_out, K, out_f16, out_f32, stream); break;
        case QType::AWQ_G64_TILED: launch_dequant<QType::AWQ_G64>(w, row_bytes, ids, n_out, K, out_f16, out_f32, stream); break;
        case QType::AWQ_G128_TILED: launch_dequant<QType::AWQ_G128>(w, row_bytes, ids, n_out, K, out_f16, out_f32, stream); break;
        case QType::AWQ_G256_TILED: launch_dequant<QType::AWQ_G256>(w, row_bytes, ids, n_out, K, out_f16, out_f32, stream); break;
        default:
            throw std::invalid_argument(std::string("dequantize_tiled_cuda: type ") + qtype_name(t) +
                                        " is not a tiled layout");
    }
    cuda::check_launch("dequantize_tiled_cuda");
}

}  // namespace pyllm
