// Decode attention (one new token) over a KV cache of any row type, flash-decoding style.
//
// The same attention as the CPU step (csrc/cpu/decode_step.cpp + attention.cpp), in the cache's storage basis:
// the caller passes the query already mapped into the keys' basis ((q * s) R^T for scaled / rotated keys) and
// maps the output back (o R + mu_v for rotated / centered values); keys and values are read from their stored
// rows (f32, f16, bf16, q8_0 or q4_0, K and V typed apart), position 0 from the part's exact float sink row when
// it keeps one, over positions max(0, len - window) .. len - 1 (window 0: all), with the scaled logits
// optionally soft-capped (cap * tanh(s / cap)).  The CPU merges the sink row's softmax with the other rows' by
// their log-sum-exps; here it is one more position of the same softmax -- the same value, computed in one pass.
//
// Why split-K: at batch 1 there are only Hkv (8 for Llama-3-8B) KV heads, far too few CTAs to stream a long
// cache at full bandwidth, so the positions are cut into chunks of kChunk and every (KV head, chunk, group of
// up to 8 query heads) gets its own CTA; a second kernel merges the chunks' softmax partials.  All query heads
// sharing a KV head sit in one CTA, so each K/V row is read once per token (GQA).
//
// The valid length is read from device memory, so one captured CUDA graph serves every position; the grid
// is sized by max_seq and CTAs outside the window exit at once.
#include <cfloat>

#include "act_codes.cuh"
#include "common.cuh"
#include "cuda_kernels.h"
#include "kv_rows.cuh"

namespace pyllm {
namespace cuda {
namespace {

// A CTA's warps walk its positions one row per warp (scores) or per thread group (values).  Each row is a load
// whose latency nothing else hides unless several are in flight: 256 positions over 4 warps, one row at a time,
// took 146 us per layer on an H200 (profiled, Llama-3-8B shape at position ~320), 62% of the step.  So a chunk
// is half that over twice the warps, and each warp (thread group) issues the loads of a batch of its rows before
// it uses any: one load's latency per batch instead of per row.
constexpr int kChunk = 128;    // positions per CTA
constexpr int kThreads = 256;  // 8 warps
constexpr int kWarps = kThreads / 32;
constexpr int kMaxG = 8;       // query heads per CTA (more per KV head: more CTAs along grid.z)

// Rows c0 + p0 + b * stride (b < B) of head hk, values d0 + 64 j and d0 + 64 j + 1 (j < J); rows at or past n
// read as zeros.  Every load of the batch is issued before any value is decoded, with no branch between them
// (rows past n load row n - 1, then decode to zero), and the row type is switched on once per batch, outside it:
// a load followed by its use, or in a branch of its own, waits for that load before the next one is issued.
template <KVRow T, int B, int J>
__device__ __forceinline__ void load_rows_typed(const AttnRows& r, int hk, int c0, int p0, int stride, int n, int d0,
                                                int max_seq, float2 (&out)[B][J]) {
    const uint8_t* base = r.data + (static_cast<size_t>(hk) * max_seq + c0) * r.row_bytes;
    KVRaw raw[B][J];
#pragma unroll
    for (int b = 0; b < B; ++b) {
        const int p = min(p0 + b * stride, n - 1);
#pragma unroll
        for (int j = 0; j < J; ++j) raw[b][j] = kv_raw<T>(base + static_cast<size_t>(p) * r.row_bytes, d0 + 64 * j);
    }
#pragma unroll
    for (int b = 0; b < B; ++b)
#pragma unroll
        for (int j = 0; j < J; ++j)
            out[b][j] = p0 + b * stride < n ? kv_decode<T>(raw[b][j], d0 + 64 * j) : make_float2(0.f, 0.f);
}

// load_rows_typed for the part's row type; position 0 from the exact sink row when the part keeps one.
template <int B, int J>
__device__ __forceinline__ void load_rows(const AttnRows& r, int hk, int c0, int p0, int stride, int n, int d0,
                                          int max_seq, int D, float2 (&out)[B][J]) {
    switch (r.type) {
        case KVRow::F32: load_rows_typed<KVRow::F32>(r, hk, c0, p0, stride, n, d0, max_seq, out); break;
        case KVRow::F16: load_rows_typed<KVRow::F16>(r, hk, c0, p0, stride, n, d0, max_seq, out); break;
        case KVRow::BF16: load_rows_typed<KVRow::BF16>(r, hk, c0, p0, stride, n, d0, max_seq, out); break;
        case KVRow::Q8_0: load_rows_typed<KVRow::Q8_0>(r, hk, c0, p0, stride, n, d0, max_seq, out); break;
        case KVRow::Q4_0: load_rows_typed<KVRow::Q4_0>(r, hk, c0, p0, stride, n, d0, max_seq, out); break;
    }
    if (r.sink && c0 + p0 == 0)  // row b = 0 is position 0
#pragma unroll
        for (int j = 0; j < J; ++j)
            out[0][j] = *reinterpret_cast<const float2*>(r.sink + static_cast<size_t>(hk) * D + d0 + 64 * j);
}

// The positions [lo, len) attended to (device: len is read there).
__device__ __forceinline__ int window_start(int L, int window) { return window > 0 ? max(0, L - window) : 0; }

// part_o [H, chunks, D]: unnormalized sum_p exp(s_p - m) v_p of one chunk; part_ml [H, chunks, 2]: (m, l).
// (At least 2 CTAs per SM: left to itself ptxas held head_dim 64 to 64 registers and spilled the key batch.)
template <int D>
__global__ void __launch_bounds__(kThreads, 2) attn_chunk_kernel(const float* __restrict__ q, AttnRows k, AttnRows v,
                                                              const int* __restrict__ len, int window, float softcap,
                                                              float* __restrict__ part_o,
                                                              float* __restrict__ part_ml, int H, int Hkv,
                                                              int max_seq, int chunks, float scale) {
    constexpr int kPairs = D / 2;              // value pairs of a row
    constexpr int kPerLane = D / 64;           // pairs per lane when a warp reads one row
    constexpr int kGroups = kThreads / kPairs; // position groups in the V pass
    // rows in flight per warp (scores: 32 registers of keys at most) and per thread (values)
    constexpr int kKeyBatch = kChunk / kWarps < 16 / kPerLane ? kChunk / kWarps : 16 / kPerLane;
    constexpr int kValueBatch = kChunk / kGroups < 16 ? kChunk / kGroups : 16;
    static_assert(kPerLane >= 1 && kThreads % kPairs == 0, "head_dim must be 64, 128 or 256");

    pdl_trigger();
    pdl_wait();
    const int L = *len, lo = window_start(L, window);
    const int hk = blockIdx.x, c = blockIdx.y;
    const int c0 = max(c * kChunk, lo), c1 = min((c + 1) * kChunk, L);
    if (c0 >= c1) return;  // the merge skips chunks outside [lo, L)
    const int n = c1 - c0;
    const int G = H / Hkv, g0 = blockIdx.z * kMaxG, Gc = min(kMaxG, G - g0);
    const int h0 = hk * G + g0;  // first query head of this CTA
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float inv_cap = softcap > 0.f ? 1.f / softcap : 0.f;  // no IEEE division (a call) per score

    // This chunk's key and value rows are contiguous: ask L2 for all of them now, so the key batches after the
    // first and the value pass (after two barriers) find them there instead of waiting on HBM again.
    prefetch_l2(k.data + (static_cast<size_t>(hk) * max_seq + c0) * k.row_bytes, n * k.row_bytes);
    prefetch_l2(v.data + (static_cast<size_t>(hk) * max_seq + c0) * v.row_bytes, n * v.row_bytes);

    __shared__ __align__(8) float q_s[kMaxG][D];  // read as float2
    __shared__ float p_s[kMaxG][kChunk];
    __shared__ float red[kGroups][kMaxG][D];
    __shared__ float m_s[kMaxG], l_s[kMaxG];

    for (int i = threadIdx.x; i < Gc * D; i += kThreads) q_s[i / D][i % D] = q[static_cast<size_t>(h0) * D + i] * scale;
    __syncthreads();

    // scores: one warp per position, lanes across the row; a warp's rows kKeyBatch at a time, all loaded first.
    // Per query head, every row's partial dot then every row's butterfly step at once: kKeyBatch independent
    // shuffles in flight per step.  One row's five dependent shuffles at a time (~150 cycles, 64 times for 16 rows
    // and 4 heads) held the kernel to ~19 us per layer at 128 positions a CTA on an H200, its loads batched or not.
    for (int p0 = warp; p0 < n; p0 += kWarps * kKeyBatch) {
        float2 kf[kKeyBatch][kPerLane];  // rows p0 + b * kWarps: the same for every lane, no divergence
        load_rows(k, hk, c0, p0, kWarps, n, 2 * lane, max_seq, D, kf);
        for (int g = 0; g < Gc; ++g) {
            float2 qv[kPerLane];
#pragma unroll
            for (int j = 0; j < kPerLane; ++j) qv[j] = *reinterpret_cast<const float2*>(&q_s[g][2 * (lane + 32 * j)]);
            float s[kKeyBatch];
#pragma unroll
            for (int b = 0; b < kKeyBatch; ++b) {  // rows past n were read as zeros: their scores are not stored
                s[b] = 0.f;
#pragma unroll
                for (int j = 0; j < kPerLane; ++j) s[b] += qv[j].x * kf[b][j].x + qv[j].y * kf[b][j].y;
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1)
#pragma unroll
                for (int b = 0; b < kKeyBatch; ++b) s[b] += __shfl_xor_sync(0xffffffffu, s[b], o);
#pragma unroll
            for (int b = 0; b < kKeyBatch; ++b) {
                const int p = p0 + b * kWarps;
                float sb = s[b];
                if (softcap > 0.f) sb = softcap * tanhf(sb * inv_cap);
                if (lane == 0 && p < n) p_s[g][p] = sb;
            }
        }
    }
    __syncthreads();

    // softmax numerators per query head
    for (int g = warp; g < Gc; g += kWarps) {
        float m = -FLT_MAX;
        for (int p = lane; p < n; p += 32) m = fmaxf(m, p_s[g][p]);
        m = warp_max(m);
        float l = 0.f;
        for (int p = lane; p < n; p += 32) {
            const float e = __expf(p_s[g][p] - m);
            p_s[g][p] = e;
            l += e;
        }
        l = warp_sum(l);
        if (lane == 0) {
            m_s[g] = m;
            l_s[g] = l;
        }
    }
    __syncthreads();

    // weighted V: thread = (column pair, position group); a group of kPairs threads reads one V row
    const int cp = threadIdx.x % kPairs, pg = threadIdx.x / kPairs;
    float2 acc[kMaxG];
#pragma unroll
    for (int g = 0; g < kMaxG; ++g) acc[g] = make_float2(0.f, 0.f);
    for (int p0 = pg; p0 < n; p0 += kGroups * kValueBatch) {  // kValueBatch rows loaded, then summed in order
        float2 vf[kValueBatch][1];  // a position group is whole warps: p is the same across a warp
        load_rows(v, hk, c0, p0, kGroups, n, 2 * cp, max_seq, D, vf);
#pragma unroll
        for (int b = 0; b < kValueBatch; ++b) {
            const int p = p0 + b * kGroups;
            if (p >= n) break;
#pragma unroll
            for (int g = 0; g < kMaxG; ++g) {
                if (g < Gc) {
                    const float e = p_s[g][p];
                    acc[g].x += e * vf[b][0].x;
                    acc[g].y += e * vf[b][0].y;
                }
            }
        }
    }
#pragma unroll
    for (int g = 0; g < kMaxG; ++g) {
        red[pg][g][2 * cp] = acc[g].x;
        red[pg][g][2 * cp + 1] = acc[g].y;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < Gc * D; i += kThreads) {
        const int g = i / D, d = i % D;
        float o = 0.f;
#pragma unroll
        for (int j = 0; j < kGroups; ++j) o += red[j][g][d];
        part_o[(static_cast<size_t>(h0 + g) * chunks + c) * D + d] = o;
    }
    if (threadIdx.x < Gc) {
        float* ml = part_ml + (static_cast<size_t>(h0 + threadIdx.x) * chunks + c) * 2;
        ml[0] = m_s[threadIdx.x];
        ml[1] = l_s[threadIdx.x];
    }
}

// out[h, d] = sum_c e^(m_c - M) o_c[d] / sum_c e^(m_c - M) l_c over the chunks that hold attended positions;
// with xq, also out's int8 codes for the output projection (the flat [H * D] row, 32 values per scale): a warp
// holds 32 consecutive values of one head (D and blockDim.x are multiples of 32), one launch fewer per layer.
__global__ void attn_merge_kernel(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                  const int* __restrict__ len, int window, float* __restrict__ out, int D,
                                  int chunks, int8_t* __restrict__ xq, float2* __restrict__ xds) {
    pdl_trigger();
    pdl_wait();
    const int h = blockIdx.x;
    const int L = *len;
    const int cb = window_start(L, window) / kChunk, ce = min(chunks, (L + kChunk - 1) / kChunk);
    const float* ml = part_ml + static_cast<size_t>(h) * chunks * 2;
    float M = -FLT_MAX;
    for (int c = cb; c < ce; ++c) M = fmaxf(M, ml[2 * c]);
    float den = 0.f;
    for (int c = cb; c < ce; ++c) den += __expf(ml[2 * c] - M) * ml[2 * c + 1];
    const float inv = den > 0.f ? 1.f / den : 0.f;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float num = 0.f;
        for (int c = cb; c < ce; ++c)
            num += __expf(ml[2 * c] - M) * part_o[(static_cast<size_t>(h) * chunks + c) * D + d];
        out[static_cast<size_t>(h) * D + d] = num * inv;
        if (xq != nullptr) quantize_block(num * inv, xq, xds, h * D + (d & ~31));
    }
}

template <int D>
void launch(const float* q, const AttnRows& k, const AttnRows& v, const int* len, int window, float softcap,
            float* part_o, float* part_ml, float* out, int H, int Hkv, int max_seq, float scale, int8_t* xq,
            float2* xds, cudaStream_t stream) {
    const int chunks = attn_decode_chunks(max_seq);
    const int G = H / Hkv;
    const dim3 grid(Hkv, chunks, (G + kMaxG - 1) / kMaxG);
    launch_kernel("attn_decode_cuda (chunks)", attn_chunk_kernel<D>, grid, kThreads, 0, stream, q, k, v, len, window,
                  softcap, part_o, part_ml, H, Hkv, max_seq, chunks, scale);
    launch_kernel("attn_decode_cuda (merge)", attn_merge_kernel, H, D < 256 ? D : 256, 0, stream, part_o, part_ml,
                  len, window, out, D, chunks, xq, xds);
}

}  // namespace
}  // namespace cuda

bool attn_decode_supported_head_dim(int D) { return D == 64 || D == 128 || D == 256; }

int attn_decode_chunks(int max_seq) { return (max_seq + cuda::kChunk - 1) / cuda::kChunk; }

void attn_decode_cuda(const float* q, const AttnRows& k, const AttnRows& v, const int* len, int window,
                      float softcap, float* part_o, float* part_ml, float* out, int H, int Hkv, int D, int max_seq,
                      float scale, cudaStream_t stream, int8_t* xq, float2* xds) {
    using cuda::launch;
    switch (D) {
        case 64:
            launch<64>(q, k, v, len, window, softcap, part_o, part_ml, out, H, Hkv, max_seq, scale, xq, xds, stream);
            break;
        case 128:
            launch<128>(q, k, v, len, window, softcap, part_o, part_ml, out, H, Hkv, max_seq, scale, xq, xds, stream);
            break;
        case 256:
            launch<256>(q, k, v, len, window, softcap, part_o, part_ml, out, H, Hkv, max_seq, scale, xq, xds, stream);
            break;
        default:
            throw std::invalid_argument("attn_decode_cuda: head_dim " + std::to_string(D) +
                                        " is not supported (64, 128, 256)");
    }
}

}  // namespace pyllm
