// The only file that sees torch: every tensor is checked here (dtype, device, rank, shape, contiguity,
// block divisibility, bytes per row) before a raw pointer goes to a launcher in kernels.h.  Bad calls raise
// Python exceptions that name the function, the argument and the offending values:
//   TypeError (wrong dtype), ValueError (device / shape / layout / unknown type id),
//   NotImplementedError (a real GGML type the kernels do not handle; ops.py falls back to torch on it).
#include <torch/extension.h>

#include <optional>
#include <string>
#include <vector>

#include "kernels.h"

namespace {

using at::Tensor;
using pyllm::QType;
using pyllm::QTypeTraits;

const QTypeTraits& check_qtype(const char* fn, int64_t id) {
    const QTypeTraits* tr = pyllm::qtype_traits(static_cast<int>(id));
    TORCH_CHECK_VALUE(tr != nullptr && id >= 0 && id < 64, fn, ": unknown GGML type id ", id);
    TORCH_CHECK_NOT_IMPLEMENTED(tr->cpu, fn, ": ", tr->name, " (GGML type ", id,
                                ") is not supported by the CPU kernels");
    return *tr;
}

void check_tensor(const char* fn, const char* name, const Tensor& t, at::ScalarType dtype, int64_t ndim) {
    TORCH_CHECK_TYPE(t.scalar_type() == dtype, fn, ": ", name, " must be ", c10::toString(dtype), ", got ",
                     c10::toString(t.scalar_type()));
    TORCH_CHECK_VALUE(t.device().is_cpu(), fn, ": ", name, " is on ", t.device().str(),
                      " but the CPU kernels need CPU tensors");
    TORCH_CHECK_VALUE(t.dim() == ndim, fn, ": ", name, " must be ", ndim, "-D, got shape ", t.sizes());
    TORCH_CHECK_VALUE(t.is_contiguous(), fn, ": ", name, " must be contiguous (shape ", t.sizes(), ", strides ",
                      t.strides(), ")");
}

// w: uint8 [N, row_bytes] raw GGUF blocks for rows of K values.
void check_weight(const char* fn, const Tensor& w, const QTypeTraits& tr, int64_t K) {
    check_tensor(fn, "w", w, at::kByte, 2);
    TORCH_CHECK_VALUE(K > 0 && K % tr.block_size == 0, fn, ": K=", K, " is not a multiple of ", tr.name,
                      "'s block size ", tr.block_size);
    const int64_t need = K / tr.block_size * tr.type_size;
    TORCH_CHECK_VALUE(w.size(1) == need, fn, ": w has ", w.size(1), " bytes per row but ", tr.name, " with K=", K,
                      " needs ", need);
    TORCH_CHECK_VALUE(w.size(0) > 0 && w.size(0) <= INT32_MAX && K <= INT32_MAX, fn, ": w has shape ", w.sizes(),
                      ", supported rows are 1..2^31-1");
}

Tensor make_out(const char* fn, const std::optional<Tensor>& out, int64_t M, int64_t N) {
    if (!out) return at::empty({M, N}, at::kFloat);
    check_tensor(fn, "out", *out, at::kFloat, 2);
    TORCH_CHECK_VALUE(out->size(0) == M && out->size(1) == N, fn, ": out has shape ", out->sizes(), ", expected [",
                      M, ", ", N, "]");
    return *out;
}

// y = x @ W.T for 1 <= M <= 8 rows of x: x f32 [M, K], w u8 [N, row_bytes] -> y f32 [M, N]
Tensor gemv(const Tensor& x, const Tensor& w, int64_t qtype, const std::optional<Tensor>& out) {
    const QTypeTraits& tr = check_qtype("gemv", qtype);
    check_tensor("gemv", "x", x, at::kFloat, 2);
    const int64_t M = x.size(0), K = x.size(1);
    TORCH_CHECK_VALUE(M >= 1 && M <= pyllm::GEMV_MAX_M, "gemv: x has ", M, " rows, the fused GEMV takes 1..",
                      pyllm::GEMV_MAX_M, " (use gemm)");
    check_weight("gemv", w, tr, K);
    const int64_t N = w.size(0);
    Tensor y = make_out("gemv", out, M, N);
    pyllm::gemv_cpu(static_cast<QType>(qtype), w.data_ptr<uint8_t>(), static_cast<size_t>(w.size(1)),
                    x.data_ptr<float>(), y.data_ptr<float>(), static_cast<int>(M), static_cast<int>(N),
                    static_cast<int>(K));
    return y;
}

// y = x @ W.T for any M (prefill): W is dequantized a tile of rows at a time into an fp32 buffer that stays
// in cache, and each tile goes through torch's GEMM (MKL / oneDNN).  x f32 [M, K] -> y f32 [M, N]
Tensor gemm(const Tensor& x, const Tensor& w, int64_t qtype, const std::optional<Tensor>& out) {
    const QTypeTraits& tr = check_qtype("gemm", qtype);
    check_tensor("gemm", "x", x, at::kFloat, 2);
    const int64_t M = x.size(0), K = x.size(1);
    TORCH_CHECK_VALUE(M >= 1, "gemm: x has no rows");
    check_weight("gemm", w, tr, K);
    const int64_t N = w.size(0);
    Tensor y = make_out("gemm", out, M, N);
    // ~8 MiB of fp32 per tile: big enough for an efficient GEMM, small enough to stay in L3.
    int64_t tile = std::max<int64_t>(64, (int64_t{2} << 20) / K);
    tile = std::min(N, (tile + 15) / 16 * 16);
    Tensor buf = at::empty({tile, K}, at::kFloat);
    for (int64_t n0 = 0; n0 < N; n0 += tile) {
        const int64_t nr = std::min(tile, N - n0);
        pyllm::dequantize_rows_cpu(static_cast<QType>(qtype), w.data_ptr<uint8_t>() + n0 * w.size(1),
                                   static_cast<size_t>(w.size(1)), nullptr, nr, static_cast<int>(K),
                                   buf.data_ptr<float>());
        Tensor yt = y.narrow(1, n0, nr);
        if (nr == N) at::mm_out(yt, x, buf.t());
        else yt.copy_(at::mm(x, buf.narrow(0, 0, nr).t()));
    }
    return y;
}

// Up to this many rows, mul_mat runs the fused GEMV on 8-row chunks instead of dequantize + GEMM: measured
// single-thread on 4096x4096 Q4_0/Q4_K, 2-4 GEMV passes (int8 maddubs: 32 MACs per instruction, W read
// quantized) take 8-19 ms where dequantizing W alone costs ~30 ms; above ~64 rows the fp32 GEMM wins.
constexpr int64_t GEMV_CHUNKED_MAX_M = 32;

Tensor gemv_chunked(const Tensor& x, const Tensor& w, int64_t qtype, const std::optional<Tensor>& out) {
    const int64_t M = x.size(0);
    check_tensor("mul_mat", "x", x, at::kFloat, 2);
    check_tensor("mul_mat", "w", w, at::kByte, 2);
    Tensor y = make_out("mul_mat", out, M, w.size(0));
    for (int64_t m0 = 0; m0 < M; m0 += pyllm::GEMV_MAX_M) {
        const int64_t mr = std::min<int64_t>(pyllm::GEMV_MAX_M, M - m0);
        gemv(x.narrow(0, m0, mr), w, qtype, y.narrow(0, m0, mr));  // row slices of contiguous tensors stay contiguous
    }
    return y;
}

// y = x @ W.T picking the path: fused GEMV for M <= 8 rows (chunks of 8 up to GEMV_CHUNKED_MAX_M), dequantized
// tiles + GEMM above.  x may have any leading dims: f32 [..., K] -> [..., N] (`out` likewise).  One call from
// Python, so decode pays one crossing.
Tensor mul_mat(const Tensor& x, const Tensor& w, int64_t qtype, const std::optional<Tensor>& out) {
    if (x.dim() == 2) {
        if (x.size(0) >= 1 && x.size(0) <= pyllm::GEMV_MAX_M) return gemv(x, w, qtype, out);
        if (x.size(0) > pyllm::GEMV_MAX_M && x.size(0) <= GEMV_CHUNKED_MAX_M) return gemv_chunked(x, w, qtype, out);
        if (x.size(0) > GEMV_CHUNKED_MAX_M) return gemm(x, w, qtype, out);
    }
    TORCH_CHECK_VALUE(x.dim() >= 1, "mul_mat: x must have at least 1 dimension, got a scalar");
    TORCH_CHECK_VALUE(w.dim() == 2, "mul_mat: w must be 2-D, got shape ", w.sizes());
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = w.size(0);
    const Tensor x2 = x.reshape({-1, x.size(-1)});
    if (x2.size(0) == 0) {
        check_qtype("mul_mat", qtype);
        return out ? *out : at::empty(shape, at::kFloat);
    }
    std::optional<Tensor> out2;
    if (out) {
        TORCH_CHECK_VALUE(out->sizes() == at::IntArrayRef(shape), "mul_mat: out has shape ", out->sizes(),
                          ", expected ", at::IntArrayRef(shape));
        out2 = out->view({-1, w.size(0)});
    }
    const int64_t M = x2.size(0);
    const Tensor y = M <= pyllm::GEMV_MAX_M ? gemv(x2, w, qtype, out2)
                     : M <= GEMV_CHUNKED_MAX_M ? gemv_chunked(x2, w, qtype, out2) : gemm(x2, w, qtype, out2);
    return out ? *out : y.view(shape);
}

// Rows of W as fp32: w u8 [N, row_bytes] -> [N, K], or [len(ids), K] for the rows ids (int64 or int32, 1-D).
Tensor dequantize(const Tensor& w, int64_t qtype, const std::optional<Tensor>& ids) {
    const QTypeTraits& tr = check_qtype("dequantize", qtype);
    check_tensor("dequantize", "w", w, at::kByte, 2);
    TORCH_CHECK_VALUE(w.size(1) % tr.type_size == 0, "dequantize: w has ", w.size(1), " bytes per row, not a ",
                      "multiple of ", tr.name, "'s ", tr.type_size, "-byte block");
    const int64_t K = w.size(1) / tr.type_size * tr.block_size, N = w.size(0);
    check_weight("dequantize", w, tr, K);
    if (!ids) {
        Tensor y = at::empty({N, K}, at::kFloat);
        pyllm::dequantize_rows_cpu(static_cast<QType>(qtype), w.data_ptr<uint8_t>(), static_cast<size_t>(w.size(1)),
                                   nullptr, N, static_cast<int>(K), y.data_ptr<float>());
        return y;
    }
    TORCH_CHECK_TYPE(ids->scalar_type() == at::kLong || ids->scalar_type() == at::kInt,
                     "dequantize: ids must be int64 or int32, got ", c10::toString(ids->scalar_type()));
    TORCH_CHECK_VALUE(ids->device().is_cpu(), "dequantize: ids is on ", ids->device().str(),
                      " but the CPU kernels need CPU tensors");
    TORCH_CHECK_VALUE(ids->dim() == 1, "dequantize: ids must be 1-D, got shape ", ids->sizes());
    const Tensor idx = ids->to(at::kLong).contiguous();
    const int64_t* p = idx.data_ptr<int64_t>();
    for (int64_t i = 0; i < idx.numel(); ++i)
        TORCH_CHECK_INDEX(p[i] >= 0 && p[i] < N, "dequantize: ids[", i, "] = ", p[i], " is out of range for ", N,
                          " rows");
    Tensor y = at::empty({idx.numel(), K}, at::kFloat);
    pyllm::dequantize_rows_cpu(static_cast<QType>(qtype), w.data_ptr<uint8_t>(), static_cast<size_t>(w.size(1)), p,
                               idx.numel(), static_cast<int>(K), y.data_ptr<float>());
    return y;
}

void set_isa(const std::string& name) {
    pyllm::Isa isa;
    if (name == "scalar" || name == "generic") isa = pyllm::Isa::Scalar;
    else if (name == "avx2") isa = pyllm::Isa::Avx2;
    else TORCH_CHECK_VALUE(false, "set_isa: unknown ISA '", name, "', expected 'scalar' or 'avx2'");
    TORCH_CHECK_VALUE(pyllm::cpu_isa_available(isa), "set_isa: '", name,
                      "' is not available (not compiled in, or this CPU lacks it)");
    pyllm::cpu_set_isa(isa);
}

std::vector<std::string> available_isas() {
    std::vector<std::string> r{"scalar"};
    if (pyllm::cpu_isa_available(pyllm::Isa::Avx2)) r.push_back("avx2");
    return r;
}

void set_num_threads(int64_t n) {
    TORCH_CHECK_VALUE(n >= 1 && n <= 4096, "set_num_threads: n must be >= 1, got ", n);
    pyllm::cpu_set_num_threads(static_cast<int>(n));
}

std::vector<int64_t> supported_types() {
    std::vector<int64_t> r;
    for (int id = 0; id < 64; ++id)
        if (pyllm::qtype_traits(id) && pyllm::cpu_type_supported(static_cast<QType>(id))) r.push_back(id);
    return r;
}

uint64_t read_sum(const Tensor& buf, int64_t threads) {
    check_tensor("read_sum", "buf", buf, at::kByte, 1);
    return pyllm::read_sum_cpu(buf.data_ptr<uint8_t>(), static_cast<size_t>(buf.numel()), static_cast<int>(threads));
}

}  // namespace

#ifdef PYLLM_CUDA
namespace pyllm {
void register_cuda(pybind11::module& m);  // csrc/cuda/bindings_cuda.cpp: the cuda_* functions
}
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "pyllm kernels: fused dequantize-in-GEMV (decode), dequantize (+GEMM for prefill)";
    m.def("gemv", &gemv, "y[M,N] = x[M,K] @ W.T, M <= 8, W as raw GGUF blocks u8 [N, row_bytes]", py::arg("x"),
          py::arg("w"), py::arg("qtype"), py::arg("out") = py::none());
    m.def("gemm", &gemm, "y[M,N] = x[M,K] @ W.T for any M: dequantized tiles + torch GEMM", py::arg("x"),
          py::arg("w"), py::arg("qtype"), py::arg("out") = py::none());
    m.def("mul_mat", &mul_mat, "y[..., N] = x[..., K] @ W.T: gemv (8-row chunks up to 32 rows), else gemm", py::arg("x"),
          py::arg("w"), py::arg("qtype"), py::arg("out") = py::none());
    m.def("dequantize", &dequantize, "W (or rows ids of W) as fp32 [N or len(ids), K]", py::arg("w"),
          py::arg("qtype"), py::arg("ids") = py::none());
    m.def("set_isa", &set_isa, "CPU kernels to use: 'avx2' (default where available) or 'scalar'");
    m.def("get_isa", [] { return std::string(pyllm::cpu_isa_name(pyllm::cpu_get_isa())); });
    m.def("available_isas", &available_isas);
    m.def("set_num_threads", &set_num_threads, "threads for pyllm's CPU kernels (torch's own setting untouched)");
    m.def("get_num_threads", &pyllm::cpu_get_num_threads);
    m.def("physical_cores", &pyllm::cpu_physical_cores);
    m.def("supported_types", &supported_types, "GGML type ids the CPU kernels handle");
    m.def("qtype_name", [](int64_t id) {
        const QTypeTraits* tr = pyllm::qtype_traits(static_cast<int>(id));
        return std::string(tr ? tr->name : "unknown");
    });
    m.def("read_sum", &read_sum, "sum of buf as uint64 words, read by `threads` threads (bandwidth probe)",
          py::arg("buf"), py::arg("threads"));
    m.attr("GEMV_MAX_M") = pyllm::GEMV_MAX_M;
    m.attr("GEMV_CHUNKED_MAX_M") = GEMV_CHUNKED_MAX_M;
#ifdef PYLLM_CUDA
    pyllm::register_cuda(m);
#endif
}
