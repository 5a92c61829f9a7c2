// Internals shared by the CPU kernel files: the activation formats, the per-row dot signature and the
// per-ISA kernel tables.  Not part of the launcher API (that is csrc/kernels.h).
#pragma once

#include <cstddef>
#include <cstdint>

#include "../common/blocks.h"
#include "../kernels.h"

// Software prefetch distance of the weight streams in the row kernels.  One core keeps only a limited number of L1
// misses in flight; the decode math between loads otherwise starves the hardware prefetcher of issue slots.
// PYLLM_PREFETCH: the AVX2 kernels; PYLLM_PREFETCH_VNNI: the AVX-512 VNNI ones (Isa::Avx512 and Amx's GEMVs), whose
// faster block loops need the lines sooner.  Swept on a Xeon VM (AVX-512 + AMX, 2 cores; docs/BENCHMARKS.md, "Weight
// prefetch distance"): VNNI 1536 -> 8192 took SmolLM2's tg from ~195 to ~260 tok/s and Gemma 3's from ~74 to ~83;
// the AVX2 kernels gained on SmolLM2 but lost 10% on Gemma 3 there, so they keep 1536.  DRAM-bound 8B shapes
// moved within noise either way.
#ifndef PYLLM_PREFETCH
#define PYLLM_PREFETCH 1536
#endif
#ifndef PYLLM_PREFETCH_VNNI
#define PYLLM_PREFETCH_VNNI 8192
#endif
// The same for the KV cache rows attention reads (attention.cpp): a shorter stream per (row, kv head), read by
// dot loops with less math per byte.
#ifndef PYLLM_KV_PREFETCH
#define PYLLM_KV_PREFETCH 1536
#endif

namespace pyllm {
namespace cpu {

// What the rows-by-8 kernels need to know of a 32-element group block type (blocks.h): fifth code bits (Q5),
// a block min (Q4_1, Q5_1) or the code offset folded into c = offset * dw (Q4_0: -8, Q5_0: -16).
template <class G>
struct Rows8;
template <>
struct Rows8<block_q4_0x8> {
    static constexpr bool five = false, has_min = false;
    static constexpr float offset = -8.f;
};
template <>
struct Rows8<block_q4_1x8> {
    static constexpr bool five = false, has_min = true;
    static constexpr float offset = 0.f;
};
template <>
struct Rows8<block_q5_0x8> {
    static constexpr bool five = true, has_min = false;
    static constexpr float offset = -16.f;
};
template <>
struct Rows8<block_q5_1x8> {
    static constexpr bool five = true, has_min = true;
    static constexpr float offset = 0.f;
};

// AMX tile configuration (Intel SDM vol. 1, 3.2: LDTILECFG's 64-byte memory operand), palette 1.
struct alignas(64) AmxTileConfig {
    uint8_t palette = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// LDTILECFG with the whole 64-byte configuration as the asm's memory input.  gcc 12's _tile_loadconfig builtin
// does not tell the optimizer that it reads the rows and colsb fields, so a configuration filled in a loop lost
// those stores (the loaded palette had every tile unconfigured, and the first tile instruction raised SIGILL).
inline void load_tile_config(const AmxTileConfig& cfg) {
#if defined(__x86_64__)
    __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
#else
    (void)cfg;
#endif
}

// How x is prepared before the row dots run (once per call, then shared by every row and thread).
enum class Act : int {
    F32,    // fp32 as given (float weight types)
    Q8_32,   // Q8Row: int8 per 32 values (Q4_0 ... Q8_0)
    Q16_32,  // Q16Row: int16 per 32 values (Q8_0 when the caller asks for precise activations)
    Q8_K,   // block_q8_K per 256 values (K-quants)
};

// One weight row against M activation rows: y[m * ldy] = dot(W row, x_m) for m < M.
// w: one row (K / block_size blocks); xa: M prepared activation rows, xa_stride bytes apart.
using RowDot = void (*)(int K, const uint8_t* w, const uint8_t* xa, size_t xa_stride, float* y, size_t ldy);

// n consecutive weight rows, row_bytes apart, against the same M activation rows: y[m * ldy + r] for r < n.
// The frame calls it once per chunk where a kernel has it, so the per-call setup (prologue, activation row
// pointers, accumulator init) is paid once per chunk instead of once per row: on short rows (K = 576 ... 896,
// the small models' output projections) that setup is a visible share of a row's work.
using RowsDot = void (*)(int K, int n, const uint8_t* w, size_t row_bytes, const uint8_t* xa, size_t xa_stride,
                         float* y, size_t ldy);

struct RowKernel {
    Act act = Act::F32;
    RowDot fn[GEMV_MAX_M] = {};     // fn[M - 1]; all null = not available for this ISA
    RowsDot rows[GEMV_MAX_M] = {};  // rows[M - 1], or null: the frame loops over fn[M - 1]
    // Rows per interleaved group (8 for the Q*_R8 layouts, which have no one-row fn): the frame hands rows[]
    // only chunks that start and end on a multiple of it.
    int group = 1;
    bool available() const { return fn[0] != nullptr || rows[0] != nullptr; }
};

// A RowsDot from a row dot: the loop with the row dot inlined into it (flatten), so the compiler can keep the
// activation row pointers and constants in registers across rows.  Same code per row, so the same bits as fn.
template <int M, RowDot F>
__attribute__((flatten)) void rows_of(int K, int n, const uint8_t* w, size_t row_bytes, const uint8_t* xa, size_t xs,
                                      float* y, size_t ldy) {
    for (int r = 0; r < n; ++r) F(K, w + row_bytes * r, xa, xs, y + r, ldy);
}

// Kernel tables.  The _generic one covers every CPU type; the SIMD one leaves types it lacks empty (the
// dispatcher then falls back to _generic for that type).
RowKernel row_kernel_generic(QType t);
RowKernel row_kernel_avx2_legacy(QType t);   // float types + 32-element blocks
RowKernel row_kernel_avx2_kquants(QType t);  // K-quants
RowKernel row_kernel_avx2_awq(QType t);      // AWQ rows (AWQ_G32 ... AWQ_G256)
// Kernels for gemv_cpu(precise_x = true): 16-bit activations; empty for types that have none (Q8_0 has).
RowKernel row_kernel_generic_x16(QType t);
RowKernel row_kernel_avx2_x16(QType t);
RowKernel row_kernel_avx512(QType t);        // AVX-512 VNNI rows (gemv_avx512.cpp); empty where AVX2 is as fast
RowKernel row_kernel_vnni_emulated(QType t);  // the same kernels as AVX2 code, for tests (gemv_vnni_emulated.cpp)
RowKernel row_kernel_avx512_x16(QType t);     // precise_x Q8_0 rows, each int16 pair sum one vpdpwssd
RowKernel row_kernel_vnni_emulated_x16(QType t);  // the same kernels as AVX2 code, for tests
RowKernel row_kernel_generic_rows8(QType t);  // Q*_R8 without SIMD: each row unpacked, then the generic row dot
RowKernel row_kernel_generic_rows8_x16(QType t);  // Q8_0_R8 against 16-bit activations, likewise
bool avx2_compiled();
// Built with the AVX-512 kernels, and this CPU and its OS run them (isa.cpp).
bool avx512_runs_natively();
bool avx512_compiled();
// AMX-BF16 tiles usable by this process: CPUID (AMX-TILE, AMX-BF16, AVX512_BF16 for the packing), OS state
// (XCR0) and Linux's tile-data permission, which this call requests once (gemm_amx.cpp).  For the prefill GEMM;
// the GEMV never needs it.
bool amx_usable();

// One row of K values -> fp32, bit-identical to the decode.h decoders; false if the type has no AVX2 version.
bool dequant_row_avx2_legacy(QType t, const uint8_t* w, int K, float* out);
bool dequant_row_avx2_kquants(QType t, const uint8_t* w, int K, float* out);
bool dequant_row_avx2_awq(QType t, const uint8_t* w, int K, float* out);

// This thread's scratch of at least n int32, valid until its next call.  Defined in gemv.cpp, not in the kernel
// headers: those are also compiled under AVX-512 target pragmas, and a std::vector instantiated there emits weak
// std:: functions built for AVX-512 that the linker may keep as every file's copy, AVX2-only CPUs included.
int32_t* thread_scratch_i32(size_t n);
// The Q4_K/Q5_K rows kernels' view of M block_q8_K activation rows (xs bytes apart, nb blocks each): xr[m], row m,
// and bw[m], its bsum pairs in this thread's scratch: bw[m][4 b + t] = (bsum_4t + bsum_4t+1) | (bsum_4t+2 +
// bsum_4t+3) << 16, |.| <= 4064.
void q8_K_rows_with_bsum_pairs(const uint8_t* xa, size_t xs, int M, int nb, const block_q8_K** xr,
                               const int32_t** bw);

// One row of K values of any CPU type -> fp32 (dequantize_rows_cpu's per-row step, without its thread team, for
// callers already inside a parallel region).
void dequantize_row(QType t, const uint8_t* w, int K, float* out);

// Group size of an AWQ row type (0 for every other type).
inline int awq_group_size(QType t) {
    switch (t) {
        case QType::AWQ_G32: return 32;
        case QType::AWQ_G64: return 64;
        case QType::AWQ_G128: return 128;
        case QType::AWQ_G256: return 256;
        default: return 0;
    }
}

// One activation row for the 32-element types, structure-of-arrays so 8 consecutive block scales load as one
// vector.  For block b: d[b] = max|x| / 127 (fp32: these never leave the cache, so no fp16 rounding),
// qs[32b..32b+31] = round(x / d), s[b] = d * sum(qs of b), which applies the Q4_0/Q5_0 offsets and the
// Q4_1/Q5_1 mins once per block, and sum[b] = sum(qs of b) exactly (the VNNI Q8_0 rows kernel offsets its
// signed codes by 128 and takes 128 * sum back).  Bytes: qs [K] | d [nbp] | s [nbp] | sum [nbp], nbp = K/32
// rounded up to 8.
template <class I, class F, class S>
struct Q8RowT {
    I* qs;
    F* d;
    F* s;
    S* sum;
};
using Q8Row = Q8RowT<int8_t, float, int32_t>;
using Q8RowC = Q8RowT<const int8_t, const float, const int32_t>;

inline int q8_row_nbp(int K) { return (K / QK + 7) / 8 * 8; }
inline size_t q8_row_bytes(int K) { return static_cast<size_t>(K) + 12 * static_cast<size_t>(q8_row_nbp(K)); }
inline Q8Row q8_row(uint8_t* p, int K) {
    float* d = reinterpret_cast<float*>(p + K);
    const int nbp = q8_row_nbp(K);
    return {reinterpret_cast<int8_t*>(p), d, d + nbp, reinterpret_cast<int32_t*>(d + 2 * nbp)};
}
inline Q8RowC q8_row(const uint8_t* p, int K) {
    const float* d = reinterpret_cast<const float*>(p + K);
    const int nbp = q8_row_nbp(K);
    return {reinterpret_cast<const int8_t*>(p), d, d + nbp, reinterpret_cast<const int32_t*>(d + 2 * nbp)};
}

// One activation row at 16 bits, for the Q8_0 output projection (gemv_cpu's precise_x): int16 codes per 32
// values with d[b] = max|x| / 32767 (fp32).  With int8 activations a Q8_0 GEMV's error is dominated by the
// activations, and the tied output matrices of small models (SmolLM2, Qwen2.5 and Gemma 3 keep them in Q8_0)
// put that error straight into the logits: on SmolLM2 it is a quarter of the decode path's KL from float32.
// On AVX2 the int16 dot (2 vpmovsxbw + 2 vpmaddwd + 1 vpaddd per 32 weights) costs one uop more than the int8
// one, so the weight stream still sets the speed.  Only for the output: inside a layer q/k/v (and gate/up)
// read one shared input, and giving the Q8_0 one of them different rounding than its Q5_0 siblings was
// measured to hurt (Qwen2.5's attention-sink token).  Bytes: qs [K] int16 | d [nbp] floats.
template <class I, class F>
struct Q16RowT {
    I* qs;
    F* d;
};
using Q16Row = Q16RowT<int16_t, float>;
using Q16RowC = Q16RowT<const int16_t, const float>;

inline size_t q16_row_bytes(int K) { return 2 * static_cast<size_t>(K) + 4 * static_cast<size_t>(q8_row_nbp(K)); }
inline Q16Row q16_row(uint8_t* p, int K) {
    return {reinterpret_cast<int16_t*>(p), reinterpret_cast<float*>(p + 2 * static_cast<size_t>(K))};
}
inline Q16RowC q16_row(const uint8_t* p, int K) {
    return {reinterpret_cast<const int16_t*>(p), reinterpret_cast<const float*>(p + 2 * static_cast<size_t>(K))};
}

// Activation quantizers: x [K] -> a Q8Row, or K/256 block_q8_K.  The generic and AVX2 versions produce
// identical bytes (same fp32 products, round-to-nearest-even), so both ISAs see the same inputs.
void quantize_q8_32_generic(const float* x, int K, Q8Row out);
void quantize_q8_K_generic(const float* x, int K, block_q8_K* out);
void quantize_q8_32_avx2(const float* x, int K, Q8Row out);
void quantize_q8_K_avx2(const float* x, int K, block_q8_K* out);
void quantize_q16_32_generic(const float* x, int K, Q16Row out);
void quantize_q16_32_avx2(const float* x, int K, Q16Row out);

// Bytes one activation row takes in a given format (multiples of 32, so rows stay 32-byte aligned).
inline size_t act_row_bytes(Act a, int K) {
    switch (a) {
        case Act::F32: return static_cast<size_t>(K) * sizeof(float);
        case Act::Q8_32: return q8_row_bytes(K);
        case Act::Q16_32: return q16_row_bytes(K);
        case Act::Q8_K: return static_cast<size_t>(K / QK_K) * sizeof(block_q8_K);
    }
    return 0;
}

}  // namespace cpu
}  // namespace pyllm

// Fills a RowKernel's fn[] with the 8 instances of a `template <int M>` row dot.
#define PYLLM_ROWDOT_TABLE(f) {f<1>, f<2>, f<3>, f<4>, f<5>, f<6>, f<7>, f<8>}
// Fills a RowKernel's rows[] with the chunk loops over them.
#define PYLLM_ROWSDOT_TABLE(f)                                                                                     \
    {pyllm::cpu::rows_of<1, f<1>>, pyllm::cpu::rows_of<2, f<2>>, pyllm::cpu::rows_of<3, f<3>>,                   \
     pyllm::cpu::rows_of<4, f<4>>, pyllm::cpu::rows_of<5, f<5>>, pyllm::cpu::rows_of<6, f<6>>,                   \
     pyllm::cpu::rows_of<7, f<7>>, pyllm::cpu::rows_of<8, f<8>>}
