// AVX-512 VNNI row kernels (Isa::Avx512 and Isa::Amx's GEMV).  The 32-element block dots of gemv_legacy_impl.h
// compiled for AVX-512 F/BW/VL + VNNI: the same 256-bit block loop with each u8 x s8 block sum one vpdpbusd
// (AVX2 needs vpmaddubsw + vpmaddwd), so results are bit-identical to AVX2.  Types without an entry here keep
// their AVX2 kernels (the dispatcher falls back per type).
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
#include "gemv_legacy_impl.h"
#endif

namespace pyllm {
namespace cpu {

#ifdef PYLLM_VNNI
bool avx512_compiled() { return true; }
// Q4_0..Q8_0 only: they are where the integer dot is the inner loop's largest cost.  (K-quants and AWQ: AVX2.)
RowKernel row_kernel_avx512(QType t) { return avx512::row_kernel_legacy_blocks(t); }
#else
bool avx512_compiled() { return false; }
RowKernel row_kernel_avx512(QType) { return {}; }
#endif

}  // namespace cpu
}  // namespace pyllm
