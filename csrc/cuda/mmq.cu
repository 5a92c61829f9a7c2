// Prefill matrix multiply on int8 tensor cores (llama.cpp's MMQ idea): y[M, N] = x[M, K] @ W[N, K]^T for prompt
// chunks, W in the tiled layout (Q4_0 / Q8_0 / Q4_K / Q6_K, csrc/common/gemv_tiled.h), x as quantize_act_cuda's int8
// codes.  The per-type staging and scaling are csrc/common/mmq.h's, shared with the host emulation.
//
// Shape of the work: a CTA of 8 warps owns kRows = 128 weight rows and BM tokens (64, or 32 for short chunks) and
// walks K in tiles of 256 values.  Per tile, the tokens' codes and scales go to shared memory by cp.async while the
// threads load the weights' units with the tiled GEMV's own loads (every sector used) and stage them as int8 codes
// plus a Meta per row and 32-value block; then each warp (32 rows x BM / 2 tokens) reads its A (weights) and B
// (tokens) fragments with ldmatrix and issues one mma.sync.m16n8k32 s8 per 32-value block and (m16, n8) tile (two
// m16n8k16 for Q6_K, whose scales cover 16 values), and scales each block's int32 sums into fp32 accumulators in
// registers (Mmq<T>::combine, in block order, so the host emulation gives the same bits).  The grid's x runs over
// token tiles, so the CTAs that share a weight tile run together and read it from HBM about once.
//
// Why: the dequantize + cuBLAS prefill writes each weight out as fp16 and reads it back per chunk (2 bytes per
// weight, twice, where the file has ~0.6) and multiplies in fp16; here the weights are read in their quantized bytes
// and multiplied at int8 rate.  Tile sizes follow llama.cpp's (mmq_y = 128 rows, MMQ_ITER_K = 256, 8 warps).
// Shared memory: 66 KB at BM = 64, so two CTAs per SM on sm_80 / sm_90 (one on sm_86 / sm_89).
#include <algorithm>
#include <string>

#include "../common/mmq.h"
#include "common.cuh"
#include "cuda_kernels.h"

namespace pyllm {
namespace cuda {
namespace {

using mmq::kBlocksPerTile;
using mmq::kMetaStride;
using mmq::kRowBytes;
using mmq::kRows;
using mmq::kTileK;
using mmq::Meta;
using mmq::Mmq;
using tiled::Tiled;

constexpr int kMmqThreads = 256;  // 8 warps: 4 over the CTA's rows x 2 over its tokens
constexpr int kWarpRows = 32;     // two m16 tiles per warp

template <int BM>
constexpr size_t mmq_smem_bytes() {
    return static_cast<size_t>(kRows + BM) * kRowBytes + static_cast<size_t>(kRows) * kMetaStride * sizeof(Meta) +
           static_cast<size_t>(BM) * kMetaStride * sizeof(float2);
}

// The sm_80 instructions, compiled only for sm_80 and later (an older target in the build gets a kernel that traps;
// the launcher never runs it: mmq_cuda_supported checks the device).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async8(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
// Four 8 x 16-byte matrices; lane l gives the address of row l % 8 of matrix l / 8 and receives in r[i] bytes
// 4 (l % 4) .. + 3 of row l / 4 of matrix i: the s8 MMA fragment layout.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const int8_t* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p))
                 : "memory");
}
// c[16 x 8] += a[16 x 32] b[32 x 8] (a: rows g, g + 8 x bytes 4t.., 16 + 4t..; b: bytes 4t.., 16 + 4t.. of column g)
__device__ __forceinline__ void mma_k32(int (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_k16(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t b) {
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(b));
}
#endif

// w: N rows (N % 8 == 0) of row_bytes in the tiled layout of T; xq [M, K] int8, xds [M, K / 32] (d, d * sum);
// y [M, N].  Grid: (token tiles, row tiles).
template <QType T, int BM>
__global__ void __launch_bounds__(kMmqThreads, 2)
    mmq_kernel(const uint8_t* __restrict__ w, size_t row_bytes, int N, const int8_t* __restrict__ xq,
               const float2* __restrict__ xds, int M, int K, float* __restrict__ y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    using Ty = Tiled<T>;
    using Mm = Mmq<T>;
    constexpr int kUnits = Mm::kUnitsPerTile;                   // tiled units per row per K tile
    constexpr int kItems = kRows * kUnits / kMmqThreads;        // units a thread stages per tile
    constexpr int kChunks = BM * (kTileK / 16) / kMmqThreads;   // 16-byte activation pieces a thread copies
    constexpr int kTok = BM / 2;                                // tokens per warp
    constexpr int kNT = kTok / 8;                               // n8 tiles per warp
    static_assert(kItems * kMmqThreads == kRows * kUnits && kChunks * kMmqThreads == BM * (kTileK / 16) &&
                      kNT % 2 == 0,
                  "tile shape");

    extern __shared__ uint4 smem[];
    int8_t* const sw = reinterpret_cast<int8_t*>(smem);                       // [kRows][kRowBytes] weight codes
    int8_t* const sx = sw + kRows * kRowBytes;                                // [BM][kRowBytes] token codes
    Meta* const mw = reinterpret_cast<Meta*>(sx + BM * kRowBytes);            // [kRows][kMetaStride]
    float2* const mx = reinterpret_cast<float2*>(mw + kRows * kMetaStride);   // [BM][kMetaStride] (d, d * sum)

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int tok0 = static_cast<int>(blockIdx.x) * BM, row0 = static_cast<int>(blockIdx.y) * kRows;
    const int NU = K / Ty::kE, nblk = K / 32;
    const int ntiles = (nblk + kBlocksPerTile - 1) / kBlocksPerTile;
    const int last_group = N / tiled::kTileRows - 1;

    // This warp's 32 rows and kTok tokens; ldmatrix addresses of its lane: A matrices 0..3 = rows 0-7 / 8-15 x bytes
    // 0-15, then the same x bytes 16-31; B matrices 0..3 = tokens 0-7 bytes 0-15 / 16-31, tokens 8-15 the same.
    const int wrow = (warp & 3) * kWarpRows, wtok = (warp >> 2) * kTok;
    const int g = lane >> 2, t = lane & 3;
    const int8_t* const a_ptr = sw + (wrow + (lane & 7) + ((lane >> 3) & 1) * 8) * kRowBytes + (lane >> 4) * 16;
    const int8_t* const b_ptr = sx + (wtok + (lane & 7) + ((lane >> 4) & 1) * 8) * kRowBytes + ((lane >> 3) & 1) * 16;

    float acc[2][kNT][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[mt][nt][q] = 0.f;

    for (int kt = 0; kt < ntiles; ++kt) {
        const int nb = min(kBlocksPerTile, nblk - kt * kBlocksPerTile);  // blocks in this tile (short only at K's end)
        // tokens past M copy the last token (their sums are never written)
#pragma unroll
        for (int j = 0; j < kChunks; ++j) {
            const int c = tid + kMmqThreads * j, tok = c / (kTileK / 16), piece = c % (kTileK / 16);
            if (piece < 2 * nb)
                cp_async16(sx + tok * kRowBytes + 16 * piece,
                           xq + static_cast<size_t>(min(tok0 + tok, M - 1)) * K + kt * kTileK + 16 * piece);
        }
        for (int s = tid; s < BM * kBlocksPerTile; s += kMmqThreads) {
            const int tok = s / kBlocksPerTile, b = s % kBlocksPerTile;
            if (b < nb)
                cp_async8(mx + tok * kMetaStride + b,
                          xds + static_cast<size_t>(min(tok0 + tok, M - 1)) * nblk + kt * kBlocksPerTile + b);
        }
        // staged row i / kUnits takes unit i % kUnits of this tile; rows past N stage the last tile of rows again
        typename Ty::Frag f[kItems] = {};
#pragma unroll
        for (int j = 0; j < kItems; ++j) {
            const int i = tid + kMmqThreads * j, row = i / kUnits, u = kt * kUnits + i % kUnits;
            const int grp = min(row0 / tiled::kTileRows + row / tiled::kTileRows, last_group);
            if (u < NU)
                f[j] = Ty::load(w + static_cast<size_t>(grp) * tiled::kTileRows * row_bytes, NU, u,
                                row % tiled::kTileRows);
        }
#pragma unroll
        for (int j = 0; j < kItems; ++j) {
            const int i = tid + kMmqThreads * j, row = i / kUnits, u = kt * kUnits + i % kUnits;
            if (u < NU) Mm::unpack(f[j], u, sw + row * kRowBytes, mw + row * kMetaStride);
        }
        cp_async_wait_all();
        __syncthreads();

#pragma unroll
        for (int b = 0; b < kBlocksPerTile; ++b) {
            if (b >= nb) break;
            uint32_t bx[kNT][2];
#pragma unroll
            for (int p = 0; p < kNT / 2; ++p) {
                uint32_t r[4];
                ldmatrix_x4(r, b_ptr + p * 16 * kRowBytes + 32 * b);
                bx[2 * p][0] = r[0], bx[2 * p][1] = r[1], bx[2 * p + 1][0] = r[2], bx[2 * p + 1][1] = r[3];
            }
            // one m16 tile at a time, its rows' and then each n8 tile's scales loaded where used: holding both
            // m16 tiles' fragments and every tile's scales at once spilled Q4_K at BM = 64
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                uint32_t a[4];
                ldmatrix_x4(a, a_ptr + 16 * mt * kRowBytes + 32 * b);
                const Meta wm[2] = {mw[(wrow + 16 * mt + g) * kMetaStride + b],
                                    mw[(wrow + 16 * mt + 8 + g) * kMetaStride + b]};
#pragma unroll
                for (int nt = 0; nt < kNT; ++nt) {
                    const float2 xm[2] = {mx[(wtok + 8 * nt + 2 * t) * kMetaStride + b],
                                          mx[(wtok + 8 * nt + 2 * t + 1) * kMetaStride + b]};
                    int c_lo[4] = {0, 0, 0, 0}, c_hi[4] = {0, 0, 0, 0};
                    if constexpr (Mm::kHalves) {
                        mma_k16(c_lo, a[0], a[1], bx[nt][0]);
                        mma_k16(c_hi, a[2], a[3], bx[nt][1]);
                    } else {
                        mma_k32(c_lo, a, bx[nt][0], bx[nt][1]);
                    }
                    // element q: row g + 8 (q / 2) of the m16 tile, token 2t + q % 2 of the n8 tile
#pragma unroll
                    for (int q = 0; q < 4; ++q)
                        acc[mt][nt][q] = Mm::combine(wm[q >> 1], xm[q & 1].x, xm[q & 1].y, c_lo[q], c_hi[q],
                                                     acc[mt][nt][q]);
                }
            }
        }
        __syncthreads();  // the next tile overwrites what this one read
    }

#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int row = row0 + wrow + 16 * mt + 8 * (q >> 1) + g, tok = tok0 + wtok + 8 * nt + 2 * t + (q & 1);
                if (row < N && tok < M) y[static_cast<size_t>(tok) * N + row] = acc[mt][nt][q];
            }
#else
    __trap();
#endif
}

template <QType T, int BM>
void launch_bm(const uint8_t* w, size_t row_bytes, int N, const int8_t* xq, const float2* xds, int M, int K, float* y,
               cudaStream_t stream) {
    constexpr size_t smem = mmq_smem_bytes<BM>();
    void (*kernel)(const uint8_t*, size_t, int, const int8_t*, const float2*, int, int, float*) = mmq_kernel<T, BM>;
    // above 48 KB a kernel must ask for its dynamic shared memory (per device; cheap to repeat)
    const cudaError_t e =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (e != cudaSuccess)
        throw std::runtime_error(std::string("mmq_cuda: cannot reserve ") + std::to_string(smem) +
                                 " bytes of shared memory: " + cudaGetErrorString(e));
    const dim3 grid(static_cast<unsigned>((M + BM - 1) / BM), static_cast<unsigned>((N + kRows - 1) / kRows));
    kernel<<<grid, kMmqThreads, smem, stream>>>(w, row_bytes, N, xq, xds, M, K, y);
    check_launch("mmq_cuda");
}

template <QType T>
void launch_type(const uint8_t* w, size_t row_bytes, int N, const int8_t* xq, const float2* xds, int M, int K,
                 float* y, cudaStream_t stream) {
    if (M <= 32)
        launch_bm<T, 32>(w, row_bytes, N, xq, xds, M, K, y, stream);
    else
        launch_bm<T, 64>(w, row_bytes, N, xq, xds, M, K, y, stream);
}

}  // namespace
}  // namespace cuda

bool mmq_cuda_supported(QType t, int device) {
    if (!mmq::mmq_type(t)) return false;
    int major = 0;
    return cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && major >= 8;
}

void mmq_cuda(QType t, const uint8_t* w, size_t row_bytes, int N, const int8_t* xq, const float2* xds, int M, int K,
              float* y, cudaStream_t stream) {
    if (M < 1 || N < tiled::kTileRows || N % tiled::kTileRows || K < 32 || K % 32)
        throw std::invalid_argument("mmq_cuda: M=" + std::to_string(M) + " N=" + std::to_string(N) + " K=" +
                                    std::to_string(K) + " (M >= 1, N a multiple of 8, K of 32)");
    if ((N + mmq::kRows - 1) / mmq::kRows > 65535)
        throw std::invalid_argument("mmq_cuda: N=" + std::to_string(N) + " rows is more than the grid takes (" +
                                    std::to_string(65535 * mmq::kRows) + ")");
    using cuda::launch_type;
    switch (t) {
        case QType::Q4_0_TILED: launch_type<QType::Q4_0>(w, row_bytes, N, xq, xds, M, K, y, stream); break;
        case QType::Q8_0_TILED: launch_type<QType::Q8_0>(w, row_bytes, N, xq, xds, M, K, y, stream); break;
        case QType::Q4_K_TILED: launch_type<QType::Q4_K>(w, row_bytes, N, xq, xds, M, K, y, stream); break;
        case QType::Q6_K_TILED: launch_type<QType::Q6_K>(w, row_bytes, N, xq, xds, M, K, y, stream); break;
        default:
            throw std::invalid_argument(std::string("mmq_cuda: weight type ") + qtype_name(t) +
                                        " has no MMQ kernel (Q4_0_TILED Q8_0_TILED Q4_K_TILED Q6_K_TILED)");
    }
}

}  // namespace pyllm
