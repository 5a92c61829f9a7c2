// AVX2 row dots for the K-quants (Q4_K, Q5_K, Q6_K and their rows-by-8 layouts): gemv_kquants_impl.h compiled
// for AVX2.
#include "avx2_util.h"
#include "cpu_impl.h"
#ifdef PYLLM_AVX2
#include "gemv_kquants_impl.h"
#endif

namespace pyllm {
namespace cpu {

#ifdef PYLLM_AVX2
bool dequant_row_avx2_kquants(QType t, const uint8_t* w, int K, float* out) {
    return avx2::dequant_row_kquant_blocks(t, w, K, out);
}
RowKernel row_kernel_avx2_kquants(QType t) { return avx2::row_kernel_kquant_blocks(t); }
#else
RowKernel row_kernel_avx2_kquants(QType) { return {}; }
bool dequant_row_avx2_kquants(QType, const uint8_t*, int, float*) { return false; }
#endif

}  // namespace cpu
}  // namespace pyllm
