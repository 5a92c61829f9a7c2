// Python bindings of the row operations outside the decode step: prefill's causal attention, RMSNorm, RoPE and
// GLU over many rows (csrc/cpu/causal_attention.cpp, decode_step.cpp's row helpers), and the decode step's own KV
// row store and attention for tests.  Every tensor is checked here (bindings_checks.h) before a pointer goes on.
#include <cmath>
#include <vector>

#include "bindings_checks.h"

namespace pyllm {
namespace bind {
namespace {

// The decode step's attention for tests: q [H, hd] f32 over all S rows of k [Hkv, S, row] / v (types as
// check_kv_rows), scale -> out [H, hd] in the storage basis (no rotation, no means).  scalar: the reference loop.
Tensor kv_attention(const Tensor& q, const Tensor& k, const Tensor& v, int64_t k_type, int64_t v_type, double scale,
                    bool scalar) {
    const char* fn = "kv_attention";
    check_tensor(fn, "q", q, at::kFloat, 2);
    const int64_t H = q.size(0), hd = q.size(1);
    const size_t kr = check_kv_rows(fn, "k", k, k_type, hd, 2), vr = check_kv_rows(fn, "v", v, v_type, hd, 2);
    PYLLM_CHECK_VALUE(v.size(0) == k.size(0) && v.size(1) == k.size(1) && k.size(1) >= 1 && H % k.size(0) == 0, fn,
                      ": k/v shapes ", k.sizes(), "/", v.sizes(), " do not fit q ", q.sizes());
    Tensor out = at::empty({H, hd}, q.options());
    const int64_t group = H / k.size(0), S = k.size(1);
    std::vector<float> sc(group * S);
    if (!scalar) {  // the decode step's kernel: one call per KV head for its group of query heads
        for (int64_t kh = 0; kh < k.size(0); ++kh)
            pyllm::kv_attend_group(static_cast<pyllm::KVType>(k_type),
                                   pyllm::kv_rows_flat(static_cast<const uint8_t*>(k.data_ptr()) + kh * S * kr, kr),
                                   static_cast<pyllm::KVType>(v_type),
                                   pyllm::kv_rows_flat(static_cast<const uint8_t*>(v.data_ptr()) + kh * S * vr, vr),
                                   q.data_ptr<float>() + kh * group * hd, hd, static_cast<int>(group),
                                   static_cast<int>(hd), static_cast<int>(S), static_cast<float>(scale), sc.data(),
                                   S, out.data_ptr<float>() + kh * group * hd, hd);
        return out;
    }
    for (int64_t h = 0; h < H; ++h) {
        const auto* kp = static_cast<const uint8_t*>(k.data_ptr()) + (h / group) * S * kr;
        const auto* vp = static_cast<const uint8_t*>(v.data_ptr()) + (h / group) * S * vr;
        pyllm::kv_attend_head_scalar(
            static_cast<pyllm::KVType>(k_type), pyllm::kv_rows_flat(kp, kr), static_cast<pyllm::KVType>(v_type),
            pyllm::kv_rows_flat(vp, vr),
            q.data_ptr<float>() + h * hd, static_cast<int>(hd), static_cast<int>(S), static_cast<float>(scale),
            sc.data(), out.data_ptr<float>() + h * hd);
    }
    return out;
}

// Causal attention of T new positions over S >= T keys (the last T of them the new positions'): q [T, H, hd],
// k / v [S, Hkv, hd] f32, any row and head strides with each head's hd floats contiguous (a [Hkv, S, hd] cache
// view transposed works) -> out [T, H * hd].  window > 0: each position sees only its last `window` keys.
Tensor causal_attention(const Tensor& q, const Tensor& k, const Tensor& v, double scale, int64_t window) {
    const char* fn = "causal_attention";
    const Tensor* args[] = {&q, &k, &v};
    const char* names[] = {"q", "k", "v"};
    for (int i = 0; i < 3; ++i) {
        const Tensor& t = *args[i];
        PYLLM_CHECK_TYPE(t.scalar_type() == at::kFloat, fn, ": ", names[i], " must be float32, got ",
                         c10::toString(t.scalar_type()));
        PYLLM_CHECK_VALUE(t.device().is_cpu(), fn, ": ", names[i], " is on ", t.device().str(),
                          " but the CPU kernels need CPU tensors");
        PYLLM_CHECK_VALUE(t.dim() == 3 && t.size(0) >= 1 && t.size(1) >= 1 && t.size(2) >= 1, fn, ": ", names[i],
                          " must be [positions, heads, head_dim] with every size >= 1, got shape ", t.sizes());
        PYLLM_CHECK_VALUE(t.stride(2) == 1 && t.stride(0) >= 0 && t.stride(1) >= 0, fn, ": ", names[i],
                          " must hold each head's values contiguously (shape ", t.sizes(), ", strides ", t.strides(),
                          ")");
    }
    const int64_t T = q.size(0), H = q.size(1), hd = q.size(2), S = k.size(0), Hkv = k.size(1);
    PYLLM_CHECK_VALUE(k.sizes() == v.sizes() && S >= T && k.size(2) == hd && H % Hkv == 0, fn, ": k ", k.sizes(),
                      " and v ", v.sizes(), " do not fit q ", q.sizes(),
                      " (need [S >= T, Hkv, head_dim] with Hkv dividing the query heads)");
    PYLLM_CHECK_VALUE(S <= (1 << 24) && H * hd <= (1 << 24), fn, ": shapes ", q.sizes(), " / ", k.sizes(),
                      " are too large");
    PYLLM_CHECK_VALUE(window >= 0 && window <= INT32_MAX, fn, ": window must be >= 0 (0: none), got ", window);
    PYLLM_CHECK_VALUE(std::isfinite(scale), fn, ": scale must be finite, got ", scale);
    Tensor out = at::empty({T, H * hd}, q.options());
    pybind11::gil_scoped_release nogil;
    pyllm::causal_attention_cpu(q.data_ptr<float>(), q.stride(0), q.stride(1), k.data_ptr<float>(), k.stride(0),
                                k.stride(1), v.data_ptr<float>(), v.stride(0), v.stride(1), out.data_ptr<float>(),
                                H * hd, static_cast<int>(T), static_cast<int>(S), static_cast<int>(H),
                                static_cast<int>(Hkv), static_cast<int>(hd), static_cast<float>(scale),
                                static_cast<int>(window));
    return out;
}

// Prefill's row operations (kernels.h): RMSNorm over the last dimension, RoPE in place on [T, H, hd], and the
// MLP's act(g) * u in place on g.
Tensor rms_norm(const Tensor& x, const Tensor& w, double eps) {
    const char* fn = "rms_norm";
    check_tensor(fn, "w", w, at::kFloat, 1);
    check_tensor(fn, "x", x, at::kFloat, x.dim());
    PYLLM_CHECK_VALUE(x.dim() >= 1 && x.size(-1) == w.size(0) && w.size(0) >= 1, fn, ": x ", x.sizes(),
                      " does not end in w's size ", w.sizes());
    const int64_t n = w.size(0), rows = x.numel() / n;
    PYLLM_CHECK_VALUE(rows <= INT32_MAX && n <= INT32_MAX, fn, ": x ", x.sizes(), " is too large");
    PYLLM_CHECK_VALUE(std::isfinite(eps) && eps >= 0, fn, ": eps must be finite and >= 0, got ", eps);
    Tensor y = at::empty_like(x);
    pybind11::gil_scoped_release nogil;
    pyllm::rms_norm_rows_cpu(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), static_cast<int>(rows),
                             static_cast<int>(n), static_cast<float>(eps));
    return y;
}

Tensor rope_(const Tensor& x, const Tensor& cos, const Tensor& sin, int64_t rope_dim, bool neox) {
    const char* fn = "rope_";
    check_tensor(fn, "x", x, at::kFloat, 3);
    check_tensor(fn, "cos", cos, at::kFloat, 2);
    check_tensor(fn, "sin", sin, at::kFloat, 2);
    const int64_t T = x.size(0), H = x.size(1), hd = x.size(2);
    PYLLM_CHECK_VALUE(rope_dim >= 2 && rope_dim % 2 == 0 && rope_dim <= hd, fn, ": rope_dim ", rope_dim,
                      " must be even and within the head size ", hd);
    PYLLM_CHECK_VALUE(cos.size(0) == T && cos.size(1) == rope_dim / 2 && sin.sizes() == cos.sizes(), fn, ": cos ",
                      cos.sizes(), " and sin ", sin.sizes(), " must both be [", T, ", ", rope_dim / 2, "]");
    PYLLM_CHECK_VALUE(T <= INT32_MAX && H * hd <= INT32_MAX, fn, ": x ", x.sizes(), " is too large");
    pybind11::gil_scoped_release nogil;
    pyllm::rope_rows_cpu(x.data_ptr<float>(), static_cast<int>(T), static_cast<int>(H), static_cast<int>(hd),
                         cos.data_ptr<float>(), sin.data_ptr<float>(), static_cast<int>(rope_dim), neox);
    return x;
}

Tensor glu_(const Tensor& g, const Tensor& u, bool gelu_tanh) {
    const char* fn = "glu_";
    check_tensor(fn, "g", g, at::kFloat, g.dim());
    check_tensor(fn, "u", u, at::kFloat, g.dim());
    PYLLM_CHECK_VALUE(g.sizes() == u.sizes() && g.dim() >= 1 && g.size(-1) >= 1, fn, ": g ", g.sizes(), " and u ",
                      u.sizes(), " must have one shape");
    const int64_t n = g.size(-1), rows = g.numel() / n;
    PYLLM_CHECK_VALUE(rows <= INT32_MAX && n <= INT32_MAX, fn, ": g ", g.sizes(), " is too large");
    pybind11::gil_scoped_release nogil;
    pyllm::glu_rows_cpu(gelu_tanh, g.data_ptr<float>(), u.data_ptr<float>(), static_cast<int>(rows),
                        static_cast<int>(n));
    return g;
}

// x [N, hd] f32 -> N stored rows of kv_type, as the decode step writes them.
Tensor kv_store(const Tensor& x, int64_t kv_type) {
    check_tensor("kv_store", "x", x, at::kFloat, 2);
    const int64_t n = x.size(0), hd = x.size(1);
    Tensor probe = kv_type == 1 ? at::empty({n, hd}, x.options().dtype(at::kHalf))
                   : kv_type == 0 ? at::empty({n, hd}, x.options())
                                  : at::empty({n, hd / 32 * (kv_type == 2 ? 34 : 18)}, x.options().dtype(at::kByte));
    const size_t row = check_kv_rows("kv_store", "out", probe, kv_type, hd, 1);
    for (int64_t i = 0; i < n; ++i)
        pyllm::kv_store_row(static_cast<pyllm::KVType>(kv_type), x.data_ptr<float>() + i * hd, static_cast<int>(hd),
                            static_cast<uint8_t*>(probe.data_ptr()) + i * row);
    return probe;
}

}  // namespace

void register_rows(py::module& m) {
    m.def("kv_attention", &kv_attention, "decode attention of q [H, hd] over KV rows k/v [Hkv, S, row] (tests)",
          py::arg("q"), py::arg("k"), py::arg("v"), py::arg("k_type"), py::arg("v_type"), py::arg("scale"),
          py::arg("scalar") = false);
    m.def("causal_attention", &causal_attention,
          "causal attention of T new positions over S >= T keys (the last T theirs): q [T, H, hd], k/v [S, Hkv, hd] "
          "f32 -> out [T, H*hd]; window > 0 limits each position to its last `window` keys",
          py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"), py::arg("window") = 0);
    m.def("rms_norm", &rms_norm, "x * rsqrt(mean(x^2, -1) + eps) * w, x f32 [..., n], w [n] (prefill's norms)",
          py::arg("x"), py::arg("w"), py::arg("eps"));
    m.def("rope_", &rope_, "x [T, H, hd] f32 rotated in place by cos/sin [T, rope_dim/2] (neox: half-split pairs)",
          py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("rope_dim"), py::arg("neox"));
    m.def("glu_", &glu_, "g = act(g) * u in place (act: SiLU, or tanh-approximated GELU when gelu_tanh)",
          py::arg("g"), py::arg("u"), py::arg("gelu_tanh"));
    m.def("kv_store", &kv_store, "x [N, hd] f32 -> N KV cache rows of kv_type, as decode_step stores them",
          py::arg("x"), py::arg("kv_type"));
}

}  // namespace bind
}  // namespace pyllm
