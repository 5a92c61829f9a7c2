// Prefill's attention: T new positions over S >= T keys, float32 (kernels.h causal_attention_cpu).  No torch
// here: bindings_rows.cpp checked every size.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "attention_avx2.h"
#include "kernels.h"

namespace pyllm {

namespace {

#if PYLLM_KV_AVX2
using kv_avx2::exp256;
using kv_avx2::hsum;
#endif

// ---- causal attention of new positions over their keys (prefill) ---------------------------------------------
// T new positions (the last T of S keys: a fresh prompt has S = T, a later chunk or chat turn S > T).  One task
// is one KV head and a block of consecutive queries; its rows are the block's positions times the G query heads
// of the group, so every key and value row read serves all of them.  Per task:
//   scores = (scale Q) K^T over the keys the block can see, a softmax per row, O = P V,
// both products through one 6 x 16 register tile (12 fp32 accumulators; each vector of K^T or V feeds 6 rows).
// Keys and values are packed once per KV head into panels 16 floats wide that the tile reads contiguously:
// keys by 16 positions ([S/16][hd][16], a vector holds 8 keys of one dimension), values by 16 dimensions
// ([hd/16][S][16]).  (Read in place, K^T rows S floats apart alias in L1 and the tile ran at a fifth of its FMA
// rate.)  Key tiles above a row tile's last position (or before its window) are never computed, so the work is
// the causal part (torch's SDPA with a mask computes every score).  Masked scores inside computed tiles become
// exact zeros before O = P V.

struct CausalAttention {
    const float *q, *k, *v;
    size_t q_row, q_head, k_row, k_head, v_row, v_head;  // floats between positions / heads
    float* out;
    size_t out_row;
    int T, S, H, Hkv, hd, window;
    float scale;
    int G() const { return H / Hkv; }
    int pos(int i) const { return S - T + i; }  // query row i's position
    int first_key(int p) const { return window > 0 ? std::max(0, p - window + 1) : 0; }
};

// Rows of a block: row r is query i0 + r / G, query head g * G + r % G.
void causal_attention_rows_scalar(const CausalAttention& a, int g, int i0, int i1, float* sc) {
    const int G = a.G(), hd = a.hd;
    for (int i = i0; i < i1; ++i)
        for (int hh = 0; hh < G; ++hh) {
            const int h = g * G + hh, p = a.pos(i), j0 = a.first_key(p), n = p - j0 + 1;
            const float* q = a.q + i * a.q_row + h * a.q_head;
            float mx = -INFINITY;
            for (int j = 0; j < n; ++j) {
                const float* k = a.k + (j0 + j) * a.k_row + g * a.k_head;
                float s = 0.f;
                for (int c = 0; c < hd; ++c) s += q[c] * k[c];
                sc[j] = s * a.scale;
                mx = std::max(mx, sc[j]);
            }
            float sum = 0.f;
            for (int j = 0; j < n; ++j) sum += (sc[j] = std::exp(sc[j] - mx));
            float* o = a.out + i * a.out_row + static_cast<size_t>(h) * hd;
            std::fill(o, o + hd, 0.f);
            for (int j = 0; j < n; ++j) {
                const float* v = a.v + (j0 + j) * a.v_row + g * a.v_head;
                const float p_j = sc[j] / sum;
                for (int c = 0; c < hd; ++c) o[c] += p_j * v[c];
            }
        }
}

#if PYLLM_KV_AVX2
// C[r][0 .. 8 NV) = sum_{k < n} A[r lda + k] B[k ldb + 0 .. 8 NV) for r < R.
template <int R, int NV>
KV_INLINE void tile_product(int n, const float* A, size_t lda, const float* B, size_t ldb, float* C, size_t ldc) {
    __m256 c[R][NV];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
        for (int u = 0; u < NV; ++u) c[r][u] = _mm256_setzero_ps();
    for (int k = 0; k < n; ++k) {
        __m256 b[NV];
#pragma GCC unroll 2
        for (int u = 0; u < NV; ++u) b[u] = _mm256_loadu_ps(B + k * ldb + 8 * u);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const __m256 x = _mm256_broadcast_ss(A + r * lda + k);
#pragma GCC unroll 2
            for (int u = 0; u < NV; ++u) c[r][u] = _mm256_fmadd_ps(x, b[u], c[r][u]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
        for (int u = 0; u < NV; ++u) _mm256_storeu_ps(C + r * ldc + 8 * u, c[r][u]);
}

template <int NV>
void tile_product_rows(int rows, int n, const float* A, size_t lda, const float* B, size_t ldb, float* C, size_t ldc) {
    switch (rows) {
        case 1: tile_product<1, NV>(n, A, lda, B, ldb, C, ldc); return;
        case 2: tile_product<2, NV>(n, A, lda, B, ldb, C, ldc); return;
        case 3: tile_product<3, NV>(n, A, lda, B, ldb, C, ldc); return;
        case 4: tile_product<4, NV>(n, A, lda, B, ldb, C, ldc); return;
        case 5: tile_product<5, NV>(n, A, lda, B, ldb, C, ldc); return;
        default: tile_product<6, NV>(n, A, lda, B, ldb, C, ldc); return;
    }
}

// C [rows][cols] = A [rows][n] V [j0 .. j0 + n][cols], cols a multiple of 8, V in panels of 16 columns
// ([tp][16] each; a last panel of 8 columns is [tp][8]).
void rows_product(int rows, int cols, int n, const float* A, size_t lda, const float* vp, int tp, int j0, float* C,
                  size_t ldc) {
    int c = 0;
    for (; c + 16 <= cols; c += 16)
        tile_product_rows<2>(rows, n, A, lda, vp + static_cast<size_t>(c) * tp + j0 * 16, 16, C + c, ldc);
    if (c < cols) tile_product_rows<1>(rows, n, A, lda, vp + static_cast<size_t>(c) * tp + j0 * 8, 8, C + c, ldc);
}

// s[0..n) -> e^(s - max), returning their sum (the caller divides the outputs, not the n weights).  The last
// partial vector is read, exponentiated and stored whole with its lanes past n zeroed: s must hold n rounded up
// to 8 floats, and those past n end as 0.
KV_INLINE float softmax_unnormalized(float* s, int n) {
    const int n8 = n & ~7, rem = n - n8;
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    const __m256 tail = _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_ps(static_cast<float>(rem)),
                                      _CMP_LT_OQ);
    __m256 vm = ninf;
    for (int j = 0; j < n8; j += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(s + j));
    if (rem) vm = _mm256_max_ps(vm, _mm256_blendv_ps(ninf, _mm256_loadu_ps(s + n8), tail));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const __m256 mx = _mm256_set1_ps(_mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4))));
    __m256 vs = _mm256_setzero_ps();
    for (int j = 0; j < n8; j += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), mx));
        _mm256_storeu_ps(s + j, e);
        vs = _mm256_add_ps(vs, e);
    }
    if (rem) {
        const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_loadu_ps(s + n8), mx)), tail);
        _mm256_storeu_ps(s + n8, e);
        vs = _mm256_add_ps(vs, e);
    }
    return hsum(vs);
}

constexpr int TILE_ROWS = 6, KEY_TILE = 16;

// kp: KV head g's keys, [tp / 16][hd][16] (zero past T); vp: its values, [hd / 16][tp][16] (then [tp][8] if
// hd % 16 == 8).  Scratch: qs rows x hd floats, sc rows x (i1 - key base, rounded up to KEY_TILE, + 8), inv rows.
void causal_attention_rows_avx2(const CausalAttention& a, int i0, int i1, const float* kp, const float* vp, int tp,
                                int g, float* qs, float* sc, float* inv) {
    const int G = a.G(), hd = a.hd, rows = (i1 - i0) * G, p0 = a.pos(i0);  // row r: position p0 + r / G
    const int kb = a.first_key(p0) & ~(KEY_TILE - 1);  // key of column 0 of sc
    // + 8: softmax_unnormalized stores whole vectors, up to 7 floats past a row's last key
    const int ld = ((p0 + i1 - i0 - kb + KEY_TILE - 1) & ~(KEY_TILE - 1)) + 8;
    const __m256 vscale = _mm256_set1_ps(a.scale);
    for (int r = 0; r < rows; ++r) {
        const float* q = a.q + (i0 + r / G) * a.q_row + (g * G + r % G) * a.q_head;
        for (int c = 0; c < hd; c += 8) _mm256_storeu_ps(qs + r * hd + c, _mm256_mul_ps(vscale, _mm256_loadu_ps(q + c)));
    }
    for (int r0 = 0; r0 < rows; r0 += TILE_ROWS) {
        const int nr = std::min(TILE_ROWS, rows - r0);
        const int lo = (a.first_key(p0 + r0 / G) - kb) & ~(KEY_TILE - 1), hi = p0 + (r0 + nr - 1) / G - kb + 1;
        for (int j = lo; j < hi; j += KEY_TILE)
            tile_product_rows<2>(nr, hd, qs + r0 * hd, hd, kp + static_cast<size_t>(kb + j) * hd, 16,
                                 sc + r0 * ld + j, ld);
    }
    // Softmax over each row's own keys; the rest of its tile's span (other rows' keys) becomes 0 for O = P V,
    // which goes into qs (the scaled queries are no longer needed), then divided by the row's sum on the way out.
    for (int r0 = 0; r0 < rows; r0 += TILE_ROWS) {
        const int nr = std::min(TILE_ROWS, rows - r0);
        const int lo = a.first_key(p0 + r0 / G) - kb, hi = p0 + (r0 + nr - 1) / G - kb + 1;
        for (int r = r0; r < r0 + nr; ++r) {
            const int p = p0 + r / G, j0 = a.first_key(p) - kb, j1 = p - kb + 1;
            float* s = sc + r * ld;
            std::fill(s + lo, s + j0, 0.f);
            inv[r] = 1.0f / softmax_unnormalized(s + j0, j1 - j0);
            if (j1 < hi) std::fill(s + j1, s + hi, 0.f);
        }
        rows_product(nr, hd, hi - lo, sc + r0 * ld + lo, ld, vp, tp, kb + lo, qs + r0 * hd, hd);
    }
    for (int r = 0; r < rows; ++r) {
        float* o = a.out + (i0 + r / G) * a.out_row + static_cast<size_t>(g * G + r % G) * hd;
        const __m256 d = _mm256_set1_ps(inv[r]);
        for (int c = 0; c < hd; c += 8) _mm256_storeu_ps(o + c, _mm256_mul_ps(d, _mm256_loadu_ps(qs + r * hd + c)));
    }
}
#endif

}  // namespace

void causal_attention_cpu(const float* q, size_t q_row, size_t q_head, const float* k, size_t k_row, size_t k_head,
                          const float* v, size_t v_row, size_t v_head, float* out, size_t out_row, int T, int S, int H,
                          int Hkv, int hd, float scale, int window) {
    const CausalAttention a{q, k, v, q_row, q_head, k_row, k_head, v_row, v_head, out, out_row, T, S, H, Hkv, hd,
                            window, scale};
    const int G = H / Hkv, nt = std::max(1, cpu_get_num_threads());
    const int tp = (S + 15) & ~15;
    // Queries per task: their score rows (block * G rows of up to tp keys) stay within ~96 KB of L2 beside the
    // keys and values, and there are at least 4 tasks per thread where the queries are many enough to split.
    int block = std::clamp(24576 / (G * tp), 1, 64);
    block = std::min(block, std::max(1, T * Hkv / (4 * nt)));
    const int n_blocks = (T + block - 1) / block, n_tasks = n_blocks * Hkv;
    bool simd = false;
#if PYLLM_KV_AVX2
    simd = cpu_isa_simd(cpu_get_isa()) && hd % 8 == 0;
    std::vector<float> kp, vp;  // per KV head: hd * tp floats each (rows_avx2's panels)
    const size_t head_floats = static_cast<size_t>(hd) * tp;
    if (simd) {
        kp.resize(Hkv * head_floats);
        vp.resize(Hkv * head_floats);
        const int n_tiles = tp / 16;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1 && S * Hkv * hd >= (1 << 15))
        for (int gt = 0; gt < Hkv * n_tiles; ++gt) {
            const int g = gt / n_tiles, j0 = gt % n_tiles * 16;
            float* kd = kp.data() + g * head_floats + static_cast<size_t>(j0) * hd;  // [hd][16]
            float* vd = vp.data() + g * head_floats;
            for (int j = j0; j < j0 + 16; ++j) {
                const float* ks = k + std::min(j, S - 1) * k_row + g * k_head;
                const float* vs = v + std::min(j, S - 1) * v_row + g * v_head;
                const bool pad = j >= S;  // zero keys and values past the last one (never weighted: masked)
                for (int c = 0; c < hd; ++c) kd[c * 16 + (j - j0)] = pad ? 0.f : ks[c];
                int c = 0;
                for (; c + 16 <= hd; c += 16)
                    for (int u = 0; u < 16; ++u) vd[static_cast<size_t>(c) * tp + j * 16 + u] = pad ? 0.f : vs[c + u];
                for (int u = 0; c + u < hd; ++u) vd[static_cast<size_t>(c) * tp + j * 8 + u] = pad ? 0.f : vs[c + u];
            }
        }
    }
#endif
    // Later blocks see more keys: they go first so that the last tasks handed out are the short ones.
#pragma omp parallel num_threads(std::min(nt, n_tasks)) if (nt > 1 && n_tasks > 1)
    {
        std::vector<float> qs, sc, inv;
#pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < n_tasks; ++t) {
            const int b = n_blocks - 1 - t / Hkv, g = t % Hkv;
            const int i0 = b * block, i1 = std::min(T, i0 + block);
#if PYLLM_KV_AVX2
            if (simd) {
                const int rows = (i1 - i0) * G, kb = a.first_key(a.pos(i0)) & ~15;
                qs.resize(static_cast<size_t>(rows) * hd);
                sc.resize(static_cast<size_t>(rows) * (((a.pos(i1 - 1) + 1 - kb + 15) & ~15) + 8));
                inv.resize(rows);
                causal_attention_rows_avx2(a, i0, i1, kp.data() + g * head_floats, vp.data() + g * head_floats, tp, g,
                                           qs.data(), sc.data(), inv.data());
                continue;
            }
#endif
            sc.resize(static_cast<size_t>(S));
            causal_attention_rows_scalar(a, g, i0, i1, sc.data());
        }
    }
    (void)simd;
}

}  // namespace pyllm
