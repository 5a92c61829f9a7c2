// Every kernel launcher the bindings call: raw pointers, sizes and ints only (no torch, no pybind), so the
// kernels build and test without torch headers and the CUDA launchers can sit beside them unchanged.
//
// Shapes use torch order: a weight is N rows of K values, each row = K / block_size blocks (row_bytes bytes),
// x is [M, K] fp32 row-major, y is [M, N] fp32 row-major.  Callers (bindings.cpp) have already checked
// every size; the launchers assume valid input.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/qtype.h"

namespace pyllm {

// Largest M the fused GEMV takes; above it dequantize + GEMM wins (prefill).
constexpr int GEMV_MAX_M = 8;

// ---- CPU (csrc/cpu) --------------------------------------------------------------------------------------
enum class Isa : int { Scalar = 0, Avx2 = 1 };

bool cpu_type_supported(QType t);      // gemv + dequantize exist for t
bool cpu_isa_available(Isa isa);       // compiled in and the CPU runs it
void cpu_set_isa(Isa isa);             // caller checked availability
Isa cpu_get_isa();
const char* cpu_isa_name(Isa isa);
void cpu_set_num_threads(int n);       // n >= 1
int cpu_get_num_threads();
int cpu_physical_cores();              // cores (not SMT siblings) this process may run on

// y[m, n] = sum_k x[m, k] * W[n, k] for 1 <= M <= GEMV_MAX_M, W read once in its quantized form.
// w: N * row_bytes bytes; x: [M, K]; y: [M, N].
void gemv_cpu(QType t, const uint8_t* w, size_t row_bytes, const float* x, float* y, int M, int N, int K);

// Rows of W to fp32: out[i, :] = W[ids[i], :] (ids == nullptr: all N rows, n_ids = N).  out: [n_ids, K].
void dequantize_rows_cpu(QType t, const uint8_t* w, size_t row_bytes, const int64_t* ids, int64_t n_ids, int K,
                         float* out);

// Sums n bytes as uint64 words with `threads` threads (a streaming read for measuring memory bandwidth).
uint64_t read_sum_cpu(const uint8_t* p, size_t n, int threads);

// ---- CUDA ------------------------------------------------------------------------------------------------
// The CUDA launchers live in csrc/cuda/cuda_kernels.h (they need cuda_runtime.h for cudaStream_t); their
// bindings register themselves through pyllm::register_cuda (bindings.cpp, under PYLLM_CUDA).

}  // namespace pyllm
