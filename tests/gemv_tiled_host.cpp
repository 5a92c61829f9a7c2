// C entry points over csrc/common/gemv_tiled.h and csrc/common/mmq.h for tests/test_gemv_tiled_host.py and
// tests/test_mmq_host.py (built with g++ into a shared library and called through ctypes): the relayout and its
// inverse, the tiled dequantizer, and the host emulations of the CUDA kernels' arithmetic (the decode GEMV's and the
// prefill MMQ's).  Each returns 0, or -1 for a type without a tiled layout.  Types are the rows' (GGUF or AWQ_G*).
#include <cstdint>

#include "common/gemv_tiled.h"
#include "common/mmq.h"

using namespace pyllm;
using namespace pyllm::tiled;

namespace {

template <QType T>
void dequant_all(const uint8_t* w, int64_t N, int K, float* y) {
    using Ty = Tiled<T>;
    const int NU = K / Ty::kE;
    const size_t row_bytes = static_cast<size_t>(K / Ty::kBlockElems) * Ty::kBlockBytes;
    float v[64];
    for (int64_t n = 0; n < N; ++n)
        for (int u = 0; u < NU; ++u) {
            Ty::dequant(tile_at<T>(w, row_bytes, n / kTileRows), NU, u, static_cast<int>(n % kTileRows), v);
            int first, second;
            unit_value_spans<T>(u, &first, &second);
            for (int j = 0; j < Ty::kE; ++j) y[n * K + (j < 32 ? first + j : second + j - 32)] = v[j];
        }
}

template <QType T>
void emulate_all(const uint8_t* w, int64_t N, int K, const int8_t* xq, const float* xds, int M, int split, float* y) {
    const size_t row_bytes = static_cast<size_t>(K / Tiled<T>::kBlockElems) * Tiled<T>::kBlockBytes;
    for (int m = 0; m < M; ++m) {
        const Act x{xq + static_cast<size_t>(m) * K, xds + static_cast<size_t>(m) * (K / 32) * 2};
        for (int64_t n = 0; n < N; ++n) y[m * N + n] = emulate_row<T>(w, row_bytes, static_cast<int>(n), x, K, split);
    }
}

}  // namespace

extern "C" {

int tiled_qtype(int base) { return tiled_qtype_id(base); }

int awq_qtype(int G) { return awq_qtype_id(G); }  // the AWQ rows' type id for group size G, or -1

int tiled_tileable(int base, int64_t N, int64_t K) { return tileable(base, N, K) ? 1 : 0; }

int tiled_relayout(int base, int inverse, const uint8_t* src, uint8_t* dst, int64_t N, int K) {
    return tile_matrix(base, inverse != 0, src, dst, K, 0, N / kTileRows) ? 0 : -1;
}

int tiled_dequantize(int base, const uint8_t* w, int64_t N, int K, float* y) {
    switch (static_cast<QType>(base)) {
        case QType::Q4_0: dequant_all<QType::Q4_0>(w, N, K, y); return 0;
        case QType::Q8_0: dequant_all<QType::Q8_0>(w, N, K, y); return 0;
        case QType::Q4_K: dequant_all<QType::Q4_K>(w, N, K, y); return 0;
        case QType::Q6_K: dequant_all<QType::Q6_K>(w, N, K, y); return 0;
        case QType::AWQ_G32: dequant_all<QType::AWQ_G32>(w, N, K, y); return 0;
        case QType::AWQ_G64: dequant_all<QType::AWQ_G64>(w, N, K, y); return 0;
        case QType::AWQ_G128: dequant_all<QType::AWQ_G128>(w, N, K, y); return 0;
        case QType::AWQ_G256: dequant_all<QType::AWQ_G256>(w, N, K, y); return 0;
        default: return -1;
    }
}

int tiled_emulate(int base, const uint8_t* w, int64_t N, int K, const int8_t* xq, const float* xds, int M, int split,
                  float* y) {
    switch (static_cast<QType>(base)) {
        case QType::Q4_0: emulate_all<QType::Q4_0>(w, N, K, xq, xds, M, split, y); return 0;
        case QType::Q8_0: emulate_all<QType::Q8_0>(w, N, K, xq, xds, M, split, y); return 0;
        case QType::Q4_K: emulate_all<QType::Q4_K>(w, N, K, xq, xds, M, split, y); return 0;
        case QType::Q6_K: emulate_all<QType::Q6_K>(w, N, K, xq, xds, M, split, y); return 0;
        case QType::AWQ_G32: emulate_all<QType::AWQ_G32>(w, N, K, xq, xds, M, split, y); return 0;
        case QType::AWQ_G64: emulate_all<QType::AWQ_G64>(w, N, K, xq, xds, M, split, y); return 0;
        case QType::AWQ_G128: emulate_all<QType::AWQ_G128>(w, N, K, xq, xds, M, split, y); return 0;
        case QType::AWQ_G256: emulate_all<QType::AWQ_G256>(w, N, K, xq, xds, M, split, y); return 0;
        default: return -1;
    }
}

// Whether the MMQ kernel takes weight type id `qtype` (mmq::mmq_type: the kernel's and cuda_mmq_supported's test).
int mmq_takes(int qtype) { return mmq::mmq_type(static_cast<QType>(qtype)) ? 1 : 0; }

// The MMQ kernel's y [M, N] (csrc/cuda/mmq.cu) for tiled weights and activation codes (xds: [M, K/32, 2]).
int mmq_emulate(int base, const uint8_t* w, int64_t N, int K, const int8_t* xq, const float* xds, int M, float* y) {
    switch (static_cast<QType>(base)) {
        case QType::Q4_0: mmq::emulate<QType::Q4_0>(w, N, K, xq, xds, M, y); return 0;
        case QType::Q8_0: mmq::emulate<QType::Q8_0>(w, N, K, xq, xds, M, y); return 0;
        case QType::Q4_K: mmq::emulate<QType::Q4_K>(w, N, K, xq, xds, M, y); return 0;
        case QType::Q6_K: mmq::emulate<QType::Q6_K>(w, N, K, xq, xds, M, y); return 0;
        default: return -1;
    }
}

// Row n's staged int8 codes (K) and Metas (K/32 pairs of 4-byte words: d as float, aux as uint32) as the MMQ kernel
// puts them in shared memory.
int mmq_stage_row(int base, const uint8_t* w, int K, int64_t n, int8_t* codes, void* meta) {
    mmq::Meta* m = static_cast<mmq::Meta*>(meta);
    switch (static_cast<QType>(base)) {
        case QType::Q4_0: mmq::stage_row<QType::Q4_0>(w, K, n, codes, m); return 0;
        case QType::Q8_0: mmq::stage_row<QType::Q8_0>(w, K, n, codes, m); return 0;
        case QType::Q4_K: mmq::stage_row<QType::Q4_K>(w, K, n, codes, m); return 0;
        case QType::Q6_K: mmq::stage_row<QType::Q6_K>(w, K, n, codes, m); return 0;
        default: return -1;
    }
}

}  // extern "C"
