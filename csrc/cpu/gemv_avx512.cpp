// AVX-512 VNNI row kernels (Isa::Avx512 and Isa::Amx's GEMV): the row dots of gemv_legacy_impl.h (32-element
// blocks), gemv_kquants_impl.h (K-quants) and gemv_awq_impl.h (AWQ rows) compiled for AVX-512 F/BW/VL + VNNI.
// The same 256-bit block loops, where each u8 x s8 block sum is one vpdpbusd (AVX2: vpmaddubsw + vpmaddwd) and
// each int16 scale multiply-add one vpdpwssd (AVX2: vpmaddwd + vpaddd), so results are bit-identical to AVX2.
// Types without an entry here (float weights, Q2_K, Q3_K) keep their AVX2 kernels (the dispatcher falls back per
// type).
//
// The file is compiled with the rest of the extension (-march=native), so the target pragma gives these
// functions AVX-512 even on a build for an AVX2-only or baseline x86-64 machine; they only run after
// cpu_isa_available(Isa::Avx512) checked CPUID and XCR0.  On other architectures the table is empty.
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
#define PYLLM_VNNI 1
#endif

#include "avx2_util.h"
#include "cpu_impl.h"
#ifdef PYLLM_VNNI
#include "gemv_awq_impl.h"
#include "gemv_kquants_impl.h"
#include "gemv_legacy_impl.h"
#endif

namespace pyllm {
namespace cpu {

#ifdef PYLLM_VNNI
bool avx512_compiled() { return true; }
RowKernel row_kernel_avx512(QType t) {
    RowKernel k = avx512::row_kernel_legacy_blocks(t);
    if (!k.available()) k = avx512::row_kernel_kquant_blocks(t);
    if (!k.available()) k = avx512::row_kernel_awq_rows(t);
    return k;
}
RowKernel row_kernel_avx512_x16(QType t) { return avx512::row_kernel_legacy_x16(t); }
#else
bool avx512_compiled() { return false; }
RowKernel row_kernel_avx512(QType) { return {}; }
RowKernel row_kernel_avx512_x16(QType) { return {}; }
#endif

}  // namespace cpu
}  // namespace pyllm
