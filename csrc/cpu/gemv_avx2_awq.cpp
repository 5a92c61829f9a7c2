// AVX2 row dots and dequantization for AWQ rows: gemv_awq_impl.h compiled for AVX2.
#include "avx2_util.h"
#include "cpu_impl.h"
#ifdef PYLLM_AVX2
#include "gemv_awq_impl.h"
#endif

namespace pyllm {
namespace cpu {

#ifdef PYLLM_AVX2
RowKernel row_kernel_avx2_awq(QType t) { return avx2::row_kernel_awq_rows(t); }
bool dequant_row_avx2_awq(QType t, const uint8_t* w, int K, float* out) {
    return avx2::dequant_row_awq_rows(t, w, K, out);
}
#else  // no AVX2 at compile time: the dispatcher only ever uses the generic kernels
RowKernel row_kernel_avx2_awq(QType) { return {}; }
bool dequant_row_avx2_awq(QType, const uint8_t*, int, float*) { return false; }
#endif

}  // namespace cpu
}  // namespace pyllm
