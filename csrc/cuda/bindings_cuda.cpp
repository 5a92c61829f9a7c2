// The CUDA launchers' torch boundary: every tensor is checked here (device, dtype, shape, contiguity,
// alignment), sizes are derived from the tensors, and only raw pointers, ints and the current stream cross
// into csrc/cuda.  Errors name the argument and the offending value (ValueError / TypeError in Python).
//
// register_cuda(m) adds the cuda_* functions to the one extension module: csrc/bindings.cpp calls it under
// #ifdef PYLLM_CUDA (pyllm/_ext.py defines it when it compiles these files).
#include <ATen/Parallel.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "../common/gemv_tiled.h"
#include "../common/mmq.h"
#include "bindings_format.h"
#include "cuda_kernels.h"

namespace pyllm {
namespace {

void check_tensor(const at::Tensor& t, const char* name, at::ScalarType dt, int64_t ndim) {
    PYLLM_CHECK_VALUE(t.is_cuda(), name, " must be a CUDA tensor, got one on ", t.device());
    PYLLM_CHECK_TYPE(t.scalar_type() == dt, name, " must be ", dt, ", got ", t.scalar_type());
    PYLLM_CHECK_VALUE(t.dim() == ndim, name, " must have ", ndim, " dimensions, got shape ", t.sizes());
    PYLLM_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous (shape ", t.sizes(), ", strides ", t.strides(),
                      ")");
}

void check_same_device(const at::Tensor& a, const char* an, const at::Tensor& b, const char* bn) {
    PYLLM_CHECK_VALUE(a.device() == b.device(), an, " is on ", a.device(), " but ", bn, " is on ", b.device());
}

QType to_qtype(int64_t id) {
    const QTypeTraits* tr = qtype_traits(static_cast<int>(id));
    PYLLM_CHECK_VALUE(tr != nullptr, "qtype ", id, " is not a GGML type id");
    return static_cast<QType>(id);
}

cudaStream_t stream_of(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }

// Checks w against (qtype, K) and returns (N, row_bytes).
std::pair<int64_t, int64_t> check_weight(const at::Tensor& w, QType t, int64_t K, const char* name = "w") {
    check_tensor(w, name, at::kByte, 2);
    const QTypeTraits* tr = qtype_traits(static_cast<int>(t));
    PYLLM_CHECK_VALUE(K > 0 && K % tr->block_size == 0, "K=", K, " is not a positive multiple of the ", tr->name,
                      " block size ", tr->block_size);
    const int64_t row_bytes = static_cast<int64_t>(qtype_row_bytes(t, K));
    PYLLM_CHECK_VALUE(w.size(1) == row_bytes, name, " has rows of ", w.size(1), " bytes, but ", tr->name, " with K=", K,
                      " needs ", row_bytes);
    PYLLM_CHECK_VALUE(w.size(0) >= 1 && w.size(0) < (int64_t{1} << 31), name, " has ", w.size(0),
                      " rows; 1 .. 2^31-1 supported");
    PYLLM_CHECK_VALUE(K < (int64_t{1} << 30), "K=", K, " is too large");
    PYLLM_CHECK_VALUE(!tiled::is_tiled(t) || w.size(0) % tiled::kTileRows == 0, name, " has ", w.size(0), " rows; ",
                      tr->name, " holds tiles of ", tiled::kTileRows);
    return {w.size(0), row_bytes};
}

// Checks xq int8 [M, K] / xds f32 [M, K/32, 2] (cuda_quantize_act's outputs) on the device of `like`; returns M.
int64_t check_codes(const at::Tensor& xq, const at::Tensor& xds, const at::Tensor& like, const char* like_name,
                    int64_t K) {
    check_tensor(xq, "xq", at::kChar, 2);
    check_tensor(xds, "xds", at::kFloat, 3);
    check_same_device(like, like_name, xq, "xq");
    check_same_device(like, like_name, xds, "xds");
    const int64_t M = xq.size(0);
    PYLLM_CHECK_VALUE(xq.size(1) == K && K % 32 == 0, "xq has shape ", xq.sizes(), "; its rows need K=", K,
                      " values, a multiple of 32");
    PYLLM_CHECK_VALUE(xds.size(0) == M && xds.size(1) == K / 32 && xds.size(2) == 2, "xds has shape ", xds.sizes(),
                      ", expected [", M, ", ", K / 32, ", 2]");
    return M;
}

// One matrix of a GEMV launch, checked against (t, K) and M: its part (pointers, sizes) and its output [M, N]
// (out when given, else a new tensor).  index >= 0 names them ws[index] / outs[index] in errors.
std::pair<GemvPart, at::Tensor> checked_part(const at::Tensor& w, QType t, int64_t M, int64_t K,
                                             std::optional<at::Tensor> out, const at::Tensor& xds, int64_t index = -1) {
    const std::string w_name = index < 0 ? "w" : "ws[" + std::to_string(index) + "]";
    const std::string out_name = index < 0 ? "out" : "outs[" + std::to_string(index) + "]";
    const auto [N, row_bytes] = check_weight(w, t, K, w_name.c_str());
    check_same_device(xds, "xds", w, w_name.c_str());
    const int align = gemv_cuda_alignment(t);
    PYLLM_CHECK_VALUE(reinterpret_cast<uintptr_t>(w.data_ptr()) % align == 0, "cuda_gemv: ", qtype_name(t),
                      " weights must be ", align, "-byte aligned; w.data_ptr() % ", align, " = ",
                      reinterpret_cast<uintptr_t>(w.data_ptr()) % align, " (use a fresh copy, not a byte-offset view)");
    at::Tensor y;
    if (out) {
        y = *out;
        check_tensor(y, out_name.c_str(), at::kFloat, 2);
        check_same_device(w, w_name.c_str(), y, out_name.c_str());
        PYLLM_CHECK_VALUE(y.size(0) == M && y.size(1) == N, out_name, " has shape ", y.sizes(), ", expected [", M,
                          ", ", N, "]");
    } else {
        y = at::empty({M, N}, xds.options());
    }
    return {GemvPart{w.data_ptr<uint8_t>(), static_cast<size_t>(row_bytes), y.data_ptr<float>(), static_cast<int>(N)},
            y};
}

int64_t checked_m(QType t, const at::Tensor& xq) {
    PYLLM_CHECK_VALUE(gemv_cuda_supported(t), "cuda_gemv: weight type ", qtype_name(t),
                      " has no CUDA GEMV kernel (supported: Q4_0 Q4_1 Q5_0 Q8_0 Q4_K Q5_K Q6_K AWQ)");
    const int64_t M = xq.size(0);
    PYLLM_CHECK_VALUE(M >= 1 && M <= CUDA_GEMV_MAX_M, "cuda_gemv: x has M=", M, " rows; the fused GEMV takes 1..",
                      CUDA_GEMV_MAX_M, " (dequantize + matmul above)");
    return M;
}

// y [M, N] from prepared activation codes (xq, xds); out when given, else a new tensor.
at::Tensor gemv_prepared(const at::Tensor& w, QType t, const at::Tensor& xq, const at::Tensor& xds, int64_t K,
                         std::optional<at::Tensor> out) {
    const int64_t M = checked_m(t, xq);
    const auto [part, y] = checked_part(w, t, M, K, out, xds);
    const c10::cuda::CUDAGuard guard(w.device());
    gemv_parts_cuda(t, &part, 1, xq.data_ptr<int8_t>(), reinterpret_cast<const float2*>(xds.data_ptr<float>()),
                    static_cast<int>(M), static_cast<int>(K), stream_of(w));
    return y;
}

// (xq int8 [M, K], xds f32 [M, K/32, 2]): x's int8 codes per 32 values, written into xq / xds when given.
std::tuple<at::Tensor, at::Tensor> quantize_act(const at::Tensor& x, std::optional<at::Tensor> xq_out,
                                                std::optional<at::Tensor> xds_out) {
    check_tensor(x, "x", at::kFloat, 2);
    const int64_t M = x.size(0), K = x.size(1);
    PYLLM_CHECK_VALUE(M >= 1 && K > 0 && K % 32 == 0, "cuda_quantize_act: x shape ", x.sizes(),
                      " needs M >= 1 and K a positive multiple of 32");
    PYLLM_CHECK_VALUE(xq_out.has_value() == xds_out.has_value(), "cuda_quantize_act: give both xq and xds, or neither");
    const c10::cuda::CUDAGuard guard(x.device());
    at::Tensor xq = xq_out ? *xq_out : at::empty({M, K}, x.options().dtype(at::kChar));
    at::Tensor xds = xds_out ? *xds_out : at::empty({M, K / 32, 2}, x.options());
    PYLLM_CHECK_VALUE(check_codes(xq, xds, x, "x", K) == M, "xq has ", xq.size(0), " rows, x has ", M);
    quantize_act_cuda(x.data_ptr<float>(), xq.data_ptr<int8_t>(), reinterpret_cast<float2*>(xds.data_ptr<float>()),
                      static_cast<int>(M), static_cast<int>(K), stream_of(x));
    return {xq, xds};
}

at::Tensor gemv(const at::Tensor& w, int64_t qtype, const at::Tensor& x, std::optional<at::Tensor> out) {
    const QType t = to_qtype(qtype);
    check_tensor(x, "x", at::kFloat, 2);
    check_same_device(w, "w", x, "x");
    PYLLM_CHECK_VALUE(gemv_cuda_supported(t), "cuda_gemv: weight type ", qtype_name(t),
                      " has no CUDA GEMV kernel (supported: Q4_0 Q4_1 Q5_0 Q8_0 Q4_K Q5_K Q6_K AWQ)");
    check_weight(w, t, x.size(1));
    const auto [xq, xds] = quantize_act(x, std::nullopt, std::nullopt);
    return gemv_prepared(w, t, xq, xds, x.size(1), out);
}

at::Tensor gemv_q(const at::Tensor& w, int64_t qtype, const at::Tensor& xq, const at::Tensor& xds,
                  std::optional<at::Tensor> out) {
    const QType t = to_qtype(qtype);
    check_codes(xq, xds, w, "w", xq.dim() == 2 ? xq.size(1) : 0);
    return gemv_prepared(w, t, xq, xds, xq.size(1), out);
}

// cuda_gemv_q over several matrices of one type that read the same codes (q, k, v), in one launch.
std::vector<at::Tensor> gemv_q_parts(const std::vector<at::Tensor>& ws, int64_t qtype, const at::Tensor& xq,
                                     const at::Tensor& xds, const std::vector<at::Tensor>& outs) {
    const QType t = to_qtype(qtype);
    const int64_t n = static_cast<int64_t>(ws.size());
    PYLLM_CHECK_VALUE(n >= 1 && n <= CUDA_GEMV_MAX_PARTS, "cuda_gemv_q_parts: ", n, " weights; 1..",
                      CUDA_GEMV_MAX_PARTS, " per launch");
    PYLLM_CHECK_VALUE(static_cast<int64_t>(outs.size()) == n, "cuda_gemv_q_parts: ", n, " weights but ", outs.size(),
                      " outputs");
    check_codes(xq, xds, ws[0], "ws[0]", xq.dim() == 2 ? xq.size(1) : 0);
    const int64_t M = checked_m(t, xq), K = xq.size(1);
    GemvPart parts[CUDA_GEMV_MAX_PARTS];
    std::vector<at::Tensor> ys;
    int64_t rows = 0;
    for (int64_t i = 0; i < n; ++i) {
        auto [part, y] = checked_part(ws[i], t, M, K, outs[i], xds, i);
        parts[i] = part;
        ys.push_back(y);
        rows += part.N;
    }
    PYLLM_CHECK_VALUE(rows < (int64_t{1} << 31), "cuda_gemv_q_parts: ", rows, " rows in all; under 2^31 supported");
    const c10::cuda::CUDAGuard guard(ws[0].device());
    gemv_parts_cuda(t, parts, static_cast<int>(n), xq.data_ptr<int8_t>(),
                    reinterpret_cast<const float2*>(xds.data_ptr<float>()), static_cast<int>(M), static_cast<int>(K),
                    stream_of(ws[0]));
    return ys;
}

// y [M, N] f32 = x @ W^T on int8 tensor cores (csrc/cuda/mmq.cu) from x's codes (cuda_quantize_act: xq int8 [M, K],
// xds f32 [M, K/32, 2]), W in a tiled layout; out when given, else a new tensor.
at::Tensor mmq_matmul(const at::Tensor& w, int64_t qtype, const at::Tensor& xq, const at::Tensor& xds,
                      std::optional<at::Tensor> out) {
    const QType t = to_qtype(qtype);
    PYLLM_CHECK_VALUE(mmq::mmq_type(t), "cuda_mmq: weight type ", qtype_name(t), " has no MMQ kernel (the tiled "
                      "layouts: Q4_0_TILED Q8_0_TILED Q4_K_TILED Q6_K_TILED)");
    const int64_t K = xq.dim() == 2 ? xq.size(1) : 0;
    const int64_t M = check_codes(xq, xds, w, "w", K);
    PYLLM_CHECK_VALUE(M >= 1 && M < (int64_t{1} << 31), "cuda_mmq: xq has ", M, " rows; 1 .. 2^31-1 supported");
    PYLLM_CHECK_VALUE(reinterpret_cast<uintptr_t>(xq.data_ptr()) % 16 == 0, "cuda_mmq: xq must be 16-byte aligned "
                      "(a fresh tensor, or whole rows of one)");
    const auto [part, y] = checked_part(w, t, M, K, out, xds);
    PYLLM_CHECK_VALUE(static_cast<int64_t>(part.N) <= int64_t{65535} * mmq::kRows, "cuda_mmq: w has ", part.N,
                      " rows; at most ", int64_t{65535} * mmq::kRows);
    PYLLM_CHECK_VALUE(mmq_cuda_supported(t, w.device().index()), "cuda_mmq: ", w.device(), " is below compute "
                      "capability 8.0 (int8 mma.sync)");
    const c10::cuda::CUDAGuard guard(w.device());
    mmq_cuda(t, part.w, part.row_bytes, part.N, xq.data_ptr<int8_t>(),
             reinterpret_cast<const float2*>(xds.data_ptr<float>()), static_cast<int>(M), static_cast<int>(K),
             part.y, stream_of(w));
    return y;
}

// A float vector [1, n] (or [n]) on the device of `like`: n values, contiguous f32.
void check_vec(const at::Tensor& t, const char* name, const at::Tensor& like, int64_t n) {
    PYLLM_CHECK_VALUE(t.is_cuda(), name, " must be a CUDA tensor, got one on ", t.device());
    PYLLM_CHECK_TYPE(t.scalar_type() == at::kFloat, name, " must be Float, got ", t.scalar_type());
    PYLLM_CHECK_VALUE(t.is_contiguous() && t.numel() == n, name, " must be ", n, " contiguous values, got shape ",
                      t.sizes());
    check_same_device(like, "x", t, name);
}

// The rows x of a row kernel: [M, n] f32, M in 1..CUDA_GEMV_MAX_M, n the arch's size `what` (a multiple of 32).
int64_t checked_rows(const char* fn, const at::Tensor& x, const char* name, int64_t n, const char* what) {
    check_tensor(x, name, at::kFloat, 2);
    PYLLM_CHECK_VALUE(n > 0 && n % 32 == 0, fn, ": arch.", what, " = ", n, " is not a positive multiple of 32");
    const int64_t M = x.size(0);
    PYLLM_CHECK_VALUE(x.size(1) == n && M >= 1 && M <= CUDA_GEMV_MAX_M, fn, ": ", name, " has shape ", x.sizes(),
                      "; 1..", CUDA_GEMV_MAX_M, " rows of arch.", what, " = ", n, " values");
    return M;
}

// x [M, n_embd] += a (+ rms_norm(a) * post_w); h = rms_norm(x) * w; (xq, xds) = h's codes.  All written in place.
void residual_norm_quant(const DecodeArch& arch, const at::Tensor& x, std::optional<at::Tensor> a,
                         std::optional<at::Tensor> post_w, const at::Tensor& w, const at::Tensor& h,
                         const at::Tensor& xq, const at::Tensor& xds) {
    const int64_t D = arch.n_embd, M = checked_rows("cuda_residual_norm_quant", x, "x", D, "n_embd");
    PYLLM_CHECK_VALUE(!post_w || a, "cuda_residual_norm_quant: post_w needs a");
    if (a) check_vec(*a, "a", x, M * D);
    if (post_w) check_vec(*post_w, "post_w", x, D);
    check_vec(w, "w", x, D);
    check_vec(h, "h", x, M * D);
    PYLLM_CHECK_VALUE(check_codes(xq, xds, x, "x", D) == M, "xq has ", xq.size(0), " rows, x has ", M);
    const c10::cuda::CUDAGuard guard(x.device());
    residual_norm_quant_cuda(arch, static_cast<int>(M), x.data_ptr<float>(), a ? a->data_ptr<float>() : nullptr,
                             post_w ? post_w->data_ptr<float>() : nullptr, w.data_ptr<float>(), h.data_ptr<float>(),
                             xq.data_ptr<int8_t>(), reinterpret_cast<float2*>(xds.data_ptr<float>()), stream_of(x));
}

// h [M, n_ff] = act(g) * u (the arch's activation); (xq, xds) = h's codes.
void act_quant(const DecodeArch& arch, const at::Tensor& g, const at::Tensor& u, const at::Tensor& h,
               const at::Tensor& xq, const at::Tensor& xds) {
    const int64_t n = arch.n_ff, M = checked_rows("cuda_act_quant", g, "g", n, "n_ff");
    check_vec(u, "u", g, M * n);
    check_vec(h, "h", g, M * n);
    PYLLM_CHECK_VALUE(check_codes(xq, xds, g, "g", n) == M, "xq has ", xq.size(0), " rows, g has ", M);
    const c10::cuda::CUDAGuard guard(g.device());
    act_quant_cuda(arch, static_cast<int>(M), g.data_ptr<float>(), u.data_ptr<float>(), h.data_ptr<float>(),
                   xq.data_ptr<int8_t>(), reinterpret_cast<float2*>(xds.data_ptr<float>()), stream_of(g));
}

KVRow float_row_type(const at::Tensor& t, const char* name) {
    const at::ScalarType dt = t.scalar_type();
    PYLLM_CHECK_TYPE(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, name,
                     " must be Float, Half or BFloat16 rows (block caches are written by the torch path), got ", dt);
    return dt == at::kFloat ? KVRow::F32 : dt == at::kHalf ? KVRow::F16 : KVRow::BF16;
}

// Layer `layer`'s q [1, H*hd], k, v [1, Hkv*hd] -> q_out [H, hd] (bias, per-head norm, RoPE at pos[0], as the arch
// says) and the rows k_cache[:, pos], v_cache[:, pos] of its float cache [Hkv, max_seq, hd].  The biases are given
// exactly where arch.qkv_bias, the norms where arch.qk_norm, cos and sin where the layer has rope tables.
void rope_store(const DecodeArch& arch, int64_t layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                std::optional<at::Tensor> q_bias, std::optional<at::Tensor> k_bias, std::optional<at::Tensor> v_bias,
                std::optional<at::Tensor> q_norm, std::optional<at::Tensor> k_norm, std::optional<at::Tensor> cos,
                std::optional<at::Tensor> sin, const at::Tensor& pos, const at::Tensor& k_cache,
                const at::Tensor& v_cache, const at::Tensor& q_out) {
    const int64_t H = arch.n_head, Hkv = arch.n_kv_head, hd = arch.head_dim;
    PYLLM_CHECK_VALUE(layer >= 0 && layer < arch.n_layer, "cuda_rope_store: layer ", layer, " is outside 0..",
                      arch.n_layer - 1);
    PYLLM_CHECK_VALUE(hd == 64 || hd == 128 || hd == 256, "cuda_rope_store: head_dim ", hd,
                      " is not supported (64, 128, 256)");
    check_tensor(q_out, "q_out", at::kFloat, 2);
    PYLLM_CHECK_VALUE(q_out.size(0) == H && q_out.size(1) == hd, "cuda_rope_store: q_out has shape ", q_out.sizes(),
                      ", expected [arch.n_head=", H, ", arch.head_dim=", hd, "]");
    PYLLM_CHECK_VALUE(k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache must both be "
                      "[Hkv, max_seq, head_dim], got ", k_cache.sizes(), " and ", v_cache.sizes());
    const int64_t max_seq = k_cache.size(1);
    PYLLM_CHECK_VALUE(k_cache.size(0) == Hkv && k_cache.size(2) == hd, "cuda_rope_store: k_cache has shape ",
                      k_cache.sizes(), " for arch.n_kv_head=", Hkv, " heads of ", hd, " values");
    PYLLM_CHECK_VALUE(k_cache.is_contiguous() && v_cache.is_contiguous(), "k_cache and v_cache must be contiguous");
    check_same_device(q_out, "q_out", k_cache, "k_cache");
    check_same_device(q_out, "q_out", v_cache, "v_cache");
    check_vec(q, "q", q_out, H * hd);
    check_vec(k, "k", q_out, Hkv * hd);
    check_vec(v, "v", q_out, Hkv * hd);
    const bool bias = q_bias || k_bias || v_bias;
    PYLLM_CHECK_VALUE(bias == arch.qkv_bias && (!bias || (q_bias && k_bias && v_bias)), "cuda_rope_store: give q, k "
                      "and v biases exactly where arch.qkv_bias (", arch.qkv_bias, ")");
    if (bias) {
        check_vec(*q_bias, "q_bias", q_out, H * hd);
        check_vec(*k_bias, "k_bias", q_out, Hkv * hd);
        check_vec(*v_bias, "v_bias", q_out, Hkv * hd);
    }
    PYLLM_CHECK_VALUE(q_norm.has_value() == arch.qk_norm && k_norm.has_value() == arch.qk_norm,
                      "cuda_rope_store: give q_norm and k_norm exactly where arch.qk_norm (", arch.qk_norm, ")");
    if (q_norm) check_vec(*q_norm, "q_norm", q_out, hd);
    if (k_norm) check_vec(*k_norm, "k_norm", q_out, hd);
    const bool rope = arch.layer_rope[static_cast<size_t>(layer)] >= 0;
    PYLLM_CHECK_VALUE(cos.has_value() == rope && sin.has_value() == rope, "cuda_rope_store: give cos and sin exactly "
                      "where the layer has rope tables (arch.layer_rope[", layer, "] = ",
                      arch.layer_rope[static_cast<size_t>(layer)], ")");
    if (rope) {
        check_tensor(*cos, "cos", at::kFloat, 2);
        check_tensor(*sin, "sin", at::kFloat, 2);
        PYLLM_CHECK_VALUE(cos->sizes() == sin->sizes() && 2 * cos->size(1) == arch.rope_dim && cos->size(0) >= 1,
                          "cos and sin must be [max_pos, arch.rope_dim / 2 = ", arch.rope_dim / 2, "], got ",
                          cos->sizes(), " and ", sin->sizes());
        check_same_device(q_out, "q_out", *cos, "cos");
        check_same_device(q_out, "q_out", *sin, "sin");
    }
    check_tensor(pos, "pos", at::kLong, 1);
    check_same_device(q_out, "q_out", pos, "pos");
    PYLLM_CHECK_VALUE(pos.numel() == 1, "pos must hold one value, got shape ", pos.sizes());
    RopeStoreArgs args{};
    args.q = q.data_ptr<float>();
    args.k = k.data_ptr<float>();
    args.v = v.data_ptr<float>();
    args.q_bias = q_bias ? q_bias->data_ptr<float>() : nullptr;
    args.k_bias = k_bias ? k_bias->data_ptr<float>() : nullptr;
    args.v_bias = v_bias ? v_bias->data_ptr<float>() : nullptr;
    args.q_norm = q_norm ? q_norm->data_ptr<float>() : nullptr;
    args.k_norm = k_norm ? k_norm->data_ptr<float>() : nullptr;
    args.cos = rope ? cos->data_ptr<float>() : nullptr;  // without tables the kernel rotates no value
    args.sin = rope ? sin->data_ptr<float>() : nullptr;
    args.max_pos = rope ? static_cast<int>(cos->size(0)) : 0;
    args.pos = pos.data_ptr<int64_t>();
    args.max_seq = static_cast<int>(max_seq);
    args.k_type = float_row_type(k_cache, "k_cache");
    args.v_type = float_row_type(v_cache, "v_cache");
    args.k_cache = static_cast<uint8_t*>(k_cache.data_ptr());
    args.v_cache = static_cast<uint8_t*>(v_cache.data_ptr());
    args.q_out = q_out.data_ptr<float>();
    const c10::cuda::CUDAGuard guard(q_out.device());
    rope_store_cuda(arch, args, stream_of(q_out));
}

// Rows of W (all, or ids) as fp16 (half=True) or fp32.  check_ids=False skips the range check, which needs a
// device->host sync: for CUDA-graph capture, where the caller guarantees the ids.
at::Tensor dequantize(const at::Tensor& w, int64_t qtype, int64_t K, std::optional<at::Tensor> ids, bool half,
                      bool check_ids) {
    const QType t = to_qtype(qtype);
    PYLLM_CHECK_VALUE(dequant_cuda_supported(t), "cuda_dequantize: type ", qtype_name(t), " has no CUDA kernel");
    const auto [N, row_bytes] = check_weight(w, t, K);
    PYLLM_CHECK_VALUE(K % 8 == 0, "cuda_dequantize: K=", K, " must be a multiple of 8");
    PYLLM_CHECK_VALUE(!tiled::is_tiled(t) || reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0, "cuda_dequantize: ",
                      qtype_name(t), " weights must be 16-byte aligned (use a fresh copy, not a byte-offset view)");
    int64_t n_out = N;
    const int64_t* idp = nullptr;
    if (ids) {
        check_tensor(*ids, "ids", at::kLong, 1);
        check_same_device(w, "w", *ids, "ids");
        n_out = ids->size(0);
        if (check_ids && n_out > 0) {
            const int64_t lo = ids->min().item<int64_t>(), hi = ids->max().item<int64_t>();
            PYLLM_CHECK_VALUE(lo >= 0 && hi < N, "cuda_dequantize: row index ", lo < 0 ? lo : hi,
                              " is out of range for ", N, " rows");
        }
        idp = ids->data_ptr<int64_t>();
    }
    const c10::cuda::CUDAGuard guard(w.device());
    at::Tensor out = at::empty({n_out, K}, w.options().dtype(half ? at::kHalf : at::kFloat));
    dequantize_cuda(t, w.data_ptr<uint8_t>(), static_cast<size_t>(row_bytes), idp, n_out, static_cast<int>(K),
                    half ? reinterpret_cast<__half*>(out.data_ptr<at::Half>()) : nullptr,
                    half ? nullptr : out.data_ptr<float>(), stream_of(w));
    return out;
}

// One part (keys or values) of one layer: t is [Hkv, max_seq, D] f32/f16/bf16, or uint8 [Hkv, max_seq, row_bytes]
// of `block` ("q8_0" or "q4_0") blocks; sink an optional f32 [Hkv, D] exact row for position 0.
AttnRows check_rows(const at::Tensor& t, const char* name, const std::string& block,
                    const std::optional<at::Tensor>& sink,
                    const char* sink_name, const at::Tensor& q, int64_t Hkv, int64_t max_seq, int64_t D) {
    AttnRows r{};
    const at::ScalarType dt = t.scalar_type();
    if (dt == at::kByte) {
        PYLLM_CHECK_VALUE(block == "q8_0" || block == "q4_0", name, " holds uint8 rows, so its block type must be "
                          "'q8_0' or 'q4_0', got '", block, "'");
        r.type = block == "q8_0" ? KVRow::Q8_0 : KVRow::Q4_0;
        PYLLM_CHECK_VALUE(D % 32 == 0, name, ": ", block, " rows need head_dim to be a multiple of 32, got ", D);
    } else {
        PYLLM_CHECK_VALUE(block.empty(), name, " is ", dt, ", not uint8 blocks, but a block type '", block,
                          "' was given");
        PYLLM_CHECK_TYPE(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, name,
                         " must be Float, Half, BFloat16 or Byte (q8_0 / q4_0 blocks), got ", dt);
        r.type = dt == at::kFloat ? KVRow::F32 : dt == at::kHalf ? KVRow::F16 : KVRow::BF16;
    }
    check_tensor(t, name, dt, 3);
    check_same_device(q, "q", t, name);
    const int64_t row_bytes = static_cast<int64_t>(kv_row_size(r.type, static_cast<int>(D)));
    const int64_t width = dt == at::kByte ? row_bytes : D;
    PYLLM_CHECK_VALUE(t.size(0) == Hkv && t.size(1) == max_seq && t.size(2) == width, name, " has shape ", t.sizes(),
                      ", expected [", Hkv, ", ", max_seq, ", ", width, "]");
    r.data = static_cast<const uint8_t*>(t.data_ptr());
    r.row_bytes = static_cast<size_t>(row_bytes);
    if (sink) {
        check_tensor(*sink, sink_name, at::kFloat, 2);
        check_same_device(q, "q", *sink, sink_name);
        PYLLM_CHECK_VALUE(sink->size(0) == Hkv && sink->size(1) == D, sink_name, " has shape ", sink->sizes(),
                          ", expected [", Hkv, ", ", D, "]");
        r.sink = sink->data_ptr<float>();
    }
    return r;
}

// q [H, D] f32 (storage basis of the keys); k, v one layer's parts (check_rows); len int32 [1] on the device
// (valid positions) -> out [H, D] f32 (storage basis of the values).
at::Tensor attn_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& len,
                       double scale, const std::string& k_block, const std::string& v_block,
                       std::optional<at::Tensor> k_sink, std::optional<at::Tensor> v_sink, int64_t window,
                       double softcap, std::optional<at::Tensor> xq, std::optional<at::Tensor> xds) {
    check_tensor(q, "q", at::kFloat, 2);
    check_tensor(len, "len", at::kInt, 1);
    check_same_device(q, "q", len, "len");
    PYLLM_CHECK_VALUE(len.numel() == 1, "len must hold one value, got shape ", len.sizes());
    PYLLM_CHECK_VALUE(k.dim() == 3 && v.dim() == 3, "k and v must have 3 dimensions, got shapes ", k.sizes(), " and ",
                      v.sizes());
    const int64_t H = q.size(0), D = q.size(1), Hkv = k.size(0), max_seq = k.size(1);
    PYLLM_CHECK_VALUE(attn_decode_supported_head_dim(static_cast<int>(D)), "cuda_attn_decode: head_dim ", D,
                      " is not supported (64, 128, 256)");
    PYLLM_CHECK_VALUE(Hkv >= 1 && H % Hkv == 0, "cuda_attn_decode: ", H, " query heads is not a multiple of ", Hkv,
                      " KV heads");
    PYLLM_CHECK_VALUE(max_seq >= 1 && max_seq < (int64_t{1} << 30), "cuda_attn_decode: max_seq=", max_seq);
    PYLLM_CHECK_VALUE(window >= 0 && window < (int64_t{1} << 30), "cuda_attn_decode: window=", window,
                      " must be 0 (none) or a positive number of positions");
    PYLLM_CHECK_VALUE(softcap >= 0.0 && std::isfinite(softcap), "cuda_attn_decode: softcap=", softcap,
                      " must be 0 (none) or positive");
    const AttnRows kr = check_rows(k, "k", k_block, k_sink, "k_sink", q, Hkv, max_seq, D);
    const AttnRows vr = check_rows(v, "v", v_block, v_sink, "v_sink", q, Hkv, max_seq, D);
    PYLLM_CHECK_VALUE(xq.has_value() == xds.has_value(), "cuda_attn_decode: give both xq and xds, or neither");
    if (xq) PYLLM_CHECK_VALUE(check_codes(*xq, *xds, q, "q", H * D) == 1, "xq has ", xq->size(0), " rows; the output's "
                              "codes are one row of H*D=", H * D, " values");
    const c10::cuda::CUDAGuard guard(q.device());
    const int chunks = attn_decode_chunks(static_cast<int>(max_seq));
    at::Tensor part_o = at::empty({H, chunks, D}, q.options());
    at::Tensor part_ml = at::empty({H, chunks, 2}, q.options());
    at::Tensor out = at::empty({H, D}, q.options());
    attn_decode_cuda(q.data_ptr<float>(), kr, vr, len.data_ptr<int>(), static_cast<int>(window),
                     static_cast<float>(softcap), part_o.data_ptr<float>(), part_ml.data_ptr<float>(),
                     out.data_ptr<float>(), static_cast<int>(H), static_cast<int>(Hkv), static_cast<int>(D),
                     static_cast<int>(max_seq), static_cast<float>(scale), stream_of(q),
                     xq ? xq->data_ptr<int8_t>() : nullptr,
                     xds ? reinterpret_cast<float2*>(xds->data_ptr<float>()) : nullptr);
    return out;
}

// Stacked experts w uint8 [E, N, row_bytes] against the selections ids int64 [T, k] (on the GPU, each in [0, E):
// checked by the caller, which made them with topk): x f32 [T, K] (a token's row shared by its k selections) or
// [T, k, K] (a row each) -> y f32 [T, k, N], y[t, j] = x_(t or t, j) @ W[ids[t, j]]^T.  One launch.
at::Tensor gemv_experts(const at::Tensor& w, int64_t qtype, const at::Tensor& x, const at::Tensor& ids) {
    const QType t = to_qtype(qtype);
    const char* fn = "cuda_gemv_experts";
    const bool awq = t >= QType::AWQ_G32 && t <= QType::AWQ_G256;
    PYLLM_CHECK_VALUE(gemv_cuda_supported(t) && !awq, fn, ": weight type ",
                      qtype_name(t), " has no CUDA expert GEMV (supported: Q4_0 Q4_1 Q5_0 Q8_0 Q4_K Q5_K Q6_K)");
    check_tensor(w, "w", at::kByte, 3);
    check_tensor(ids, "ids", at::kLong, 2);
    PYLLM_CHECK_VALUE(x.dim() == 2 || x.dim() == 3, fn, ": x must be [T, K] or [T, k, K], got shape ", x.sizes());
    check_tensor(x, "x", at::kFloat, x.dim());
    check_same_device(w, "w", x, "x");
    check_same_device(w, "w", ids, "ids");
    const int64_t T = ids.size(0), k = ids.size(1), K = x.size(-1), E = w.size(0);
    PYLLM_CHECK_VALUE(x.size(0) == T && (x.dim() == 2 || x.size(1) == k) && T * k >= 1 && T * k <= 65535, fn,
                      ": x has shape ", x.sizes(), " but ids has shape ", ids.sizes(), " (at most 65535 selections)");
    const auto [N, row_bytes] = check_weight(w[0], t, K);
    const int align = gemv_cuda_alignment(t);
    PYLLM_CHECK_VALUE(reinterpret_cast<uintptr_t>(w.data_ptr()) % align == 0 && (N * row_bytes) % align == 0, fn,
                      ": ", qtype_name(t), " experts must each start ", align, "-byte aligned");
    PYLLM_CHECK_VALUE(E >= 1, fn, ": w has no experts");
    const c10::cuda::CUDAGuard guard(w.device());
    const auto [xq, xds] = quantize_act(x.reshape({-1, K}), std::nullopt, std::nullopt);
    at::Tensor y = at::empty({T, k, N}, x.options());
    gemv_experts_cuda(t, w.data_ptr<uint8_t>(), static_cast<size_t>(N * row_bytes), static_cast<size_t>(row_bytes),
                      ids.data_ptr<int64_t>(), static_cast<int>(T * k), x.dim() == 2 ? static_cast<int>(k) : 1,
                      xq.data_ptr<int8_t>(), reinterpret_cast<const float2*>(xds.data_ptr<float>()),
                      y.data_ptr<float>(), static_cast<int>(N), static_cast<int>(K), stream_of(w));
    return y;
}

// The tiled layout of GGUF or AWQ rows w (uint8 [N, row_bytes] of type qtype, on the CPU), made on the host before
// upload (csrc/common/gemv_tiled.h); inverse: tiled rows back to the type's rows.  A new CPU tensor.
at::Tensor tile_weight(const at::Tensor& w, int64_t qtype, int64_t K, bool inverse) {
    PYLLM_CHECK_VALUE(w.device().is_cpu(), "cuda_tile_weight: w must be a CPU tensor (it is tiled before upload), got "
                      "one on ", w.device());
    PYLLM_CHECK_TYPE(w.scalar_type() == at::kByte, "cuda_tile_weight: w must be Byte, got ", w.scalar_type());
    PYLLM_CHECK_VALUE(w.dim() == 2, "cuda_tile_weight: w must be [N, row_bytes], got shape ", w.sizes());
    const int tid = tiled::tiled_qtype_id(static_cast<int>(qtype));
    PYLLM_CHECK_VALUE(tid >= 0, "cuda_tile_weight: type ", qtype_name(to_qtype(qtype)),
                      " has no tiled layout (Q4_0 Q8_0 Q4_K Q6_K AWQ_G*)");
    PYLLM_CHECK_VALUE(tiled::tileable(static_cast<int>(qtype), w.size(0), K), "cuda_tile_weight: a [", w.size(0), ", ",
                      K, "] ", qtype_name(to_qtype(qtype)), " matrix cannot be tiled (rows a multiple of ",
                      tiled::kTileRows, ", whole blocks)");
    const int64_t row_bytes = static_cast<int64_t>(qtype_row_bytes(to_qtype(qtype), K));
    PYLLM_CHECK_VALUE(w.size(1) == row_bytes, "cuda_tile_weight: w has rows of ", w.size(1), " bytes; ",
                      qtype_name(to_qtype(qtype)), " with K=", K, " needs ", row_bytes);
    const at::Tensor src = w.contiguous();
    at::Tensor out = at::empty_like(src);
    const uint8_t* sp = src.data_ptr<uint8_t>();
    uint8_t* dp = out.data_ptr<uint8_t>();
    at::parallel_for(0, w.size(0) / tiled::kTileRows, 16, [&](int64_t t0, int64_t t1) {
        tiled::tile_matrix(static_cast<int>(qtype), inverse, sp, dp, static_cast<int>(K), t0, t1);
    });
    return out;
}

}  // namespace

void register_cuda(pybind11::module& m) {
    namespace py = pybind11;
    m.def("cuda_gemv_supported", [](int64_t qtype) { return gemv_cuda_supported(to_qtype(qtype)); }, py::arg("qtype"),
          "Whether the fused CUDA GEMV handles this GGML type id.");
    m.def("cuda_dequant_supported", [](int64_t qtype) { return dequant_cuda_supported(to_qtype(qtype)); },
          py::arg("qtype"), "Whether cuda_dequantize handles this GGML type id.");
    m.def("cuda_tiled_qtype", [](int64_t qtype) { return tiled::tiled_qtype_id(static_cast<int>(qtype)); },
          py::arg("qtype"), "The type id of qtype's tiled GEMV layout (Q4_0_TILED ...), or -1 where it has none.");
    m.def(
        "cuda_tileable",
        [](int64_t qtype, int64_t N, int64_t K) { return tiled::tileable(static_cast<int>(qtype), N, K); },
        py::arg("qtype"), py::arg("N"), py::arg("K"), "Whether an [N, K] matrix of qtype has a tiled layout.");
    m.def("cuda_gemv_tiled_split", [](int64_t qtype, int64_t rows, int64_t K, int64_t M) {
              const QType t = to_qtype(qtype);
              PYLLM_CHECK_VALUE(tiled::is_tiled(t), "cuda_gemv_tiled_split: ", qtype_name(t), " is not a tiled layout");
              return gemv_tiled_split(t, rows, static_cast<int>(K), static_cast<int>(M));
          }, py::arg("qtype"), py::arg("rows"), py::arg("K"), py::arg("M") = 1,
          "K slices per row group the tiled GEMV takes for `rows` output rows in all (1, 2 or 4).");
    m.def("cuda_set_gemv_tiled_split", [](int64_t split) { gemv_tiled_set_split(static_cast<int>(split)); },
          py::arg("split"), "Force the tiled GEMV's K slices (1, 2, 4) for every later launch; 0: automatic.");
    m.def("cuda_tile_weight", &tile_weight, py::arg("w"), py::arg("qtype"), py::arg("K"), py::arg("inverse") = false,
          "GGUF or AWQ rows w (CPU uint8 [N, row_bytes] of type qtype) -> the tiled GEMV layout (same shape; its type "
          "is cuda_tiled_qtype(qtype)); inverse=True: tiled rows back to the type's rows.");
    m.def("cuda_gemv", &gemv, py::arg("w"), py::arg("qtype"), py::arg("x"), py::arg("out") = py::none(),
          "y [M, N] f32 = x [M, K] f32 @ W^T for M <= 8, W uint8 [N, row_bytes] raw GGUF blocks on the GPU.");
    m.def("cuda_gemv_experts", &gemv_experts, py::arg("w"), py::arg("qtype"), py::arg("x"), py::arg("ids"),
          "MUL_MAT_ID: stacked experts w uint8 [E, N, row_bytes] on the GPU, ids int64 [T, k] -> y f32 [T, k, N] = "
          "x[t] (or x[t, j]) @ W[ids[t, j]]^T, one launch, ids read on the device.");
    m.def("cuda_gemv_q", &gemv_q, py::arg("w"), py::arg("qtype"), py::arg("xq"), py::arg("xds"),
          py::arg("out") = py::none(),
          "cuda_gemv from activation codes cuda_quantize_act prepared (xq int8 [M, K], xds f32 [M, K/32, 2]).");
    m.def("cuda_gemv_q_parts", &gemv_q_parts, py::arg("ws"), py::arg("qtype"), py::arg("xq"), py::arg("xds"),
          py::arg("outs"),
          "cuda_gemv_q for 1..3 weights of one type and row length reading the same codes, one launch: outs[i] [M, "
          "N_i] = x @ ws[i]^T.");
    m.def("cuda_mmq_supported", [](int64_t qtype, int64_t device) {
              return mmq_cuda_supported(to_qtype(qtype), static_cast<int>(device));
          }, py::arg("qtype"), py::arg("device"),
          "Whether cuda_mmq takes this weight type id on CUDA device `device` (the tiled layouts, compute "
          "capability 8.0+).");
    m.def("cuda_mmq", &mmq_matmul, py::arg("w"), py::arg("qtype"), py::arg("xq"), py::arg("xds"),
          py::arg("out") = py::none(),
          "y [M, N] f32 = x @ W^T on int8 tensor cores (prompt chunks), from x's codes as cuda_quantize_act makes them "
          "(xq int8 [M, K], xds f32 [M, K/32, 2]); W uint8 [N, row_bytes] in a tiled layout on the GPU.");
    m.def("cuda_quantize_act", &quantize_act, py::arg("x"), py::arg("xq") = py::none(), py::arg("xds") = py::none(),
          "The int8 activation codes and (d, d*sum) scales cuda_gemv computes from x [M, K] (into xq, xds if given).");
    m.def("cuda_residual_norm_quant", &residual_norm_quant, py::arg("arch"), py::arg("x"), py::arg("a"),
          py::arg("post_w"), py::arg("w"), py::arg("h"), py::arg("xq"), py::arg("xds"),
          "In place, for M <= 8 rows of arch.n_embd values (arch: DecodeArch): x [M, D] += a (or rms_norm(a) * post_w), "
          "h = rms_norm(x) * w (eps arch.rms_eps), (xq, xds) = h's int8 codes; each row as alone.");
    m.def("cuda_act_quant", &act_quant, py::arg("arch"), py::arg("g"), py::arg("u"), py::arg("h"), py::arg("xq"),
          py::arg("xds"),
          "In place: h [M, arch.n_ff] = act(g) * u (SiLU, or tanh-GELU where arch's act is), (xq, xds) = h's int8 "
          "codes.");
    m.def("cuda_rope_store", &rope_store, py::arg("arch"), py::arg("layer"), py::arg("q"), py::arg("k"), py::arg("v"),
          py::arg("q_bias"), py::arg("k_bias"), py::arg("v_bias"), py::arg("q_norm"), py::arg("k_norm"),
          py::arg("cos"), py::arg("sin"), py::arg("pos"), py::arg("k_cache"), py::arg("v_cache"), py::arg("q_out"),
          "One token's q [1, H*hd], k, v [1, Hkv*hd] of layer `layer` (arch: DecodeArch): bias, per-head RMS norm, "
          "RoPE at pos[0] (none for a layer without rope tables: cos and sin None) -> q_out [H, hd], and k, v "
          "written at pos[0] into the layer's float cache [Hkv, max_seq, hd].");
    m.def("cuda_dequantize", &dequantize, py::arg("w"), py::arg("qtype"), py::arg("K"), py::arg("ids") = py::none(),
          py::arg("half") = true, py::arg("check_ids") = true,
          "Rows of W (all, or ids int64 [n]) -> [n, K] fp16 (half) or fp32, equal to gguf.quants in fp32.");
    m.def("cuda_attn_decode", &attn_decode, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("len"),
          py::arg("scale"), py::arg("k_block") = "", py::arg("v_block") = "", py::arg("k_sink") = py::none(),
          py::arg("v_sink") = py::none(), py::arg("window") = 0, py::arg("softcap") = 0.0, py::arg("xq") = py::none(),
          py::arg("xds") = py::none(),
          "One token's attention in the cache's storage basis: q [H, D] f32 over one layer's k, v ([Hkv, max_seq, D] "
          "f32/f16/bf16, or uint8 [Hkv, max_seq, row_bytes] q8_0/q4_0 blocks named by k_block/v_block), positions "
          "max(0, len[0] - window) .. len[0] - 1, position 0 from the f32 [Hkv, D] sink rows when given; with xq "
          "int8 [1, H*D] and xds f32 [1, H*D/32, 2], also the output's codes as cuda_quantize_act writes them.");
}

}  // namespace pyllm
