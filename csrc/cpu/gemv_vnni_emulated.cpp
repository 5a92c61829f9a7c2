// The AVX-512 VNNI row kernels of gemv_avx512.cpp compiled as AVX2 code: the same sources (gemv_legacy_impl.h,
// gemv_kquants_impl.h, gemv_awq_impl.h with PYLLM_VNNI), where avx2_util.h's dpbusd and madd_add compute
// vpdpbusd's and vpdpwssd's exact sums from AVX2 instructions.  A CPU without
// AVX-512 can then run every line the VNNI kernels have beyond the AVX2 ones -- their accumulation in int32
// instead of int16, the Q5 and Q8_0 int32 paths, the rows-by-8 groups -- once a test turns it on with
// cpu_emulate_avx512 (tests/test_kernels.py's fixture, the multi-row step test).  Never a default: it only stands
// in for instructions the CPU lacks.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PYLLM_VNNI 1
#define PYLLM_VNNI_EMULATED 1
#endif

#include "avx2_util.h"
#include "cpu_impl.h"
#ifdef PYLLM_VNNI_EMULATED
#include "gemv_awq_impl.h"
#include "gemv_kquants_impl.h"
#include "gemv_legacy_impl.h"
#endif

namespace pyllm {
namespace cpu {

#ifdef PYLLM_VNNI_EMULATED
RowKernel row_kernel_vnni_emulated(QType t) {
    RowKernel k = vnni_emulated::row_kernel_legacy_blocks(t);
    if (!k.available()) k = vnni_emulated::row_kernel_kquant_blocks(t);
    if (!k.available()) k = vnni_emulated::row_kernel_awq_rows(t);
    return k;
}
RowKernel row_kernel_vnni_emulated_x16(QType t) { return vnni_emulated::row_kernel_legacy_x16(t); }
#else
RowKernel row_kernel_vnni_emulated(QType) { return {}; }
RowKernel row_kernel_vnni_emulated_x16(QType) { return {}; }
#endif

}  // namespace cpu
}  // namespace pyllm
