// Limits shared by the CPU kernels, the CUDA kernels and Python (pyllm/ops.py reads this file's constants by
// name, so each is stated once: change one here and every side follows).
#pragma once

namespace pyllm {

// Largest M (activation rows) one fused GEMV pass takes; above it dequantize + GEMM wins (prefill).  Also the rows
// of one multi-token decode step (speculative verification) and of one batched decode step (a server's slots).
constexpr int GEMV_MAX_M = 8;

}  // namespace pyllm
