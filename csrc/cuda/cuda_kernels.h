// Every CUDA launcher: raw device pointers, sizes and an explicit stream (always the last argument), no
// torch.  csrc/cuda/bindings_cuda.cpp checks tensors and calls these; launchers assume valid sizes and
// throw std::invalid_argument (unsupported type, naming it) or std::runtime_error (launch failure).
//
// Shapes use torch order: a weight is N rows of K values, each row K / block_size GGUF blocks of
// row_bytes bytes, rows back to back.  x: [M, K] fp32, y: [M, N] fp32, all row-major and contiguous.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "../common/arch.h"
#include "../common/limits.h"
#include "../common/qtype.h"
#include "kv_rows.cuh"

namespace pyllm {

// ---- decode GEMV (gemv.cu) --------------------------------------------------------------------------------
constexpr int CUDA_GEMV_MAX_M = GEMV_MAX_M;  // above this many activation rows, dequantize + cuBLAS wins (prefill)

// Types the fused GEMV handles: Q4_0 Q4_1 Q5_0 Q8_0 Q4_K Q5_K Q6_K, and AWQ int4 rows (QType::AWQ_G*, the
// layout of csrc/common/blocks.h AwqRow that pyllm/awq.py repacks AutoAWQ tensors into at load).
bool gemv_cuda_supported(QType t);

// Weight-pointer alignment the GEMV needs for type t (16 for Q4_K/Q5_K, whose 16-byte loads need it).
int gemv_cuda_alignment(QType t);

// x [M, K] fp32 -> xq int8 [M, K] + xds float2 [M, K/32] = (d, d * sum(codes)) per 32 values.
// K % 32 == 0, 1 <= M.
void quantize_act_cuda(const float* x, int8_t* xq, float2* xds, int M, int K, cudaStream_t stream);

// y_p[m, n] = sum_k x[m, k] * W_p[n, k] for 1 <= M <= CUDA_GEMV_MAX_M, from activations prepared by
// quantize_act_cuda, for 1..CUDA_GEMV_MAX_PARTS matrices of one type and row length in one launch (q, k and v;
// gate and up: at batch 1 every launch costs microseconds between kernels that the weights' stream does not
// hide).  Each part's sums are the same whatever the other parts.  w: N * row_bytes bytes, aligned to
// gemv_cuda_alignment(t); K % block_size == 0.
constexpr int CUDA_GEMV_MAX_PARTS = 3;
struct GemvPart {
    const uint8_t* w;
    size_t row_bytes;
    float* y;
    int N;
};
void gemv_parts_cuda(QType t, const GemvPart* parts, int n_parts, const int8_t* xq, const float2* xds, int M, int K,
                     cudaStream_t stream);

// MUL_MAT_ID for decode: y[a, n] = sum_k x[a / rows_per_x, k] * W_{ids[a]}[n, k] for a < n_sel selections, one
// launch, the expert ids read on the device (device int64 [n_sel], each in [0, n_expert): the caller checks).  The
// stacked experts: expert e's N rows of row_bytes at w + e * expert_bytes (alignment as gemv_cuda_alignment(t));
// xq / xds from quantize_act_cuda (rows_per_x = k: a token's row shared by its k selections; 1: a row each);
// y: [n_sel, N].  Types: the GGUF block types of gemv_cuda_supported (not AWQ).
void gemv_experts_cuda(QType t, const uint8_t* w, size_t expert_bytes, size_t row_bytes, const int64_t* ids,
                       int n_sel, int rows_per_x, const int8_t* xq, const float2* xds, float* y, int N, int K,
                       cudaStream_t stream);

// ---- decode GEMV over the tiled layout (gemv_tiled.cu) ----------------------------------------------------------
// gemv_parts_cuda for the tiled types (QType::*_TILED, csrc/common/gemv_tiled.h: made at upload from Q4_0 / Q8_0 /
// Q4_K / Q6_K rows or AWQ rows); gemv_parts_cuda forwards those types here.  Each part's N % 8 == 0, w 16-byte
// aligned.  A part's sums depend on the K split the launch takes (gemv_tiled_split, from all parts' rows), not
// otherwise on the other parts.
void gemv_tiled_parts_cuda(QType t, const GemvPart* parts, int n_parts, const int8_t* xq, const float2* xds, int M,
                           int K, cudaStream_t stream);
// K slices per row group the tiled GEMV takes for `rows` rows in all at M (1, 2 or 4: see gemv_tiled.cu), and a
// process-wide override of that choice (0: back to the automatic one) for tests and benchmarks.
int gemv_tiled_split(QType t, int64_t rows, int K, int M);
void gemv_tiled_set_split(int split);
// dequantize_cuda for the tiled types (rows ids of the tensor, or all), the GGUF values bit for bit.
void dequantize_tiled_cuda(QType t, const uint8_t* w, size_t row_bytes, const int64_t* ids, int64_t n_out, int K,
                           __half* out_f16, float* out_f32, cudaStream_t stream);

// ---- prefill on int8 tensor cores (mmq.cu) ---------------------------------------------------------------------
// Whether mmq_cuda takes weight type t on CUDA device `device`: the GGUF types' tiled layouts (QType::*_TILED, not
// AWQ's) on compute capability 8.0 and later (mma.sync s8, cp.async, ldmatrix).
bool mmq_cuda_supported(QType t, int device);
// y [M, N] = x @ W^T for any M >= 1 (meant for prompt chunks, M > CUDA_GEMV_MAX_M), from activations prepared by
// quantize_act_cuda (xq int8 [M, K] 16-byte aligned, xds [M, K/32]); W: N rows (N % 8 == 0, N <= 65535 * 128) of
// row_bytes in a tiled layout, 16-byte aligned; K % 32 == 0.  Arithmetic as csrc/common/mmq.h emulates it.
void mmq_cuda(QType t, const uint8_t* w, size_t row_bytes, int N, const int8_t* xq, const float2* xds, int M, int K,
              float* y, cudaStream_t stream);

// ---- dequantize (dequant.cu) -------------------------------------------------------------------------------
// Types dequantize handles: every GGUF block type the CPU handles (Q4_0 ... Q6_K, plus F16/BF16/F32 rows), and
// AWQ rows ((q - z) * s, exact as the CPU's).
bool dequant_cuda_supported(QType t);

// out[i, :] = W[ids ? ids[i] : i, :] as fp16 (out_f16) or fp32 (out_f32; exactly one non-null); n_out rows.
// Values equal gguf.quants.dequantize in fp32 bit for bit (fp16: that value rounded to nearest).
// ids are device int64 and must lie in [0, N) (the caller checks; a bad id reads out of bounds).
void dequantize_cuda(QType t, const uint8_t* w, size_t row_bytes, const int64_t* ids, int64_t n_out, int K,
                     __half* out_f16, float* out_f32, cudaStream_t stream);

// ---- decode attention (attention.cu) ----------------------------------------------------------------------
// Head sizes the kernel is instantiated for.
bool attn_decode_supported_head_dim(int D);

// Number of key chunks (split-K partitions) for a cache of max_seq positions; sizes the scratch buffers.
int attn_decode_chunks(int max_seq);

// Keys or values of one layer: row (head, position) at data + (head * max_seq + position) * row_bytes, of
// type `type` (csrc/cuda/kv_rows.cuh); sink: [Hkv, D] f32 rows read instead of position 0 (the part's exact
// copy of it, kv_cache.py), or nullptr.
struct AttnRows {
    KVRow type;
    const uint8_t* data;
    size_t row_bytes;
    const float* sink;
};

// One new token's attention over a KV cache in its storage basis (flash-decoding: each CTA scores one chunk of
// positions for the query heads of one KV head, a second kernel merges the chunks).
//   q   [H, D] fp32 (RoPE applied, already mapped into the keys' storage basis);
//   len: device int32, the number of valid positions (1..max_seq), read on the device so the call can be
//        captured once in a CUDA graph and replayed for every position;
//   window > 0: attend to the last `window` of them only (sliding-window layers); softcap > 0: scores become
//        softcap * tanh(scale q.k / softcap) before the softmax;
//   part_o [H, chunks, D] fp32 and part_ml [H, chunks, 2] fp32: scratch (chunks = attn_decode_chunks);
//   out [H, D] fp32 in the values' storage basis.  H % Hkv == 0; D even (64, 128 or 256), a multiple of 32 for
//   block rows.  xq int8 [H * D] / xds float2 [H * D / 32] (or null): out's activation codes as quantize_act_cuda
//   makes them, for the output projection.
void attn_decode_cuda(const float* q, const AttnRows& k, const AttnRows& v, const int* len, int window,
                      float softcap, float* part_o, float* part_ml, float* out, int H, int Hkv, int D, int max_seq,
                      float scale, cudaStream_t stream, int8_t* xq = nullptr, float2* xds = nullptr);

// ---- the decode step's row operations (step.cu) -------------------------------------------------------------
// Each takes the model's ArchDims (csrc/common/arch.h, checked when it was built) for its sizes and constants, and
// runs on M rows at once (1 <= M <= CUDA_GEMV_MAX_M: the decode rows of several sequences), each row computed
// exactly as it would be alone.
//
// x [M, n_embd] += a (a given: plus rms_norm(a) * post_w where post_w is given), then h = rms_norm(x) * w and h's
// int8 codes (xq [M, n_embd], xds [M, n_embd/32], as quantize_act_cuda); eps = rms_eps.  n_embd % 32 == 0; x
// updated in place; one CTA per row.
void residual_norm_quant_cuda(const ArchDims& arch, int M, float* x, const float* a, const float* post_w,
                              const float* w, float* h, int8_t* xq, float2* xds, cudaStream_t stream);

// h [M, n_ff] = act(g) * u (SiLU, or the tanh-approximated GELU where gelu_tanh) and h's int8 codes; n_ff % 32 == 0.
void act_quant_cuda(const ArchDims& arch, int M, const float* g, const float* u, float* h, int8_t* xq, float2* xds,
                    cudaStream_t stream);

// One token's q, k, v (GEMV outputs) of one layer -> RoPE'd q_out [n_head, head_dim] and the k, v rows at
// position *pos of a float cache.  Bias where qkv_bias, per-head RMS norm where qk_norm (eps = rms_eps), RoPE of
// the first rope_dim values of a head (neox pairs or adjacent pairs) where the layer has tables.
struct RopeStoreArgs {
    const float* q;       // [n_head * head_dim]
    const float* k;       // [n_kv_head * head_dim]
    const float* v;       // [n_kv_head * head_dim]
    const float* q_bias;  // as q, k, v, or nullptr (qkv_bias false)
    const float* k_bias;
    const float* v_bias;
    const float* q_norm;  // [head_dim] per-head RMS norm weights of q and k, or nullptr (qk_norm false)
    const float* k_norm;
    const float* cos;     // [max_pos, rope_dim / 2] tables of this layer, or nullptr: a layer without RoPE
    const float* sin;
    int max_pos;
    const int64_t* pos;   // device: the token's position
    int max_seq;
    KVRow k_type, v_type;  // F32, F16 or BF16 rows
    uint8_t* k_cache;     // [n_kv_head, max_seq, head_dim] rows of one layer
    uint8_t* v_cache;
    float* q_out;         // [n_head, head_dim]
};
void rope_store_cuda(const ArchDims& arch, const RopeStoreArgs& args, cudaStream_t stream);

}  // namespace pyllm
