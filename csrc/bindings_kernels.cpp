// Python bindings of the CPU kernels: GEMV, GEMM / mul_mat, dequantize, the AWQ and rows-by-8 repackers, ISA
// and thread settings, the bandwidth probe.  Tensors are checked by bindings_checks.h before any pointer is used.
#include <optional>
#include <string>
#include <vector>

#include "bindings_checks.h"

namespace pyllm {
namespace bind {
namespace {

// y = x @ W.T for 1 <= M <= 8 rows of x: x f32 [M, K], w u8 [N, row_bytes] -> y f32 [M, N].  argmax: where
// given, each row of y's RowArgmax, found as the decode step finds the logits' (chunk by chunk as the threads
// write y).
Tensor gemv_rows(const Tensor& x, const Tensor& w, int64_t qtype, const std::optional<Tensor>& out, bool precise_x,
                 pyllm::RowArgmax* argmax) {
    const QTypeTraits& tr = check_qtype("gemv", qtype);
    check_tensor("gemv", "x", x, at::kFloat, 2);
    const int64_t M = x.size(0), K = x.size(1);
    PYLLM_CHECK_VALUE(M >= 1 && M <= pyllm::GEMV_MAX_M, "gemv: x has ", M, " rows, the fused GEMV takes 1..",
                      pyllm::GEMV_MAX_M, " (use gemm)");
    check_weight("gemv", w, tr, K);
    check_rows8("gemv", "w", w, qtype);
    const int64_t N = w.size(0);
    Tensor y = make_out("gemv", out, M, N);
    pyllm::gemv_cpu(static_cast<QType>(qtype), w.data_ptr<uint8_t>(), static_cast<size_t>(w.size(1)),
                    x.data_ptr<float>(), y.data_ptr<float>(), static_cast<int>(M), static_cast<int>(N),
                    static_cast<int>(K), precise_x, argmax);
    return y;
}

Tensor gemv(const Tensor& x, const Tensor& w, int64_t qtype, const std::optional<Tensor>& out, bool precise_x) {
    return gemv_rows(x, w, qtype, out, precise_x, nullptr);
}

// (gemv's y, each row's argmax: the first index of its largest value, -1 where a value is NaN or infinite).
std::pair<Tensor, std::vector<int64_t>> gemv_argmax(const Tensor& x, const Tensor& w, int64_t qtype, bool precise_x) {
    pyllm::RowArgmax top[pyllm::GEMV_MAX_M];
    Tensor y = gemv_rows(x, w, qtype, std::nullopt, precise_x, top);
    std::vector<int64_t> idx(y.size(0));
    for (size_t m = 0; m < idx.size(); ++m) idx[m] = top[m].index;
    return {y, idx};
}

// The RowArgmax of a f32 vector y [n], n >= 1 (the scan each chunk of logits gets).
std::optional<Tensor> top_k_ids(const Tensor& y, int64_t k) {
    check_tensor("top_k_ids", "y", y, at::kFloat, 1);
    PYLLM_CHECK_VALUE(y.size(0) >= 1 && y.size(0) <= INT32_MAX && k >= 1 && k <= y.size(0), "top_k_ids: k=", k,
                      " must be in 1..", y.size(0), " (the values y holds)");
    Tensor ids = at::empty({k}, y.options().dtype(at::kLong));
    if (pyllm::row_top_k_cpu(y.data_ptr<float>(), static_cast<int>(y.size(0)), static_cast<int>(k),
                             ids.data_ptr<int64_t>()) < 0)
        return std::nullopt;
    return ids;
}

int64_t row_argmax(const Tensor& y) {
    check_tensor("row_argmax", "y", y, at::kFloat, 1);
    PYLLM_CHECK_VALUE(y.size(0) >= 1 && y.size(0) <= INT32_MAX, "row_argmax: y needs 1..2^31-1 values, got ",
                      y.size(0));
    return pyllm::row_argmax_cpu(y.data_ptr<float>(), static_cast<int>(y.size(0))).index;
}

pyllm::PrefillKernel prefill_kernel_named(const std::string& name) {
    for (auto k : pyllm::PREFILL_KERNELS)
        if (name == pyllm::cpu_prefill_name(k)) {
            PYLLM_CHECK_VALUE(pyllm::cpu_prefill_available(k), "gemm: kernel '", name,
                              "' is not available (not compiled in, or this CPU or OS lacks it)");
            return k;
        }
    PYLLM_CHECK_VALUE(false, "gemm: unknown kernel '", name,
                      "', expected 'f32', 'avx512-bf16', 'amx-bf16' or 'int8-gemv'");
    return pyllm::PrefillKernel::F32;
}

// Up to this many rows, mul_mat runs the fused GEMV on 8-row chunks instead of dequantize + fp32 GEMM: measured
// single-thread on 4096x4096 Q4_0/Q4_K, 2-4 GEMV passes (int8 maddubs: 32 MACs per instruction, W read
// quantized) take 8-19 ms where dequantizing W alone costs ~30 ms; above ~64 rows the fp32 GEMM wins there.  (The
// "int8-gemv" prefill kernel, the default without bf16 units, runs these chunks for every M.)
constexpr int64_t GEMV_CHUNKED_MAX_M = 32;

Tensor gemv_chunked(const Tensor& x, const Tensor& w, int64_t qtype, const std::optional<Tensor>& out,
                    bool precise_x) {
    const QTypeTraits& tr = check_qtype("mul_mat", qtype);
    check_tensor("mul_mat", "x", x, at::kFloat, 2);
    const int64_t M = x.size(0), K = x.size(1);
    PYLLM_CHECK_VALUE(M >= 1 && M <= INT32_MAX, "mul_mat: x needs 1..2^31-1 rows, got ", M);
    check_weight("mul_mat", w, tr, K);
    check_rows8("mul_mat", "w", w, qtype);
    Tensor y = make_out("mul_mat", out, M, w.size(0));
    const pyllm::GemvPart part{static_cast<QType>(qtype), w.data_ptr<uint8_t>(), static_cast<size_t>(w.size(1)),
                               y.data_ptr<float>(), static_cast<int>(w.size(0))};
    pyllm::gemv_chunks_cpu(&part, 1, x.data_ptr<float>(), static_cast<int>(M), static_cast<int>(K), precise_x);
    return y;
}

// y = x @ W.T for any M (prefill).  kernel "f32": W is dequantized a tile of rows at a time into an fp32 buffer
// that stays in cache, and each tile goes through torch's GEMM (MKL / oneDNN).  "amx-bf16" / "avx512-bf16": W
// dequantized to bf16 strips, x rounded to bf16, fp32 accumulation (csrc/cpu/gemm_amx.cpp).  "" = the default
// (cpu_prefill_default).  "int8-gemv": the fused GEMV on 8-row chunks of x (gemv_chunked) for quantized W, the
// "f32" path for float W.  x f32 [M, K] -> y f32 [M, N]
Tensor gemm(const Tensor& x, const Tensor& w, int64_t qtype, const std::optional<Tensor>& out,
            const std::string& kernel) {
    const QTypeTraits& tr = check_qtype("gemm", qtype);
    check_tensor("gemm", "x", x, at::kFloat, 2);
    const int64_t M = x.size(0), K = x.size(1);
    PYLLM_CHECK_VALUE(M >= 1, "gemm: x has no rows");
    check_weight("gemm", w, tr, K);
    check_rows8("gemm", "w", w, qtype);
    const int64_t N = w.size(0);
    Tensor y = make_out("gemm", out, M, N);
    pyllm::PrefillKernel pk = kernel.empty() ? pyllm::cpu_prefill_default() : prefill_kernel_named(kernel);
    if (pk == pyllm::PrefillKernel::Int8Gemv) {
        if (tr.block_size > 1) return gemv_chunked(x, w, qtype, y, false);
        pk = pyllm::PrefillKernel::F32;  // float weights: their GEMV has no int8 dot to gain and unrolls by M
    }
    if (pyllm::is_rows8(static_cast<QType>(qtype))) pk = pyllm::PrefillKernel::F32;  // its tiles unpack rows8
    if (pk != pyllm::PrefillKernel::F32) {
        pyllm::gemm_bf16_cpu(pk, static_cast<QType>(qtype), w.data_ptr<uint8_t>(), static_cast<size_t>(w.size(1)),
                             x.data_ptr<float>(), y.data_ptr<float>(), static_cast<int>(M), static_cast<int>(N),
                             static_cast<int>(K));
        return y;
    }
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

// The prefill kernel for mul_mat: the default, except that the output projection (precise_x: its error goes
// straight into the logits, e.g. perplexity's all-position logits) keeps the fp32 GEMM.
std::string prefill_kernel_for(bool precise_x) { return precise_x ? "f32" : ""; }

// Rows from which mul_mat leaves the 8-row GEMV chunks for the GEMM: GEMV_CHUNKED_MAX_M + 1 for the fp32 GEMM
// (and the output projection, which keeps it), lower where the prefill kernel is faster (cpu_prefill_min_rows).
int64_t gemm_min_rows(bool precise_x) {
    if (precise_x || pyllm::cpu_prefill_default() == pyllm::PrefillKernel::F32) return GEMV_CHUNKED_MAX_M + 1;
    return std::min<int64_t>(GEMV_CHUNKED_MAX_M + 1, pyllm::cpu_prefill_min_rows());
}

// y = x @ W.T picking the path: fused GEMV for M <= 8 rows (chunks of 8 up to GEMV_CHUNKED_MAX_M), dequantized
// tiles + GEMM above.  x may have any leading dims: f32 [..., K] -> [..., N] (`out` likewise).  One call from
// Python, so decode pays one crossing.
Tensor mul_mat(const Tensor& x, const Tensor& w, int64_t qtype, const std::optional<Tensor>& out, bool precise_x) {
    if (x.dim() == 2) {
        if (x.size(0) >= 1 && x.size(0) <= pyllm::GEMV_MAX_M) return gemv(x, w, qtype, out, precise_x);
        if (x.size(0) > pyllm::GEMV_MAX_M && x.size(0) < gemm_min_rows(precise_x))
            return gemv_chunked(x, w, qtype, out, precise_x);
        if (x.size(0) > pyllm::GEMV_MAX_M) return gemm(x, w, qtype, out, prefill_kernel_for(precise_x));
    }
    PYLLM_CHECK_VALUE(x.dim() >= 1, "mul_mat: x must have at least 1 dimension, got a scalar");
    PYLLM_CHECK_VALUE(w.dim() == 2, "mul_mat: w must be 2-D, got shape ", w.sizes());
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = w.size(0);
    const Tensor x2 = x.reshape({-1, x.size(-1)});
    if (x2.size(0) == 0) {
        check_qtype("mul_mat", qtype);
        return out ? *out : at::empty(shape, at::kFloat);
    }
    std::optional<Tensor> out2;
    if (out) {
        PYLLM_CHECK_VALUE(out->sizes() == at::IntArrayRef(shape), "mul_mat: out has shape ", out->sizes(),
                          ", expected ", at::IntArrayRef(shape));
        out2 = out->view({-1, w.size(0)});
    }
    const int64_t M = x2.size(0);
    const Tensor y = M <= pyllm::GEMV_MAX_M ? gemv(x2, w, qtype, out2, precise_x)
                     : M < gemm_min_rows(precise_x) ? gemv_chunked(x2, w, qtype, out2, precise_x)
                                                  : gemm(x2, w, qtype, out2, prefill_kernel_for(precise_x));
    return out ? *out : y.view(shape);
}

// Mixture-of-experts matmuls (llama.cpp's MUL_MAT_ID): y_i[t, j] = W_i[ids[t, j]] @ x_t (x f32 [T, K], each
// token's row shared by its k experts) or @ x[t, j] (x f32 [T, k, K]: a row per selected expert), for each stacked
// expert tensor w_i u8 [E, N_i, row_bytes_i] of type qtypes[i] -> y_i f32 [T, k, N_i].  One expert is the
// contiguous slice w_i[e], read in its block form.  Few rows per expert (decode): one gemv_each_cpu pass over the
// selected slices; more (prefill): tokens grouped by expert, each expert's slice read once by mul_mat.
std::vector<Tensor> moe_mul_mat(const Tensor& x, const std::vector<Tensor>& ws, const std::vector<int64_t>& qtypes,
                                const Tensor& ids) {
    const char* fn = "moe_mul_mat";
    PYLLM_CHECK_VALUE(!ws.empty() && ws.size() == qtypes.size(), fn, ": give one qtype per weight (", ws.size(),
                      " weights, ", qtypes.size(), " qtypes), at least one");
    check_tensor(fn, "ids", ids, at::kLong, 2);
    const int64_t T = ids.size(0), k = ids.size(1);
    PYLLM_CHECK_VALUE(x.dim() == 2 || x.dim() == 3, fn, ": x must be [T, K] or [T, k, K], got shape ", x.sizes());
    check_tensor(fn, "x", x, at::kFloat, x.dim());
    const bool per_slot = x.dim() == 3;
    PYLLM_CHECK_VALUE(x.size(0) == T && (!per_slot || x.size(1) == k) && T >= 1 && k >= 1, fn, ": x has shape ",
                      x.sizes(), " but ids has shape ", ids.sizes());
    const int64_t K = x.size(-1);
    const int64_t E = ws[0].dim() == 3 ? ws[0].size(0) : 0;
    for (size_t i = 0; i < ws.size(); ++i) {
        const QTypeTraits& tr = check_qtype(fn, qtypes[i]);
        check_tensor(fn, "w", ws[i], at::kByte, 3);
        PYLLM_CHECK_VALUE(ws[i].size(0) == E && E >= 1, fn, ": w[", i, "] has ", ws[i].size(0), " experts, w[0] ", E);
        PYLLM_CHECK_VALUE(!pyllm::is_rows8(static_cast<QType>(qtypes[i])), fn, ": ", tr.name,
                          " rows interleaved by 8 are not an expert layout");
        check_weight(fn, ws[i][0], tr, K);
    }
    const int64_t* id = ids.data_ptr<int64_t>();
    for (int64_t a = 0; a < T * k; ++a)
        PYLLM_CHECK_INDEX(id[a] >= 0 && id[a] < E, fn, ": ids[", a / k, ", ", a % k, "] = ", id[a],
                          " is out of range for ", E, " experts");
    std::vector<Tensor> ys;
    for (const Tensor& w : ws) ys.push_back(at::empty({T, k, w.size(1)}, at::kFloat));
    py::gil_scoped_release no_gil;
    const float* xp = x.data_ptr<float>();
    if (T == 1 || 2 * T * k <= E) {  // few selections: each expert's slice read for its rows, duplicates unlikely
        std::vector<pyllm::GemvPart> parts;
        std::vector<const float*> xs;
        for (size_t i = 0; i < ws.size(); ++i) {
            const int64_t N = ws[i].size(1), rb = ws[i].size(2);
            for (int64_t a = 0; a < T * k; ++a) {
                parts.push_back({static_cast<QType>(qtypes[i]), ws[i].data_ptr<uint8_t>() + id[a] * N * rb,
                                 static_cast<size_t>(rb), ys[i].data_ptr<float>() + a * N, static_cast<int>(N)});
                xs.push_back(xp + (per_slot ? a : a / k) * K);
            }
        }
        pyllm::gemv_each_cpu(parts.data(), xs.data(), static_cast<int>(parts.size()), static_cast<int>(K));
        return ys;
    }
    // Grouped by expert: the selections (t, j) of expert e, in order, as rows of one matmul per weight.
    std::vector<std::vector<int64_t>> rows(E);
    for (int64_t a = 0; a < T * k; ++a) rows[id[a]].push_back(a);
    const Tensor xr = per_slot ? x.view({T * k, K}) : x;
    for (int64_t e = 0; e < E; ++e) {
        if (rows[e].empty()) continue;
        const int64_t n = static_cast<int64_t>(rows[e].size());
        Tensor src = at::empty({n}, at::kLong);
        int64_t* sp = src.data_ptr<int64_t>();
        for (int64_t r = 0; r < n; ++r) sp[r] = per_slot ? rows[e][r] : rows[e][r] / k;
        const Tensor xe = xr.index_select(0, src);
        for (size_t i = 0; i < ws.size(); ++i) {
            const int64_t N = ws[i].size(1);
            const Tensor ye = mul_mat(xe, ws[i][e], qtypes[i], std::nullopt, false);
            float* yp = ys[i].data_ptr<float>();
            const float* ep = ye.data_ptr<float>();
            for (int64_t r = 0; r < n; ++r) std::copy(ep + r * N, ep + (r + 1) * N, yp + rows[e][r] * N);
        }
    }
    return ys;
}

// Rows of W as fp32: w u8 [N, row_bytes] -> [N, K], or [len(ids), K] for the rows ids (int64 or int32, 1-D).
Tensor dequantize(const Tensor& w, int64_t qtype, const std::optional<Tensor>& ids) {
    const QTypeTraits& tr = check_qtype("dequantize", qtype);
    check_tensor("dequantize", "w", w, at::kByte, 2);
    PYLLM_CHECK_VALUE(w.size(1) % tr.type_size == 0, "dequantize: w has ", w.size(1), " bytes per row, not a ",
                      "multiple of ", tr.name, "'s ", tr.type_size, "-byte block");
    const int64_t K = w.size(1) / tr.type_size * tr.block_size, N = w.size(0);
    check_weight("dequantize", w, tr, K);
    check_rows8("dequantize", "w", w, qtype);
    if (!ids) {
        Tensor y = at::empty({N, K}, at::kFloat);
        pyllm::dequantize_rows_cpu(static_cast<QType>(qtype), w.data_ptr<uint8_t>(), static_cast<size_t>(w.size(1)),
                                   nullptr, N, static_cast<int>(K), y.data_ptr<float>());
        return y;
    }
    PYLLM_CHECK_TYPE(ids->scalar_type() == at::kLong || ids->scalar_type() == at::kInt,
                     "dequantize: ids must be int64 or int32, got ", c10::toString(ids->scalar_type()));
    PYLLM_CHECK_VALUE(ids->device().is_cpu(), "dequantize: ids is on ", ids->device().str(),
                      " but the CPU kernels need CPU tensors");
    PYLLM_CHECK_VALUE(ids->dim() == 1, "dequantize: ids must be 1-D, got shape ", ids->sizes());
    const Tensor idx = ids->to(at::kLong).contiguous();
    const int64_t* p = idx.data_ptr<int64_t>();
    for (int64_t i = 0; i < idx.numel(); ++i)
        PYLLM_CHECK_INDEX(p[i] >= 0 && p[i] < N, "dequantize: ids[", i, "] = ", p[i], " is out of range for ", N,
                          " rows");
    Tensor y = at::empty({idx.numel(), K}, at::kFloat);
    pyllm::dequantize_rows_cpu(static_cast<QType>(qtype), w.data_ptr<uint8_t>(), static_cast<size_t>(w.size(1)), p,
                               idx.numel(), static_cast<int>(K), y.data_ptr<float>());
    return y;
}

// The internal type id of AWQ rows with group size G (csrc/common/qtype.h AWQ_G*).
int64_t awq_qtype(int64_t group_size) {
    const int id = group_size > 0 && group_size <= 256 ? pyllm::awq_qtype_id(static_cast<int>(group_size)) : -1;
    PYLLM_CHECK_VALUE(id >= 0, "awq_qtype: group_size ", group_size,
                      " has no CPU layout (supported: 32, 64, 128, 256)");
    return id;
}

// AutoAWQ "gemm" tensors -> AWQ rows: qweight int32 [K, N/8], qzeros int32 [K/G, N/8], scales fp16 [K/G, N]
// -> uint8 [N, 3K/G + K/2] (blocks.h AwqRow) for the type awq_qtype(G).
Tensor awq_repack(const Tensor& qweight, const Tensor& qzeros, const Tensor& scales, int64_t group_size) {
    const char* fn = "awq_repack";
    const int64_t id = awq_qtype(group_size);
    check_tensor(fn, "qweight", qweight, at::kInt, 2);
    check_tensor(fn, "qzeros", qzeros, at::kInt, 2);
    check_tensor(fn, "scales", scales, at::kHalf, 2);
    const int64_t K = qweight.size(0), N8 = qweight.size(1), G = group_size;
    PYLLM_CHECK_VALUE(K > 0 && N8 > 0 && K % G == 0, fn, ": qweight has shape ", qweight.sizes(),
                      "; K = ", K, " must be a positive multiple of group_size ", G);
    PYLLM_CHECK_VALUE(K <= INT32_MAX / 2 && N8 <= INT32_MAX / 8, fn, ": qweight shape ", qweight.sizes(), " is too large");
    PYLLM_CHECK_VALUE(qzeros.size(0) == K / G && qzeros.size(1) == N8, fn, ": qzeros has shape ", qzeros.sizes(),
                      ", expected [", K / G, ", ", N8, "] for qweight ", qweight.sizes(), " and group_size ", G);
    PYLLM_CHECK_VALUE(scales.size(0) == K / G && scales.size(1) == 8 * N8, fn, ": scales has shape ",
                      scales.sizes(), ", expected [", K / G, ", ", 8 * N8, "] for qweight ", qweight.sizes(),
                      " and group_size ", G);
    const int64_t rb = static_cast<int64_t>(pyllm::qtype_row_bytes(static_cast<QType>(id), K));
    Tensor out = at::empty({8 * N8, rb}, at::kByte);
    pyllm::awq_repack_cpu(qweight.data_ptr<int32_t>(), qzeros.data_ptr<int32_t>(),
                          reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()), static_cast<int>(K),
                          static_cast<int>(8 * N8), static_cast<int>(G), out.data_ptr<uint8_t>());
    return out;
}

// GGUF rows -> the same rows interleaved by 8 (common/blocks.h): w u8 [N, row_bytes] of Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/
// Q4_K/Q5_K/Q6_K -> u8 [N, row_bytes] of type rows8_qtype(qtype).
int64_t rows8_qtype(int64_t qtype) {
    return qtype >= 0 && qtype < pyllm::QTYPE_ID_LIMIT ? pyllm::rows8_qtype_id(static_cast<int>(qtype)) : -1;
}

Tensor repack_rows8(const Tensor& w, int64_t qtype, const std::optional<Tensor>& out_) {
    const char* fn = "repack_rows8";
    const QTypeTraits& tr = check_qtype(fn, qtype);
    PYLLM_CHECK_VALUE(rows8_qtype(qtype) >= 0, fn, ": ", tr.name, " has no rows-by-8 layout (Q4_0, Q4_1, Q5_0, ",
                      "Q5_1, Q8_0, Q4_K, Q5_K and Q6_K do)");
    check_tensor(fn, "w", w, at::kByte, 2);
    PYLLM_CHECK_VALUE(w.size(1) > 0 && w.size(1) % tr.type_size == 0, fn, ": w has ", w.size(1),
                      " bytes per row, not a positive multiple of ", tr.name, "'s ", tr.type_size, "-byte block");
    const int64_t K = w.size(1) / tr.type_size * tr.block_size;
    check_weight(fn, w, tr, K);
    PYLLM_CHECK_VALUE(w.size(0) % 8 == 0, fn, ": w has ", w.size(0), " rows, not a multiple of 8");
    Tensor out;
    if (out_) {
        out = *out_;
        check_tensor(fn, "out", out, at::kByte, 2);
        PYLLM_CHECK_VALUE(out.sizes() == w.sizes(), fn, ": out has shape ", out.sizes(), ", w ", w.sizes());
        const auto* o = out.data_ptr<uint8_t>();
        const auto* i = w.data_ptr<uint8_t>();
        PYLLM_CHECK_VALUE(o + out.numel() <= i || i + w.numel() <= o, fn,
                          ": out overlaps w (w's rows are read while the copy is written)");
    } else {
        out = at::empty_like(w);
        pyllm::cpu_advise_huge_pages(out.data_ptr(), static_cast<size_t>(out.numel()));  // before the first write
    }
    pyllm::repack_rows8_cpu(static_cast<QType>(qtype), w.data_ptr<uint8_t>(), w.size(0), static_cast<int>(K),
                            out.data_ptr<uint8_t>());
    return out;
}

void set_isa(const std::string& name) {
    pyllm::Isa isa;
    const std::string n = name == "generic" ? "scalar" : name;
    PYLLM_CHECK_VALUE(pyllm::cpu_isa_from_name(n.c_str(), &isa), "set_isa: unknown ISA '", name,
                      "', expected one of scalar, avx2, avx512, amx");
    PYLLM_CHECK_VALUE(pyllm::cpu_isa_available(isa), "set_isa: '", name,
                      "' is not available (not compiled in, or this CPU or OS lacks it)");
    pyllm::cpu_set_isa(isa);
    // The prefill GEMM follows the family as PYLLM_ISA makes it (cpu_prefill_default): AMX tiles for amx,
    // AVX-512 bf16 for avx512, the int8 GEMVs for avx2 (and avx512 without bf16), fp32 for scalar, so one switch
    // moves both kernels for an A/B run.
    using pyllm::PrefillKernel;
    PrefillKernel pk = pyllm::cpu_isa_simd(isa) ? PrefillKernel::Int8Gemv : PrefillKernel::F32;
    if (isa == pyllm::Isa::Amx && pyllm::cpu_prefill_available(PrefillKernel::AmxBf16)) pk = PrefillKernel::AmxBf16;
    else if (isa == pyllm::Isa::Avx512 && pyllm::cpu_prefill_available(PrefillKernel::Avx512Bf16))
        pk = PrefillKernel::Avx512Bf16;
    pyllm::cpu_set_prefill_kernel(pk);
}

std::vector<std::string> available_isas() {
    std::vector<std::string> r;
    for (int i = 0; i < pyllm::ISA_COUNT; ++i)
        if (pyllm::cpu_isa_available(static_cast<pyllm::Isa>(i))) r.push_back(pyllm::cpu_isa_name(static_cast<pyllm::Isa>(i)));
    return r;
}

void set_num_threads(int64_t n) {
    PYLLM_CHECK_VALUE(n >= 1 && n <= 4096, "set_num_threads: n must be >= 1, got ", n);
    pyllm::cpu_set_num_threads(static_cast<int>(n));
}

bool release_thread_pool() { return pyllm::cpu_release_thread_pool(); }

std::vector<int64_t> supported_types() {
    std::vector<int64_t> r;
    for (int id = 0; id < pyllm::QTYPE_ID_LIMIT; ++id)
        if (pyllm::qtype_traits(id) && pyllm::cpu_type_supported(static_cast<QType>(id))) r.push_back(id);
    return r;
}

uint64_t read_sum(const Tensor& buf, int64_t threads) {
    check_tensor("read_sum", "buf", buf, at::kByte, 1);
    return pyllm::read_sum_cpu(buf.data_ptr<uint8_t>(), static_cast<size_t>(buf.numel()), static_cast<int>(threads));
}

}  // namespace

void register_kernels(py::module& m) {
    m.def("gemv", &gemv, "y[M,N] = x[M,K] @ W.T, M <= 8, W as raw GGUF blocks u8 [N, row_bytes]; precise_x: "
          "16-bit activations where the type has such a kernel (Q8_0)", py::arg("x"), py::arg("w"), py::arg("qtype"),
          py::arg("out") = py::none(), py::arg("precise_x") = false);
    m.def("gemv_argmax", &gemv_argmax, "(gemv's y, each row's argmax as the decode step's logits get it: -1 where "
          "a value is not finite)", py::arg("x"), py::arg("w"), py::arg("qtype"), py::arg("precise_x") = false);
    m.def("top_k_ids", &top_k_ids, py::arg("y"), py::arg("k"),
          "ids of y's k largest values, ascending (lowest ids where values tie at the k-th), None where a value is "
          "not finite");
    m.def("row_argmax", &row_argmax, "first index of y's largest value, -1 where a value is not finite",
          py::arg("y"));
    m.def("gemm", &gemm, "y[M,N] = x[M,K] @ W.T for any M; kernel 'f32' (dequantized tiles + torch GEMM), "
          "'avx512-bf16', 'amx-bf16', 'int8-gemv' (8-row GEMV chunks) or '' (the default, prefill_kernel())",
          py::arg("x"), py::arg("w"), py::arg("qtype"), py::arg("out") = py::none(), py::arg("kernel") = "f32");
    m.def("prefill_kernel", [] { return std::string(pyllm::cpu_prefill_name(pyllm::cpu_prefill_default())); },
          "the GEMM kernel mul_mat uses above the GEMV's rows (PYLLM_ISA can force another)");
    m.def("set_prefill_kernel", [](const std::string& name) {
        pyllm::cpu_set_prefill_kernel(prefill_kernel_named(name));
    }, "prefill GEMM kernel mul_mat uses: 'f32', 'avx512-bf16', 'amx-bf16' or 'int8-gemv' (must be available)");
    m.def("gemm_min_rows", &gemm_min_rows, "smallest x row count mul_mat sends to the GEMM (fewer: 8-row GEMVs)",
          py::arg("precise_x") = false);
    m.def("prefill_kernels", [] {
        std::vector<std::string> r;
        for (auto k : pyllm::PREFILL_KERNELS)
            if (pyllm::cpu_prefill_available(k)) r.push_back(pyllm::cpu_prefill_name(k));
        return r;
    }, "prefill GEMM kernels this machine runs");
    // Without the GIL (ATen needs none, and the tensors are checked before any pointer is used): a prefill's
    // GEMMs take tens of milliseconds, during which a server's event loop must keep streaming other requests.
    m.def("mul_mat", &mul_mat, "y[..., N] = x[..., K] @ W.T: gemv (8-row chunks up to 32 rows), else gemm", py::arg("x"),
          py::arg("w"), py::arg("qtype"), py::arg("out") = py::none(), py::arg("precise_x") = false,
          py::call_guard<py::gil_scoped_release>());
    m.def("moe_mul_mat", &moe_mul_mat, "mixture-of-experts matmuls: y_i[t, j] = W_i[ids[t, j]] @ x[t] (x [T, K]) or "
          "@ x[t, j] (x [T, k, K]) for stacked expert tensors w_i u8 [E, N_i, row_bytes] -> [y_i f32 [T, k, N_i]]",
          py::arg("x"), py::arg("ws"), py::arg("qtypes"), py::arg("ids"));
    m.def("dequantize", &dequantize, "W (or rows ids of W) as fp32 [N or len(ids), K]", py::arg("w"),
          py::arg("qtype"), py::arg("ids") = py::none());
    m.def("awq_qtype", &awq_qtype, "internal type id of AWQ rows with group size G (32, 64, 128, 256)",
          py::arg("group_size"));
    m.def("awq_repack", &awq_repack,
          "AutoAWQ gemm qweight int32 [K, N/8], qzeros int32 [K/G, N/8], scales fp16 [K/G, N] -> AWQ rows u8 "
          "[N, 3K/G + K/2] of type awq_qtype(G)",
          py::arg("qweight"), py::arg("qzeros"), py::arg("scales"), py::arg("group_size"));
    m.def("rows8_qtype", &rows8_qtype, "internal type id of qtype's rows interleaved by 8, or -1 if it has none",
          py::arg("qtype"));
    m.def("repack_rows8", &repack_rows8,
          "Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K rows u8 [N, row_bytes] (N % 8 == 0) -> the same rows interleaved "
          "by 8, of type "
          "rows8_qtype(qtype) (the decode step's layout), written to out (u8, w's shape) where given",
          py::arg("w"), py::arg("qtype"), py::arg("out") = py::none());
    m.def("advise_huge_pages", [](const Tensor& t) {
        check_tensor("advise_huge_pages", "t", t, t.scalar_type(), t.dim());
        return pyllm::cpu_advise_huge_pages(t.data_ptr(), static_cast<size_t>(t.numel() * t.element_size()));
    }, "asks for huge pages under a CPU tensor not yet written (Linux); returns the bytes advised", py::arg("t"));
    m.def("set_isa", &set_isa, "CPU kernels to use: 'scalar', 'avx2', 'avx512' or 'amx' (default: the best available)");
    m.def("get_isa", [] { return std::string(pyllm::cpu_isa_name(pyllm::cpu_get_isa())); });
    m.def("available_isas", &available_isas);
    m.def("best_isa", [] { return std::string(pyllm::cpu_isa_name(pyllm::cpu_best_isa())); });
    m.def("emulate_avx512", &pyllm::cpu_emulate_avx512, py::arg("on"),
          "tests only: on a CPU without AVX-512, offer 'avx512' as its VNNI kernels compiled as AVX2 code; returns "
          "whether that is on");
    m.def("avx512_emulated", &pyllm::cpu_avx512_emulated);
    m.def("rows8_pairs", &pyllm::cpu_rows8_pairs,
          "whether the AVX-512 rows-by-8 kernels take two 8-row groups per zmm (the default except on AMD CPUs; "
          "PYLLM_ROWS8_PAIRS=0|1); the same bits either way");
    m.def("set_rows8_pairs", &pyllm::cpu_set_rows8_pairs, py::arg("on"),
          "two 8-row groups per zmm in the AVX-512 rows-by-8 kernels or one per ymm (A/B benchmarks, tests)");
    m.def("set_num_threads", &set_num_threads, "threads for pyllm's CPU kernels (torch's own setting untouched)");
    m.def("release_thread_pool", &release_thread_pool, "the calling thread's OpenMP workers exit (a thread done with the "
          "kernels for a while: another thread's regions then keep their spin-waits); false where the runtime cannot");
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
}

}  // namespace bind
}  // namespace pyllm
