// The extension module: the only files that see torch are this one and the bindings_*.cpp files it registers,
// and every tensor they receive is checked (bindings_checks.h) before a raw pointer goes to a launcher in
// kernels.h or cuda/cuda_kernels.h.
#include <torch/csrc/utils/pybind.h>

namespace pyllm {
namespace bind {
void register_kernels(py::module& m);         // bindings_kernels.cpp: gemv, mul_mat, dequantize, repackers, ISA
void register_decode_context(py::module& m);  // bindings_decode_context.cpp: DecodeArch, DecodeContext
void register_decode(py::module& m);          // bindings_decode.cpp: the decode steps over a DecodeContext
void register_rows(py::module& m);            // bindings_rows.cpp: prefill's row operations, the KV row helpers
}  // namespace bind
#ifdef PYLLM_CUDA
void register_cuda(pybind11::module& m);  // cuda/bindings_cuda.cpp: the cuda_* functions
#endif
}  // namespace pyllm

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "pyllm kernels: fused dequantize-in-GEMV (decode), dequantize (+GEMM for prefill)";
    pyllm::bind::register_kernels(m);
    pyllm::bind::register_decode_context(m);  // before the steps, whose signatures name DecodeContext
    pyllm::bind::register_decode(m);
    pyllm::bind::register_rows(m);
#ifdef PYLLM_CUDA
    pyllm::register_cuda(m);
#endif
}
