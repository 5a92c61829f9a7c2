// Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 (and Q4_K / Q5_K / Q6_K) rows interleaved by 8 (QType::Q*_R8, layout in
// common/blocks.h): the repacker the CPU decode step's weights go through at load, its inverse (one row back to
// its GGUF blocks, for dequantize and for kernels without a SIMD version), and those generic kernels.  Both
// directions copy bytes only, so a row unpacked is bit for bit the row that was packed.
#include <omp.h>

#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_impl.h"
#include "../kernels.h"

namespace pyllm {
namespace {

// Fields of a GGUF block / its group block, by type: scale d, min m (Q4_1/Q5_1), fifth bits qh (Q5), codes qs.
template <class B, class G>
struct Pair {
    static constexpr bool has_min = sizeof(B) == 20 || sizeof(B) == 24;
    static constexpr bool five = sizeof(B) == 22 || sizeof(B) == 24;
    static const uint8_t* qh(const B& b) {
        if constexpr (five) return b.qh;
        return nullptr;
    }
};

template <class B, class G>
void pack_block(const B* rows[8], int b, G& o) {
    using P = Pair<B, G>;
    for (int j = 0; j < 8; ++j) {
        const B& s = rows[j][b];
        o.d[j] = s.d;
        if constexpr (P::has_min) o.m[j] = s.m;
        for (int k = 0; k < 4; ++k) memcpy(o.qs + 32 * k + 4 * j, s.qs + 4 * k, 4);
    }
    if constexpr (P::five) {
        memset(o.qh, 0, sizeof(o.qh));
        for (int j = 0; j < 8; ++j) {
            uint32_t h;
            memcpy(&h, rows[j][b].qh, 4);
            for (int e = 0; e < QK; ++e) {
                const int c = e < 16 ? e / 4 : 4 + (e - 16) / 4, t = e % 4;
                o.qh[4 * j + t] |= static_cast<uint8_t>(((h >> e) & 1u) << c);
            }
        }
    }
}

template <class B, class G>
void unpack_block(const G& o, int j, B& s) {
    using P = Pair<B, G>;
    s.d = o.d[j];
    if constexpr (P::has_min) s.m = o.m[j];
    for (int k = 0; k < 4; ++k) memcpy(s.qs + 4 * k, o.qs + 32 * k + 4 * j, 4);
    if constexpr (P::five) {
        uint32_t h = 0;
        for (int e = 0; e < QK; ++e) {
            const int c = e < 16 ? e / 4 : 4 + (e - 16) / 4, t = e % 4;
            h |= static_cast<uint32_t>((o.qh[4 * j + t] >> c) & 1u) << e;
        }
        memcpy(s.qh, &h, 4);
    }
}

// Q8_0: 8 code vectors of 4 codes per row (the overloads win over the templates above).
void pack_block(const block_q8_0* rows[8], int b, block_q8_0x8& o) {
    for (int j = 0; j < 8; ++j) {
        const block_q8_0& s = rows[j][b];
        o.d[j] = s.d;
        for (int k = 0; k < 8; ++k) memcpy(o.qs + 32 * k + 4 * j, s.qs + 4 * k, 4);
    }
}

void unpack_block(const block_q8_0x8& o, int j, block_q8_0& s) {
    s.d = o.d[j];
    for (int k = 0; k < 8; ++k) memcpy(s.qs + 4 * k, o.qs + 32 * k + 4 * j, 4);
}

// K-quant super-blocks: every field is either one value per row side by side (d, dmin, Q6_K's scales) or bytes
// moved in 4-byte runs, run c of row j to 32c + 4j.  pack_k (to_group) and its inverse walk the same field list.
template <bool ToGroup>
void runs4(uint8_t* group, uint8_t* row, int j, int n_runs) {
    for (int c = 0; c < n_runs; ++c) {
        if constexpr (ToGroup) memcpy(group + 32 * c + 4 * j, row + 4 * c, 4);
        else memcpy(row + 4 * c, group + 32 * c + 4 * j, 4);
    }
}
template <bool ToGroup, class T>
void side_by_side(T* group, T* row, int j, int n) {  // n values per row: group[8i + j] = row[i]
    for (int i = 0; i < n; ++i) {
        if constexpr (ToGroup) group[8 * i + j] = row[i];
        else row[i] = group[8 * i + j];
    }
}
template <bool ToGroup, class B, class G>  // Q4_K / Q5_K
void move_k(B& s, G& o, int j) {
    side_by_side<ToGroup>(o.d, &s.d, j, 1);
    side_by_side<ToGroup>(o.dmin, &s.dmin, j, 1);
    runs4<ToGroup>(o.scales, s.scales, j, 3);
    if constexpr (std::is_same_v<B, block_q5_K>) runs4<ToGroup>(o.qh, s.qh, j, QK_K / 32);
    runs4<ToGroup>(o.qs, s.qs, j, QK_K / 8);
}
template <bool ToGroup>
void move_k(block_q6_K& s, block_q6_kx8& o, int j) {
    side_by_side<ToGroup>(o.d, &s.d, j, 1);
    side_by_side<ToGroup>(o.scales, s.scales, j, QK_K / 16);
    runs4<ToGroup>(o.ql, s.ql, j, QK_K / 8);
    runs4<ToGroup>(o.qh, s.qh, j, QK_K / 16);
}

template <class B, class G>
void pack_block_k(const B* rows[8], int b, G& o) {
    for (int j = 0; j < 8; ++j) move_k<true>(const_cast<B&>(rows[j][b]), o, j);  // reads rows[j] only
}

template <class B, class G>
void unpack_block_k(const G& o, int j, B& s) {
    move_k<false>(s, const_cast<G&>(o), j);  // reads o only
}

template <class B, class G>
void repack(const uint8_t* w, int64_t N, int K, uint8_t* out) {
    constexpr bool kquant = sizeof(B) >= 144;  // the K-quant super-blocks (the 32-element blocks are <= 34)
    const int nb = K / (kquant ? QK_K : QK);
    const size_t row_bytes = sizeof(B) * static_cast<size_t>(nb);
    const int64_t groups = N / 8;
#pragma omp parallel for num_threads(cpu_get_num_threads()) schedule(static) if (groups >= 64)
    for (int64_t g = 0; g < groups; ++g) {
        const B* rows[8];
        for (int j = 0; j < 8; ++j) rows[j] = reinterpret_cast<const B*>(w + row_bytes * (8 * g + j));
        G* o = reinterpret_cast<G*>(out + row_bytes * 8 * g);
        for (int b = 0; b < nb; ++b) {
            if constexpr (kquant) pack_block_k(rows, b, o[b]);
            else pack_block(rows, b, o[b]);
        }
    }
}

template <class B, class G>
void unpack(const uint8_t* group, int K, int j, uint8_t* out) {
    const G* o = reinterpret_cast<const G*>(group);
    B* s = reinterpret_cast<B*>(out);
    if constexpr (sizeof(B) >= 144) {
        for (int b = 0; b < K / QK_K; ++b) unpack_block_k(o[b], j, s[b]);
    } else {
        for (int b = 0; b < K / QK; ++b) unpack_block(o[b], j, s[b]);
    }
}

// Without SIMD: each row of the group unpacked into a GGUF row, then the base type's generic row dot.
template <QType R8, int M>
void rows8_generic(int K, int n, const uint8_t* w, size_t row_bytes, const uint8_t* xa, size_t xs, float* y,
                   size_t ldy) {
    thread_local std::vector<uint8_t> row;
    row.resize(row_bytes);
    const cpu::RowDot f = cpu::row_kernel_generic(rows8_base(R8)).fn[M - 1];
    for (int r = 0; r < n; ++r) {
        unpack_rows8_row(R8, w + row_bytes * (r & ~7), K, r & 7, row.data());
        f(K, row.data(), xa, xs, y + r, ldy);
    }
}

// The same for Q8_0_R8 against 16-bit activations (gemv_cpu's precise_x: the output projection).
template <int M>
void rows8_generic_x16(int K, int n, const uint8_t* w, size_t row_bytes, const uint8_t* xa, size_t xs, float* y,
                       size_t ldy) {
    thread_local std::vector<uint8_t> row;
    row.resize(row_bytes);
    const cpu::RowDot f = cpu::row_kernel_generic_x16(QType::Q8_0).fn[M - 1];
    for (int r = 0; r < n; ++r) {
        unpack_rows8_row(QType::Q8_0_R8, w + row_bytes * (r & ~7), K, r & 7, row.data());
        f(K, row.data(), xa, xs, y + r, ldy);
    }
}

#define PYLLM_ROWS8_GENERIC(T)                                                                                  \
    {rows8_generic<T, 1>, rows8_generic<T, 2>, rows8_generic<T, 3>, rows8_generic<T, 4>,                     \
     rows8_generic<T, 5>, rows8_generic<T, 6>, rows8_generic<T, 7>, rows8_generic<T, 8>}

}  // namespace

void repack_rows8_cpu(QType base, const uint8_t* w, int64_t N, int K, uint8_t* out) {
    switch (base) {
        case QType::Q4_0: return repack<block_q4_0, block_q4_0x8>(w, N, K, out);
        case QType::Q4_1: return repack<block_q4_1, block_q4_1x8>(w, N, K, out);
        case QType::Q5_0: return repack<block_q5_0, block_q5_0x8>(w, N, K, out);
        case QType::Q5_1: return repack<block_q5_1, block_q5_1x8>(w, N, K, out);
        case QType::Q8_0: return repack<block_q8_0, block_q8_0x8>(w, N, K, out);
        case QType::Q4_K: return repack<block_q4_K, block_q4_kx8>(w, N, K, out);
        case QType::Q5_K: return repack<block_q5_K, block_q5_kx8>(w, N, K, out);
        case QType::Q6_K: return repack<block_q6_K, block_q6_kx8>(w, N, K, out);
        default: return;  // bindings accept only these
    }
}

void unpack_rows8_row(QType r8, const uint8_t* group, int K, int j, uint8_t* out) {
    switch (r8) {
        case QType::Q4_0_R8: return unpack<block_q4_0, block_q4_0x8>(group, K, j, out);
        case QType::Q4_1_R8: return unpack<block_q4_1, block_q4_1x8>(group, K, j, out);
        case QType::Q5_0_R8: return unpack<block_q5_0, block_q5_0x8>(group, K, j, out);
        case QType::Q5_1_R8: return unpack<block_q5_1, block_q5_1x8>(group, K, j, out);
        case QType::Q8_0_R8: return unpack<block_q8_0, block_q8_0x8>(group, K, j, out);
        case QType::Q4_K_R8: return unpack<block_q4_K, block_q4_kx8>(group, K, j, out);
        case QType::Q5_K_R8: return unpack<block_q5_K, block_q5_kx8>(group, K, j, out);
        case QType::Q6_K_R8: return unpack<block_q6_K, block_q6_kx8>(group, K, j, out);
        default: return;
    }
}

namespace cpu {
RowKernel row_kernel_generic_rows8(QType t) {
    switch (t) {
        case QType::Q4_0_R8: return {Act::Q8_32, {}, PYLLM_ROWS8_GENERIC(QType::Q4_0_R8), 8};
        case QType::Q4_1_R8: return {Act::Q8_32, {}, PYLLM_ROWS8_GENERIC(QType::Q4_1_R8), 8};
        case QType::Q5_0_R8: return {Act::Q8_32, {}, PYLLM_ROWS8_GENERIC(QType::Q5_0_R8), 8};
        case QType::Q5_1_R8: return {Act::Q8_32, {}, PYLLM_ROWS8_GENERIC(QType::Q5_1_R8), 8};
        case QType::Q8_0_R8: return {Act::Q8_32, {}, PYLLM_ROWS8_GENERIC(QType::Q8_0_R8), 8};
        case QType::Q4_K_R8: return {Act::Q8_K, {}, PYLLM_ROWS8_GENERIC(QType::Q4_K_R8), 8};
        case QType::Q5_K_R8: return {Act::Q8_K, {}, PYLLM_ROWS8_GENERIC(QType::Q5_K_R8), 8};
        case QType::Q6_K_R8: return {Act::Q8_K, {}, PYLLM_ROWS8_GENERIC(QType::Q6_K_R8), 8};
        default: return {};
    }
}

RowKernel row_kernel_generic_rows8_x16(QType t) {
    if (t != QType::Q8_0_R8) return {};
    return {Act::Q16_32, {},
            {rows8_generic_x16<1>, rows8_generic_x16<2>, rows8_generic_x16<3>, rows8_generic_x16<4>,
             rows8_generic_x16<5>, rows8_generic_x16<6>, rows8_generic_x16<7>, rows8_generic_x16<8>}, 8};
}
}  // namespace cpu

}  // namespace pyllm
