// The CPU bindings' checks (csrc/bindings_*.cpp): every tensor is checked here (dtype, device, rank, shape,
// contiguity, block divisibility, bytes per row) before a raw pointer goes to a launcher in kernels.h.  Bad calls
// raise Python exceptions that name the function, the argument and the offending values:
//   TypeError (wrong dtype), ValueError (device / shape / layout / unknown type id),
//   NotImplementedError (a real GGML type the kernels do not handle; ops.py falls back to torch on it).
// Only the binding files include this header: it is the one place that sees torch and the kernels both.
#pragma once

// The parts of torch the bindings use, not <torch/extension.h>: that one pulls torch's whole C++ API, ~40 s of
// parsing for each file that includes it, against ~15 s for these.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mm.h>
#include <torch/csrc/utils/pybind.h>  // at::Tensor <-> torch.Tensor for pybind11

#include <optional>

#include "bindings_format.h"
#include "kernels.h"

namespace pyllm {
namespace bind {

using at::Tensor;

inline const QTypeTraits& check_qtype(const char* fn, int64_t id) {
    const QTypeTraits* tr = pyllm::qtype_traits(static_cast<int>(id));
    PYLLM_CHECK_VALUE(tr != nullptr && id >= 0 && id < pyllm::QTYPE_ID_LIMIT, fn, ": unknown GGML type id ", id);
    PYLLM_CHECK_NOT_IMPLEMENTED(tr->cpu, fn, ": ", tr->name, " (GGML type ", id,
                                ") is not supported by the CPU kernels");
    return *tr;
}

inline void check_tensor(const char* fn, const char* name, const Tensor& t, at::ScalarType dtype, int64_t ndim) {
    PYLLM_CHECK_TYPE(t.scalar_type() == dtype, fn, ": ", name, " must be ", c10::toString(dtype), ", got ",
                     c10::toString(t.scalar_type()));
    PYLLM_CHECK_VALUE(t.device().is_cpu(), fn, ": ", name, " is on ", t.device().str(),
                      " but the CPU kernels need CPU tensors");
    PYLLM_CHECK_VALUE(t.dim() == ndim, fn, ": ", name, " must be ", ndim, "-D, got shape ", t.sizes());
    PYLLM_CHECK_VALUE(t.is_contiguous(), fn, ": ", name, " must be contiguous (shape ", t.sizes(), ", strides ",
                      t.strides(), ")");
}

// A weight tensor (argument `name`, "w" by default): uint8 [N, row_bytes] raw GGUF blocks for rows of K values.
inline void check_weight(const char* fn, const Tensor& w, const QTypeTraits& tr, int64_t K, const char* name = "w") {
    check_tensor(fn, name, w, at::kByte, 2);
    PYLLM_CHECK_VALUE(K > 0 && K % tr.block_size == 0, fn, ": ", name, ": K=", K, " is not a multiple of ", tr.name,
                      "'s block size ", tr.block_size);
    const int64_t need = K / tr.block_size * tr.type_size;
    PYLLM_CHECK_VALUE(w.size(1) == need, fn, ": ", name, " has ", w.size(1), " bytes per row but ", tr.name,
                      " with K=", K, " needs ", need);
    PYLLM_CHECK_VALUE(w.size(0) > 0 && w.size(0) <= INT32_MAX && K <= INT32_MAX, fn, ": ", name, " has shape ",
                      w.sizes(), ", supported rows are 1..2^31-1");
}

// The Q*_R8 layouts hold whole groups of 8 rows.
inline void check_rows8(const char* fn, const char* name, const Tensor& w, int64_t qtype) {
    const QType t = static_cast<QType>(qtype);
    PYLLM_CHECK_VALUE(!pyllm::is_rows8(t) || w.size(0) % 8 == 0, fn, ": ", name, " is ", pyllm::qtype_name(t),
                      " (rows interleaved by 8) but has ", w.size(0), " rows, not a multiple of 8");
}

// A KV cache part: kv_type 0 f32, 1 f16, 2 q8_0, 3 q4_0 (pyllm.runtime.kv_cache's storage); t has `lead` dims then
// head_dim values (float types) or head_dim/32 blocks as bytes (uint8).  Returns the row bytes.
inline size_t check_kv_rows(const char* fn, const char* name, const Tensor& t, int64_t kv_type, int64_t head_dim,
                            int64_t lead) {
    PYLLM_CHECK_VALUE(kv_type >= 0 && kv_type <= 3, fn, ": ", name, " type must be 0 (f32), 1 (f16), 2 (q8_0) or 3 "
                      "(q4_0), got ", kv_type);
    const auto kt = static_cast<pyllm::KVType>(kv_type);
    const bool block = kt == pyllm::KVType::Q8_0 || kt == pyllm::KVType::Q4_0;
    PYLLM_CHECK_VALUE(!block || head_dim % 32 == 0, fn, ": ", name, ": block types need head_dim % 32 == 0, got ",
                      head_dim);
    const at::ScalarType want = block ? at::kByte : kt == pyllm::KVType::F16 ? at::kHalf : at::kFloat;
    check_tensor(fn, name, t, want, lead + 1);
    const int64_t row = static_cast<int64_t>(pyllm::kv_row_bytes(kt, static_cast<int>(head_dim)));
    const int64_t last = block ? row : head_dim;
    PYLLM_CHECK_VALUE(t.size(lead) == last, fn, ": ", name, " rows have ", t.size(lead), " entries, expected ", last);
    return static_cast<size_t>(row);
}

inline Tensor make_out(const char* fn, const std::optional<Tensor>& out, int64_t M, int64_t N) {
    if (!out) return at::empty({M, N}, at::kFloat);
    check_tensor(fn, "out", *out, at::kFloat, 2);
    PYLLM_CHECK_VALUE(out->size(0) == M && out->size(1) == N, fn, ": out has shape ", out->sizes(), ", expected [",
                      M, ", ", N, "]");
    return *out;
}

}  // namespace bind
}  // namespace pyllm
