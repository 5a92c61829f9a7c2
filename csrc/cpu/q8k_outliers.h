// Outliers of the Q8_K activations: found per row, taken out of the row before it is rounded, and added back
// exactly while each chunk's weights are cached (csrc/cpu/q8k_outliers.cpp; the GEMVs in gemv.cpp call them).
#pragma once

#include <cstddef>
#include <cstdint>

#include "../common/blocks.h"
#include "../kernels.h"

namespace pyllm {
namespace cpu {

// Q8_K activations have one scale per 256 values, so one large value rounds the other 255 of its block on a
// coarse grid.  Gemma 3's MLP and attention outputs carry such values (3-6 per row above 6x the row's rms), and
// Qwen2.5's ffn_down inputs carry 11-13 per row spread over 8-9 of its 19 blocks: with one Q8_K row their
// attn_output and ffn_down GEMVs were most of the decode path's error (Gemma-3-270M, 3 short prompts, last position
// vs the float32 reference: max error 6.4% of the max logit and mean KL 3.8e-3; those two layers in float32:
// 2.2% / 1.6e-3).  A row's elements above kOutlier times its rms (a Gaussian row has none in practice) are taken
// out of the Q8_K row, which then rounds on the grid of the rest, and added back: sum_j x_j W[n][j] in fp32 over
// the weights decoded one at a time (add_outlier_dots; 8 rows per vector for rows interleaved by 8), for each
// output of the chunk whose weights were just read.  A second Q8_K row holding the rounding residual x - d q did
// this before, at the cost of a whole row's dot: Qwen2.5's ffn_down took 8 activation rows in a 4-row
// verification pass (10.3-14.9 ms per pass, now 6.4-6.7 ms).  Mean last-position KL on the
// held-out prompts: Qwen2.5 3.4e-4 either way; Gemma 3 2.6e-3 (residual rows 1.5e-3; llama.cpp 7.0e-3).  A row
// can hold only K/36 elements above 6x its rms; rows with more than kMaxSparse still take the residual row (the
// M = 2 kernel: the weights decoded once), which leaves ~1/254 of the rounding error.
constexpr float kOutlier = 6.0f;
constexpr int kMaxSparse = 32;

struct Outliers {
    int n = 0;
    int idx[kMaxSparse];
    float val[kMaxSparse];
};

enum class RowKind : uint8_t { Plain, Sparse, Residual };

// Finds x's elements above kOutlier x rms(x): none (Plain), up to kMaxSparse of them (Sparse, listed in o, in
// index order), or more (Residual).
RowKind q8_K_outliers(const float* x, int K, Outliers& o);

// Q8_K row kinds of x's M rows: kind[m], and outl[m] lists a Sparse row's outliers (n = 0 for the others).
void classify_q8_K(const float* x, int M, int K, RowKind* kind, Outliers* outl);

// Adds to y[n], for rows n0..n1-1 of W (type t: a K-quant, GGUF rows or interleaved by 8), the sum over o's
// outliers of x_j W[n][j]: fp32, one product and one add per outlier in index order, so a row's sum is the same
// whatever else the call holds (and on every path).
void add_outlier_dots(QType t, const uint8_t* w, size_t row_bytes, int K, const Outliers& o, int n0, int n1,
                      float* y);

// r = x - d q per block: what the Q8_K row q misses of x (fp32).
void q8_K_residual(const float* x, const block_q8_K* q, int K, float* r);

}  // namespace cpu
}  // namespace pyllm
