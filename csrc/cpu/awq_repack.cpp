// AutoAWQ "gemm" tensors -> pyllm's AWQ rows (blocks.h AwqRow), once per weight at load.
//
// AutoAWQ stores W^T: qweight int32 [K, N/8], word c of row k holding columns 8c + AWQ_ORDER[i] in nibble i;
// qzeros int32 [K/G, N/8] the same way; scales fp16 [K/G, N].  The kernels want W: one row per output n with
// its K codes in the Q4_0 element order.  So this is a 4-bit transpose.  Work goes by strips of word columns
// (CW words = 8 CW output rows) and 32-row k blocks: the strip's 32 input lines (32 x 64 bytes) and its 8 CW
// output rows (16 bytes each per k block) all stay in L1, and the strips run in parallel.  An 8B model's ~4 GB
// of codes repack in seconds.
#include <omp.h>

#include <algorithm>
#include <cstring>

#include "cpu_impl.h"

namespace pyllm {

void awq_repack_cpu(const int32_t* qweight, const int32_t* qzeros, const uint16_t* scales, int K, int N, int G,
                    uint8_t* out) {
    const int N8 = N / 8, ng = K / G, nkb = K / QK;
    const size_t rb = static_cast<size_t>(K) / 2 + 3 * static_cast<size_t>(ng);  // = qtype_row_bytes
    constexpr int CW = 16;  // one 64-byte line of qweight per k row
    const int strips = (N8 + CW - 1) / CW;
    const int nt = std::max(1, std::min(cpu_get_num_threads(), strips));
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (nt > 1)
    for (int st = 0; st < strips; ++st) {
        const int c0 = st * CW, c1 = std::min(N8, c0 + CW);
        for (int kb = 0; kb < nkb; ++kb) {
            for (int c = c0; c < c1; ++c) {
                uint32_t wv[QK];
                for (int j = 0; j < QK; ++j)
                    wv[j] = static_cast<uint32_t>(qweight[static_cast<size_t>(QK * kb + j) * N8 + c]);
                for (int i = 0; i < 8; ++i) {
                    uint8_t* dst = out + static_cast<size_t>(8 * c + AWQ_ORDER[i]) * rb + 3 * ng + QK / 2 * kb;
                    // element j in the low nibble of byte j, element j + 16 in its high nibble
                    for (int j = 0; j < QK / 2; ++j)
                        dst[j] = static_cast<uint8_t>(((wv[j] >> (4 * i)) & 15) | (((wv[j + 16] >> (4 * i)) & 15) << 4));
                }
            }
        }
        for (int c = c0; c < c1; ++c)
            for (int i = 0; i < 8; ++i) {
                const int n = 8 * c + AWQ_ORDER[i];
                uint8_t* row = out + static_cast<size_t>(n) * rb;
                uint8_t* s = row;  // row: s [ng] fp16 | z [ng] | qs [K/2]
                uint8_t* z = s + 2 * ng;
                for (int g = 0; g < ng; ++g) {
                    memcpy(s + 2 * g, scales + static_cast<size_t>(g) * N + n, 2);
                    z[g] = static_cast<uint8_t>((static_cast<uint32_t>(qzeros[static_cast<size_t>(g) * N8 + c]) >> (4 * i)) & 15);
                }
            }
    }
}

}  // namespace pyllm
