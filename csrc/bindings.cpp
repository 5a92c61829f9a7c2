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
    TORCH_CHECK_VALUE(tr != nullptr && id >= 0 && id < pyllm::QTYPE_ID_LIMIT, fn, ": unknown GGML type id ", id);
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

// The Q*_R8 layouts hold whole groups of 8 rows.
void check_rows8(const char* fn, const char* name, const Tensor& w, int64_t qtype) {
    const QType t = static_cast<QType>(qtype);
    TORCH_CHECK_VALUE(!pyllm::is_rows8(t) || w.size(0) % 8 == 0, fn, ": ", name, " is ", pyllm::qtype_name(t),
                      " (rows interleaved by 8) but has ", w.size(0), " rows, not a multiple of 8");
}

Tensor make_out(const char* fn, const std::optional<Tensor>& out, int64_t M, int64_t N) {
    if (!out) return at::empty({M, N}, at::kFloat);
    check_tensor(fn, "out", *out, at::kFloat, 2);
    TORCH_CHECK_VALUE(out->size(0) == M && out->size(1) == N, fn, ": out has shape ", out->sizes(), ", expected [",
                      M, ", ", N, "]");
    return *out;
}

// y = x @ W.T for 1 <= M <= 8 rows of x: x f32 [M, K], w u8 [N, row_bytes] -> y f32 [M, N]
Tensor gemv(const Tensor& x, const Tensor& w, int64_t qtype, const std::optional<Tensor>& out, bool precise_x) {
    const QTypeTraits& tr = check_qtype("gemv", qtype);
    check_tensor("gemv", "x", x, at::kFloat, 2);
    const int64_t M = x.size(0), K = x.size(1);
    TORCH_CHECK_VALUE(M >= 1 && M <= pyllm::GEMV_MAX_M, "gemv: x has ", M, " rows, the fused GEMV takes 1..",
                      pyllm::GEMV_MAX_M, " (use gemm)");
    check_weight("gemv", w, tr, K);
    check_rows8("gemv", "w", w, qtype);
    const int64_t N = w.size(0);
    Tensor y = make_out("gemv", out, M, N);
    pyllm::gemv_cpu(static_cast<QType>(qtype), w.data_ptr<uint8_t>(), static_cast<size_t>(w.size(1)),
                    x.data_ptr<float>(), y.data_ptr<float>(), static_cast<int>(M), static_cast<int>(N),
                    static_cast<int>(K), precise_x);
    return y;
}

pyllm::PrefillKernel prefill_kernel_named(const std::string& name) {
    for (auto k : {pyllm::PrefillKernel::F32, pyllm::PrefillKernel::Avx512Bf16, pyllm::PrefillKernel::AmxBf16})
        if (name == pyllm::cpu_prefill_name(k)) {
            TORCH_CHECK_VALUE(pyllm::cpu_prefill_available(k), "gemm: kernel '", name,
                              "' is not available (not compiled in, or this CPU or OS lacks it)");
            return k;
        }
    TORCH_CHECK_VALUE(false, "gemm: unknown kernel '", name, "', expected 'f32', 'avx512-bf16' or 'amx-bf16'");
    return pyllm::PrefillKernel::F32;
}

// y = x @ W.T for any M (prefill).  kernel "f32": W is dequantized a tile of rows at a time into an fp32 buffer
// that stays in cache, and each tile goes through torch's GEMM (MKL / oneDNN).  "amx-bf16" / "avx512-bf16": W
// dequantized to bf16 strips, x rounded to bf16, fp32 accumulation (csrc/cpu/gemm_amx.cpp).  "" = the default
// (cpu_prefill_default).  x f32 [M, K] -> y f32 [M, N]
Tensor gemm(const Tensor& x, const Tensor& w, int64_t qtype, const std::optional<Tensor>& out,
            const std::string& kernel) {
    const QTypeTraits& tr = check_qtype("gemm", qtype);
    check_tensor("gemm", "x", x, at::kFloat, 2);
    const int64_t M = x.size(0), K = x.size(1);
    TORCH_CHECK_VALUE(M >= 1, "gemm: x has no rows");
    check_weight("gemm", w, tr, K);
    check_rows8("gemm", "w", w, qtype);
    const int64_t N = w.size(0);
    Tensor y = make_out("gemm", out, M, N);
    pyllm::PrefillKernel pk = kernel.empty() ? pyllm::cpu_prefill_default() : prefill_kernel_named(kernel);
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

// Up to this many rows, mul_mat runs the fused GEMV on 8-row chunks instead of dequantize + fp32 GEMM: measured
// single-thread on 4096x4096 Q4_0/Q4_K, 2-4 GEMV passes (int8 maddubs: 32 MACs per instruction, W read
// quantized) take 8-19 ms where dequantizing W alone costs ~30 ms; above ~64 rows the fp32 GEMM wins.
constexpr int64_t GEMV_CHUNKED_MAX_M = 32;

Tensor gemv_chunked(const Tensor& x, const Tensor& w, int64_t qtype, const std::optional<Tensor>& out,
                    bool precise_x) {
    const int64_t M = x.size(0);
    check_tensor("mul_mat", "x", x, at::kFloat, 2);
    check_tensor("mul_mat", "w", w, at::kByte, 2);
    Tensor y = make_out("mul_mat", out, M, w.size(0));
    for (int64_t m0 = 0; m0 < M; m0 += pyllm::GEMV_MAX_M) {
        const int64_t mr = std::min<int64_t>(pyllm::GEMV_MAX_M, M - m0);
        gemv(x.narrow(0, m0, mr), w, qtype, y.narrow(0, m0, mr), precise_x);  // row slices of contiguous tensors stay contiguous
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
    const Tensor y = M <= pyllm::GEMV_MAX_M ? gemv(x2, w, qtype, out2, precise_x)
                     : M < gemm_min_rows(precise_x) ? gemv_chunked(x2, w, qtype, out2, precise_x)
                                                  : gemm(x2, w, qtype, out2, prefill_kernel_for(precise_x));
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
    check_rows8("dequantize", "w", w, qtype);
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

// The internal type id of AWQ rows with group size G (csrc/common/qtype.h AWQ_G*).
int64_t awq_qtype(int64_t group_size) {
    const int id = group_size > 0 && group_size <= 256 ? pyllm::awq_qtype_id(static_cast<int>(group_size)) : -1;
    TORCH_CHECK_VALUE(id >= 0, "awq_qtype: group_size ", group_size,
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
    TORCH_CHECK_VALUE(K > 0 && N8 > 0 && K % G == 0, fn, ": qweight has shape ", qweight.sizes(),
                      "; K = ", K, " must be a positive multiple of group_size ", G);
    TORCH_CHECK_VALUE(K <= INT32_MAX / 2 && N8 <= INT32_MAX / 8, fn, ": qweight shape ", qweight.sizes(), " is too large");
    TORCH_CHECK_VALUE(qzeros.size(0) == K / G && qzeros.size(1) == N8, fn, ": qzeros has shape ", qzeros.sizes(),
                      ", expected [", K / G, ", ", N8, "] for qweight ", qweight.sizes(), " and group_size ", G);
    TORCH_CHECK_VALUE(scales.size(0) == K / G && scales.size(1) == 8 * N8, fn, ": scales has shape ",
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

Tensor repack_rows8(const Tensor& w, int64_t qtype) {
    const char* fn = "repack_rows8";
    const QTypeTraits& tr = check_qtype(fn, qtype);
    TORCH_CHECK_VALUE(rows8_qtype(qtype) >= 0, fn, ": ", tr.name, " has no rows-by-8 layout (Q4_0, Q4_1, Q5_0, ",
                      "Q5_1, Q8_0, Q4_K, Q5_K and Q6_K do)");
    check_tensor(fn, "w", w, at::kByte, 2);
    TORCH_CHECK_VALUE(w.size(1) > 0 && w.size(1) % tr.type_size == 0, fn, ": w has ", w.size(1),
                      " bytes per row, not a positive multiple of ", tr.name, "'s ", tr.type_size, "-byte block");
    const int64_t K = w.size(1) / tr.type_size * tr.block_size;
    check_weight(fn, w, tr, K);
    TORCH_CHECK_VALUE(w.size(0) % 8 == 0, fn, ": w has ", w.size(0), " rows, not a multiple of 8");
    Tensor out = at::empty_like(w);
    pyllm::repack_rows8_cpu(static_cast<QType>(qtype), w.data_ptr<uint8_t>(), w.size(0), static_cast<int>(K),
                            out.data_ptr<uint8_t>());
    return out;
}

void set_isa(const std::string& name) {
    pyllm::Isa isa;
    const std::string n = name == "generic" ? "scalar" : name;
    TORCH_CHECK_VALUE(pyllm::cpu_isa_from_name(n.c_str(), &isa), "set_isa: unknown ISA '", name,
                      "', expected one of scalar, avx2, avx512, amx");
    TORCH_CHECK_VALUE(pyllm::cpu_isa_available(isa), "set_isa: '", name,
                      "' is not available (not compiled in, or this CPU or OS lacks it)");
    pyllm::cpu_set_isa(isa);
    // The prefill GEMM follows the family as PYLLM_ISA makes it (cpu_prefill_default): AMX tiles for amx,
    // AVX-512 bf16 for avx512, fp32 below, so one switch moves both kernels for an A/B run.
    using pyllm::PrefillKernel;
    PrefillKernel pk = PrefillKernel::F32;
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
    TORCH_CHECK_VALUE(n >= 1 && n <= 4096, "set_num_threads: n must be >= 1, got ", n);
    pyllm::cpu_set_num_threads(static_cast<int>(n));
}

std::vector<int64_t> supported_types() {
    std::vector<int64_t> r;
    for (int id = 0; id < pyllm::QTYPE_ID_LIMIT; ++id)
        if (pyllm::qtype_traits(id) && pyllm::cpu_type_supported(static_cast<QType>(id))) r.push_back(id);
    return r;
}

// The decode step's profile (kernels.h DecodeProfile) as a dict of counters: ns, bytes and calls.
py::dict decode_profile_read() {
    const pyllm::DecodeProfile& p = pyllm::decode_profile_cpu();
    py::dict d;
    d["on"] = p.on;
    d["steps"] = p.steps;
    d["step_ns"] = p.step_ns;
    d["embed_ns"] = p.embed_ns;
    d["norm_ns"] = p.norm_ns;
    d["attn_ns"] = p.attn_ns;
    d["act_ns"] = p.act_ns;
    const std::pair<const char*, const pyllm::GemvStats*> kinds[] = {
        {"qkv", &p.qkv}, {"wo", &p.wo}, {"gate_up", &p.gate_up}, {"down", &p.down}, {"output", &p.output}};
    for (const auto& [name, g] : kinds) {
        py::dict e;
        e["calls"] = g->calls;
        e["bytes"] = g->bytes;
        e["quant_ns"] = g->quant_ns;
        e["wall_ns"] = g->wall_ns;
        e["busy_ns"] = g->busy_ns;
        e["thread_ns"] = g->thread_ns;
        d[name] = e;
    }
    return d;
}

uint64_t read_sum(const Tensor& buf, int64_t threads) {
    check_tensor("read_sum", "buf", buf, at::kByte, 1);
    return pyllm::read_sum_cpu(buf.data_ptr<uint8_t>(), static_cast<size_t>(buf.numel()), static_cast<int>(threads));
}

// ---- decode_step: one token through all layers of a llama-family model (csrc/cpu/decode_step.cpp) --------
// DecodeContext holds the raw pointers plus references to every tensor they point into (so the storage lives
// as long as the context) and the scratch buffers; everything is checked here, once.
struct DecodeContext {
    pyllm::DecodeModel model;
    pyllm::DecodeScratch scratch;
    std::vector<Tensor> keep;
    int64_t vocab_rows = 0;
};

constexpr const char* kDC = "DecodeContext";

pyllm::DecodeWeight decode_weight(DecodeContext& c, const std::string& name, const Tensor& w, int64_t qtype,
                                  int64_t N, int64_t K) {
    const QTypeTraits& tr = check_qtype(kDC, qtype);
    check_tensor(kDC, name.c_str(), w, at::kByte, 2);
    TORCH_CHECK_VALUE(K > 0 && K % tr.block_size == 0, kDC, ": ", name, ": K=", K, " is not a multiple of ",
                      tr.name, "'s block size ", tr.block_size);
    const int64_t need = K / tr.block_size * tr.type_size;
    TORCH_CHECK_VALUE(w.size(1) == need, kDC, ": ", name, " has ", w.size(1), " bytes per row but ", tr.name,
                      " with K=", K, " needs ", need);
    if (N >= 0)
        TORCH_CHECK_VALUE(w.size(0) == N, kDC, ": ", name, " has ", w.size(0), " rows, expected ", N);
    check_rows8(kDC, name.c_str(), w, qtype);
    c.keep.push_back(w);
    return {w.data_ptr<uint8_t>(), static_cast<size_t>(w.size(1)), static_cast<QType>(qtype)};
}

const float* decode_vec(DecodeContext& c, const std::string& name, const Tensor& t, int64_t n) {
    check_tensor(kDC, name.c_str(), t, at::kFloat, 1);
    TORCH_CHECK_VALUE(t.size(0) == n, kDC, ": ", name, " has ", t.size(0), " values, expected ", n);
    c.keep.push_back(t);
    return t.data_ptr<float>();
}

// A KV cache part: kv_type 0 f32, 1 f16, 2 q8_0, 3 q4_0 (pyllm.runtime.kv_cache's storage); t has `lead` dims then
// head_dim values (float types) or head_dim/32 blocks as bytes (uint8).  Returns the row bytes.
size_t check_kv_rows(const char* fn, const char* name, const Tensor& t, int64_t kv_type, int64_t head_dim,
                     int64_t lead) {
    TORCH_CHECK_VALUE(kv_type >= 0 && kv_type <= 3, fn, ": ", name, " type must be 0 (f32), 1 (f16), 2 (q8_0) or 3 "
                      "(q4_0), got ", kv_type);
    const auto kt = static_cast<pyllm::KVType>(kv_type);
    const bool block = kt == pyllm::KVType::Q8_0 || kt == pyllm::KVType::Q4_0;
    TORCH_CHECK_VALUE(!block || head_dim % 32 == 0, fn, ": ", name, ": block types need head_dim % 32 == 0, got ",
                      head_dim);
    const at::ScalarType want = block ? at::kByte : kt == pyllm::KVType::F16 ? at::kHalf : at::kFloat;
    check_tensor(fn, name, t, want, lead + 1);
    const int64_t row = static_cast<int64_t>(pyllm::kv_row_bytes(kt, static_cast<int>(head_dim)));
    const int64_t last = block ? row : head_dim;
    TORCH_CHECK_VALUE(t.size(lead) == last, fn, ": ", name, " rows have ", t.size(lead), " entries, expected ", last);
    return static_cast<size_t>(row);
}

const float* check_kv_extra(const char* fn, const char* name, const std::optional<Tensor>& t, int64_t numel,
                            std::vector<Tensor>& keep) {
    if (!t) return nullptr;
    TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat, fn, ": ", name, " must be float32, got ",
                     c10::toString(t->scalar_type()));
    TORCH_CHECK_VALUE(t->device().is_cpu() && t->is_contiguous() && t->numel() == numel, fn, ": ", name,
                      " must be a contiguous CPU tensor of ", numel, " values, got shape ", t->sizes());
    keep.push_back(*t);
    return t->data_ptr<float>();
}

// weights: 7 per layer in the order q, k, v, output, gate, up, down (uint8 [N, row_bytes]); qtypes likewise.
// q_bias/k_bias/v_bias: empty or one per layer; q_norm/k_norm: empty or one per layer ([head_dim]).
// Gemma 3: post_attn_norm/post_ffw_norm (empty or one per layer, [n_embd]), embd_scale (0 = none), act
// ('silu' or 'gelu_tanh'), final_softcap (0 = none), a second rope table cos2/sin2 chosen per layer by
// layer_rope (0/1; empty = all 0) and per-layer windows layer_window (empty = `window` for every layer).
std::unique_ptr<DecodeContext> make_decode_context(
    const std::vector<Tensor>& weights, const std::vector<int64_t>& qtypes, const std::vector<Tensor>& attn_norm,
    const std::vector<Tensor>& ffn_norm, const std::vector<Tensor>& q_bias, const std::vector<Tensor>& k_bias,
    const std::vector<Tensor>& v_bias, const std::vector<Tensor>& q_norm, const std::vector<Tensor>& k_norm,
    const Tensor& token_embd, int64_t token_embd_qtype, const Tensor& output, int64_t output_qtype,
    const Tensor& output_norm, const Tensor& cos, const Tensor& sin, const Tensor& k_cache, const Tensor& v_cache,
    int64_t n_embd, int64_t n_ff, int64_t n_head, int64_t n_kv_head, int64_t head_dim, int64_t rope_dim,
    const std::string& rope_style, double eps, double scale, int64_t window,
    const std::vector<Tensor>& post_attn_norm, const std::vector<Tensor>& post_ffw_norm, double embd_scale,
    const std::string& act, double final_softcap, const std::optional<Tensor>& cos2,
    const std::optional<Tensor>& sin2, const std::vector<int64_t>& layer_rope,
    const std::vector<int64_t>& layer_window, int64_t k_type, int64_t v_type, const std::optional<Tensor>& k_mu,
    const std::optional<Tensor>& v_mu, const std::optional<Tensor>& k_rot, const std::optional<Tensor>& v_rot,
    const std::optional<Tensor>& k_scale, const std::optional<Tensor>& k_sink, const std::optional<Tensor>& v_sink) {
    auto ctx = std::make_unique<DecodeContext>();
    pyllm::DecodeConfig& c = ctx->model.cfg;
    const int64_t n_layer = static_cast<int64_t>(attn_norm.size());
    TORCH_CHECK_VALUE(n_layer >= 1, kDC, ": no layers (attn_norm is empty)");
    TORCH_CHECK_VALUE(n_embd >= 1 && n_ff >= 1 && n_head >= 1 && n_kv_head >= 1 && head_dim >= 1, kDC,
                      ": sizes must be >= 1, got n_embd=", n_embd, " n_ff=", n_ff, " n_head=", n_head, " n_kv_head=",
                      n_kv_head, " head_dim=", head_dim);
    TORCH_CHECK_VALUE(n_head % n_kv_head == 0, kDC, ": n_head ", n_head, " is not a multiple of n_kv_head ",
                      n_kv_head);
    TORCH_CHECK_VALUE(rope_dim >= 2 && rope_dim % 2 == 0 && rope_dim <= head_dim, kDC, ": rope_dim ", rope_dim,
                      " must be even and in [2, head_dim=", head_dim, "]");
    TORCH_CHECK_VALUE(rope_style == "norm" || rope_style == "neox", kDC, ": rope_style must be 'norm' or 'neox', got '",
                      rope_style, "'");
    TORCH_CHECK_VALUE(window >= 0, kDC, ": window must be >= 0, got ", window);
    TORCH_CHECK_VALUE(eps > 0 && scale > 0, kDC, ": eps and scale must be > 0, got ", eps, ", ", scale);
    TORCH_CHECK_VALUE(weights.size() == 7 * static_cast<size_t>(n_layer) && qtypes.size() == weights.size(), kDC,
                      ": expected 7 weights and qtypes per layer (", 7 * n_layer, "), got ", weights.size(), " and ",
                      qtypes.size());
    TORCH_CHECK_VALUE(ffn_norm.size() == static_cast<size_t>(n_layer), kDC, ": ffn_norm has ", ffn_norm.size(),
                      " entries, expected ", n_layer);
    const bool bias = !q_bias.empty();
    TORCH_CHECK_VALUE((q_bias.size() == k_bias.size() && k_bias.size() == v_bias.size()) &&
                          (!bias || q_bias.size() == static_cast<size_t>(n_layer)),
                      kDC, ": q/k/v_bias must be empty or have one tensor per layer (", n_layer, "), got ",
                      q_bias.size(), "/", k_bias.size(), "/", v_bias.size());
    const bool qkn = !q_norm.empty();
    TORCH_CHECK_VALUE(q_norm.size() == k_norm.size() && (!qkn || q_norm.size() == static_cast<size_t>(n_layer)), kDC,
                      ": q/k_norm must be empty or have one tensor per layer (", n_layer, "), got ", q_norm.size(),
                      "/", k_norm.size());
    const int64_t qd = n_head * head_dim, kvd = n_kv_head * head_dim;
    // Gemma 3 extras (defaults keep the llama-family step unchanged).
    TORCH_CHECK_VALUE(post_attn_norm.size() == post_ffw_norm.size() &&
                          (post_attn_norm.empty() || post_attn_norm.size() == static_cast<size_t>(n_layer)),
                      kDC, ": post_attn_norm/post_ffw_norm must be empty or have one tensor per layer (", n_layer,
                      "), got ", post_attn_norm.size(), "/", post_ffw_norm.size());
    TORCH_CHECK_VALUE(act == "silu" || act == "gelu_tanh", kDC, ": act must be 'silu' or 'gelu_tanh', got '", act,
                      "'");
    TORCH_CHECK_VALUE(embd_scale >= 0 && final_softcap >= 0, kDC, ": embd_scale and final_softcap must be >= 0, got ",
                      embd_scale, ", ", final_softcap);
    TORCH_CHECK_VALUE(cos2.has_value() == sin2.has_value(), kDC, ": cos2 and sin2 must be given together");
    TORCH_CHECK_VALUE(layer_rope.empty() || layer_rope.size() == static_cast<size_t>(n_layer), kDC,
                      ": layer_rope must be empty or have one entry per layer (", n_layer, "), got ",
                      layer_rope.size());
    for (int64_t r : layer_rope)
        TORCH_CHECK_VALUE(r == 0 || (r == 1 && cos2.has_value()), kDC,
                          ": layer_rope entries must be 0, or 1 when cos2/sin2 are given, got ", r);
    TORCH_CHECK_VALUE(layer_window.empty() || layer_window.size() == static_cast<size_t>(n_layer), kDC,
                      ": layer_window must be empty or have one entry per layer (", n_layer, "), got ",
                      layer_window.size());
    for (int64_t w : layer_window)
        TORCH_CHECK_VALUE(w >= 0, kDC, ": layer_window entries must be >= 0, got ", w);

    // KV cache: K and V each (n_layer, n_kv_head, max_seq, row) of its own type (-1: f16/f32 from the dtype).
    if (k_type < 0) k_type = k_cache.scalar_type() == at::kHalf ? 1 : 0;
    if (v_type < 0) v_type = v_cache.scalar_type() == at::kHalf ? 1 : 0;
    const size_t k_row = check_kv_rows(kDC, "k_cache", k_cache, k_type, head_dim, 3);
    const size_t v_row = check_kv_rows(kDC, "v_cache", v_cache, v_type, head_dim, 3);
    TORCH_CHECK_VALUE(k_cache.size(0) == n_layer && k_cache.size(1) == n_kv_head && k_cache.size(2) >= 1, kDC,
                      ": k_cache has shape ", k_cache.sizes(), ", expected (", n_layer, ", ", n_kv_head,
                      ", max_seq, row)");
    TORCH_CHECK_VALUE(v_cache.sizes().slice(0, 3) == k_cache.sizes().slice(0, 3), kDC, ": v_cache has shape ",
                      v_cache.sizes(), " but k_cache has ", k_cache.sizes());
    TORCH_CHECK_VALUE(k_cache.size(2) <= INT32_MAX, kDC, ": max_seq too large");
    check_tensor(kDC, "cos", cos, at::kFloat, 2);
    check_tensor(kDC, "sin", sin, at::kFloat, 2);
    TORCH_CHECK_VALUE(cos.size(1) == rope_dim / 2 && sin.sizes() == cos.sizes() && cos.size(0) >= 1, kDC,
                      ": cos/sin have shapes ", cos.sizes(), "/", sin.sizes(), ", expected equal [max_pos, ",
                      rope_dim / 2, "]");

    if (cos2) {
        check_tensor(kDC, "cos2", *cos2, at::kFloat, 2);
        check_tensor(kDC, "sin2", *sin2, at::kFloat, 2);
        TORCH_CHECK_VALUE(cos2->sizes() == cos.sizes() && sin2->sizes() == cos.sizes(), kDC,
                          ": cos2/sin2 have shapes ", cos2->sizes(), "/", sin2->sizes(), ", expected cos's ",
                          cos.sizes());
    }

    c.n_layer = static_cast<int>(n_layer);
    c.n_embd = static_cast<int>(n_embd);
    c.n_ff = static_cast<int>(n_ff);
    c.n_head = static_cast<int>(n_head);
    c.n_kv_head = static_cast<int>(n_kv_head);
    c.head_dim = static_cast<int>(head_dim);
    c.rope_dim = static_cast<int>(rope_dim);
    c.max_pos = static_cast<int>(std::min<int64_t>(cos.size(0), INT32_MAX));
    c.max_seq = static_cast<int>(k_cache.size(2));
    c.gelu_tanh = act == "gelu_tanh";
    c.embd_scale = static_cast<float>(embd_scale);
    c.final_softcap = static_cast<float>(final_softcap);
    c.neox = rope_style == "neox";
    c.eps = static_cast<float>(eps);
    c.scale = static_cast<float>(scale);

    DecodeContext& d = *ctx;
    d.keep.insert(d.keep.end(), {cos, sin, k_cache, v_cache});
    d.model.cos = cos.data_ptr<float>();
    d.model.sin = sin.data_ptr<float>();
    if (cos2) {
        d.keep.insert(d.keep.end(), {*cos2, *sin2});
        d.model.cos2 = cos2->data_ptr<float>();
        d.model.sin2 = sin2->data_ptr<float>();
    }
    const int64_t mu_n = n_layer * n_kv_head * head_dim;
    d.model.k_cache = {static_cast<pyllm::KVType>(k_type), k_cache.data_ptr(), k_row,
                       check_kv_extra(kDC, "k_mu", k_mu, mu_n, d.keep), check_kv_extra(kDC, "k_rot", k_rot, head_dim * head_dim, d.keep)};
    d.model.v_cache = {static_cast<pyllm::KVType>(v_type), v_cache.data_ptr(), v_row,
                       check_kv_extra(kDC, "v_mu", v_mu, mu_n, d.keep), check_kv_extra(kDC, "v_rot", v_rot, head_dim * head_dim, d.keep)};
    d.model.k_cache.scale = check_kv_extra(kDC, "k_scale", k_scale, mu_n, d.keep);
    // the sinks are written by the step (position 0); check_kv_extra checked they are contiguous float32 tensors
    d.model.k_cache.sink = const_cast<float*>(check_kv_extra(kDC, "k_sink", k_sink, mu_n, d.keep));
    d.model.v_cache.sink = const_cast<float*>(check_kv_extra(kDC, "v_sink", v_sink, mu_n, d.keep));
    d.model.layers.resize(n_layer);
    for (int64_t i = 0; i < n_layer; ++i) {
        pyllm::DecodeLayer& L = d.model.layers[i];
        const std::string p = "layer " + std::to_string(i) + " ";
        const Tensor* w = &weights[7 * i];
        const int64_t* t = &qtypes[7 * i];
        L.wq = decode_weight(d, p + "attn_q", w[0], t[0], qd, n_embd);
        L.wk = decode_weight(d, p + "attn_k", w[1], t[1], kvd, n_embd);
        L.wv = decode_weight(d, p + "attn_v", w[2], t[2], kvd, n_embd);
        L.wo = decode_weight(d, p + "attn_output", w[3], t[3], n_embd, qd);
        L.wgate = decode_weight(d, p + "ffn_gate", w[4], t[4], n_ff, n_embd);
        L.wup = decode_weight(d, p + "ffn_up", w[5], t[5], n_ff, n_embd);
        L.wdown = decode_weight(d, p + "ffn_down", w[6], t[6], n_embd, n_ff);
        L.attn_norm = decode_vec(d, p + "attn_norm", attn_norm[i], n_embd);
        L.ffn_norm = decode_vec(d, p + "ffn_norm", ffn_norm[i], n_embd);
        if (bias) {
            L.bq = decode_vec(d, p + "attn_q.bias", q_bias[i], qd);
            L.bk = decode_vec(d, p + "attn_k.bias", k_bias[i], kvd);
            L.bv = decode_vec(d, p + "attn_v.bias", v_bias[i], kvd);
        }
        if (qkn) {
            L.q_norm = decode_vec(d, p + "attn_q_norm", q_norm[i], head_dim);
            L.k_norm = decode_vec(d, p + "attn_k_norm", k_norm[i], head_dim);
        }
        if (!post_attn_norm.empty()) {
            L.post_attn_norm = decode_vec(d, p + "post_attention_norm", post_attn_norm[i], n_embd);
            L.post_ffw_norm = decode_vec(d, p + "post_ffw_norm", post_ffw_norm[i], n_embd);
        }
        L.rope = layer_rope.empty() ? 0 : static_cast<int>(layer_rope[i]);
        L.window = static_cast<int>(std::min<int64_t>(layer_window.empty() ? window : layer_window[i], INT32_MAX));
    }
    d.model.token_embd = decode_weight(d, "token_embd", token_embd, token_embd_qtype, -1, n_embd);
    d.vocab_rows = token_embd.size(0);
    d.model.output = decode_weight(d, "output", output, output_qtype, -1, n_embd);
    TORCH_CHECK_VALUE(output.size(0) <= INT32_MAX, kDC, ": output has too many rows");
    c.n_vocab = static_cast<int>(output.size(0));
    d.model.output_norm = decode_vec(d, "output_norm", output_norm, n_embd);
    d.scratch.resize(d.model);
    return ctx;
}

// logits_out: f32 [n_vocab] (or [1, n_vocab]) filled with the logits of `token` at position `pos`.
void decode_step(DecodeContext& ctx, int64_t token, int64_t pos, const Tensor& logits_out) {
    const pyllm::DecodeConfig& c = ctx.model.cfg;
    TORCH_CHECK_INDEX(token >= 0 && token < ctx.vocab_rows, "decode_step: token ", token, " is out of range for ",
                      ctx.vocab_rows, " embedding rows");
    const int64_t limit = std::min(c.max_seq, c.max_pos);
    TORCH_CHECK_INDEX(pos >= 0 && pos < limit, "decode_step: pos ", pos, " is out of range: the KV cache holds ",
                      c.max_seq, " positions and the rope tables ", c.max_pos);
    TORCH_CHECK_TYPE(logits_out.scalar_type() == at::kFloat, "decode_step: logits_out must be float32, got ",
                     c10::toString(logits_out.scalar_type()));
    TORCH_CHECK_VALUE(logits_out.device().is_cpu() && logits_out.is_contiguous() && logits_out.numel() == c.n_vocab,
                      "decode_step: logits_out must be a contiguous CPU tensor of ", c.n_vocab,
                      " values, got shape ", logits_out.sizes());
    pybind11::gil_scoped_release nogil;
    pyllm::decode_step_cpu(ctx.model, ctx.scratch, token, static_cast<int>(pos), logits_out.data_ptr<float>());
}

// tokens: int64 [M], 1 <= M <= GEMV_MAX_M, at positions pos..pos+M-1; logits_out: f32 [M, n_vocab] (all_logits)
// or [n_vocab] / [1, n_vocab] (the last token's).  K/V are stored at every position.
void decode_steps(DecodeContext& ctx, const Tensor& tokens, int64_t pos, const Tensor& logits_out, bool all_logits) {
    const pyllm::DecodeConfig& c = ctx.model.cfg;
    check_tensor("decode_steps", "tokens", tokens, at::kLong, 1);
    const int64_t M = tokens.size(0);
    TORCH_CHECK_VALUE(M >= 1 && M <= pyllm::GEMV_MAX_M, "decode_steps: ", M, " tokens; it takes 1..",
                      pyllm::GEMV_MAX_M);
    const int64_t* tk = tokens.data_ptr<int64_t>();
    for (int64_t i = 0; i < M; ++i)
        TORCH_CHECK_INDEX(tk[i] >= 0 && tk[i] < ctx.vocab_rows, "decode_steps: token ", tk[i],
                          " is out of range for ", ctx.vocab_rows, " embedding rows");
    const int64_t limit = std::min(c.max_seq, c.max_pos);
    TORCH_CHECK_INDEX(pos >= 0 && pos + M <= limit, "decode_steps: positions ", pos, "..", pos + M - 1,
                      " are out of range: the KV cache holds ", c.max_seq, " positions and the rope tables ", c.max_pos);
    TORCH_CHECK_TYPE(logits_out.scalar_type() == at::kFloat, "decode_steps: logits_out must be float32, got ",
                     c10::toString(logits_out.scalar_type()));
    const int64_t rows = all_logits ? M : 1;
    TORCH_CHECK_VALUE(logits_out.device().is_cpu() && logits_out.is_contiguous() &&
                          logits_out.numel() == rows * c.n_vocab,
                      "decode_steps: logits_out must be a contiguous CPU tensor of ", rows, " x ", c.n_vocab,
                      " values, got shape ", logits_out.sizes());
    pybind11::gil_scoped_release nogil;
    pyllm::decode_steps_cpu(ctx.model, ctx.scratch, tk, static_cast<int>(M), static_cast<int>(pos),
                            logits_out.data_ptr<float>(), all_logits);
}


// One token of each of B sequences, each with its own DecodeContext (its KV cache) built over the same weights:
// tokens/positions int64 [B], 1 <= B <= GEMV_MAX_M; logits_out f32 [B, n_vocab].  Runs on ctxs[0]'s scratch.
void decode_batch(const std::vector<DecodeContext*>& ctxs, const Tensor& tokens, const Tensor& positions,
                  const Tensor& logits_out) {
    const char* fn = "decode_batch";
    const int64_t B = static_cast<int64_t>(ctxs.size());
    TORCH_CHECK_VALUE(B >= 1 && B <= pyllm::GEMV_MAX_M, fn, ": ", B, " sequences; it takes 1..", pyllm::GEMV_MAX_M);
    check_tensor(fn, "tokens", tokens, at::kLong, 1);
    check_tensor(fn, "positions", positions, at::kLong, 1);
    TORCH_CHECK_VALUE(tokens.size(0) == B && positions.size(0) == B, fn, ": tokens and positions need ", B,
                      " entries (one per context), got ", tokens.size(0), " and ", positions.size(0));
    const pyllm::DecodeModel& m0 = ctxs[0]->model;
    const pyllm::DecodeConfig& c = m0.cfg;
    const int64_t* tk = tokens.data_ptr<int64_t>();
    const int64_t* ps = positions.data_ptr<int64_t>();
    std::vector<const pyllm::DecodeModel*> seqs(B);
    int pos[pyllm::GEMV_MAX_M];
    const int64_t limit = std::min(c.max_seq, c.max_pos);
    for (int64_t b = 0; b < B; ++b) {
        TORCH_CHECK_VALUE(ctxs[b] != nullptr, fn, ": context ", b, " is None");
        const pyllm::DecodeModel& m = ctxs[b]->model;
        // Same weights (every matrix), sizes and cache length as context 0: only the caches differ.
        bool same = m.layers.size() == m0.layers.size() && m.token_embd.data == m0.token_embd.data &&
                    m.output.data == m0.output.data && m.cfg.n_layer == c.n_layer && m.cfg.n_vocab == c.n_vocab &&
                    m.cfg.max_seq == c.max_seq && m.cfg.max_pos == c.max_pos && m.cfg.n_kv_head == c.n_kv_head &&
                    m.cfg.head_dim == c.head_dim;
        for (size_t i = 0; same && i < m.layers.size(); ++i) {
            const pyllm::DecodeLayer &L = m.layers[i], &L0 = m0.layers[i];
            same = L.wq.data == L0.wq.data && L.wk.data == L0.wk.data && L.wv.data == L0.wv.data &&
                   L.wo.data == L0.wo.data && L.wgate.data == L0.wgate.data && L.wup.data == L0.wup.data &&
                   L.wdown.data == L0.wdown.data;
        }
        TORCH_CHECK_VALUE(same, fn, ": context ", b, " was built over other weights or sizes than context 0");
        for (int64_t j = 0; j < b; ++j)
            TORCH_CHECK_VALUE(m.k_cache.data != ctxs[j]->model.k_cache.data &&
                                  m.v_cache.data != ctxs[j]->model.v_cache.data,
                              fn, ": contexts ", j, " and ", b, " share a KV cache (one token per sequence)");
        TORCH_CHECK_INDEX(tk[b] >= 0 && tk[b] < ctxs[b]->vocab_rows, fn, ": token ", tk[b], " (row ", b,
                          ") is out of range for ", ctxs[b]->vocab_rows, " embedding rows");
        TORCH_CHECK_INDEX(ps[b] >= 0 && ps[b] < limit, fn, ": pos ", ps[b], " (row ", b,
                          ") is out of range: the KV cache holds ", c.max_seq, " positions and the rope tables ",
                          c.max_pos);
        seqs[b] = &m;
        pos[b] = static_cast<int>(ps[b]);
    }
    TORCH_CHECK_TYPE(logits_out.scalar_type() == at::kFloat, fn, ": logits_out must be float32, got ",
                     c10::toString(logits_out.scalar_type()));
    TORCH_CHECK_VALUE(logits_out.device().is_cpu() && logits_out.is_contiguous() && logits_out.numel() == B * c.n_vocab,
                      fn, ": logits_out must be a contiguous CPU tensor of ", B, " x ", c.n_vocab,
                      " values, got shape ", logits_out.sizes());
    pybind11::gil_scoped_release nogil;
    pyllm::decode_batch_cpu(seqs.data(), ctxs[0]->scratch, tk, pos, static_cast<int>(B), logits_out.data_ptr<float>());
}


// The decode step's attention for tests: q [H, hd] f32 over all S rows of k [Hkv, S, row] / v (types as
// check_kv_rows), scale -> out [H, hd] in the storage basis (no rotation, no means).  scalar: the reference loop.
Tensor kv_attention(const Tensor& q, const Tensor& k, const Tensor& v, int64_t k_type, int64_t v_type, double scale,
                    bool scalar) {
    const char* fn = "kv_attention";
    check_tensor(fn, "q", q, at::kFloat, 2);
    const int64_t H = q.size(0), hd = q.size(1);
    const size_t kr = check_kv_rows(fn, "k", k, k_type, hd, 2), vr = check_kv_rows(fn, "v", v, v_type, hd, 2);
    TORCH_CHECK_VALUE(v.size(0) == k.size(0) && v.size(1) == k.size(1) && k.size(1) >= 1 && H % k.size(0) == 0, fn,
                      ": k/v shapes ", k.sizes(), "/", v.sizes(), " do not fit q ", q.sizes());
    Tensor out = at::empty({H, hd}, q.options());
    const int64_t group = H / k.size(0), S = k.size(1);
    std::vector<float> sc(group * S);
    if (!scalar) {  // the decode step's kernel: one call per KV head for its group of query heads
        for (int64_t kh = 0; kh < k.size(0); ++kh)
            pyllm::kv_attend_group(static_cast<pyllm::KVType>(k_type),
                                   static_cast<const uint8_t*>(k.data_ptr()) + kh * S * kr, kr,
                                   static_cast<pyllm::KVType>(v_type),
                                   static_cast<const uint8_t*>(v.data_ptr()) + kh * S * vr, vr,
                                   q.data_ptr<float>() + kh * group * hd, hd, static_cast<int>(group),
                                   static_cast<int>(hd), static_cast<int>(S), static_cast<float>(scale), sc.data(),
                                   S, out.data_ptr<float>() + kh * group * hd, hd);
        return out;
    }
    for (int64_t h = 0; h < H; ++h) {
        const auto* kp = static_cast<const uint8_t*>(k.data_ptr()) + (h / group) * S * kr;
        const auto* vp = static_cast<const uint8_t*>(v.data_ptr()) + (h / group) * S * vr;
        pyllm::kv_attend_head_scalar(
            static_cast<pyllm::KVType>(k_type), kp, kr, static_cast<pyllm::KVType>(v_type), vp, vr,
            q.data_ptr<float>() + h * hd, static_cast<int>(hd), static_cast<int>(S), static_cast<float>(scale),
            sc.data(), out.data_ptr<float>() + h * hd);
    }
    return out;
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

#ifdef PYLLM_CUDA
namespace pyllm {
void register_cuda(pybind11::module& m);  // csrc/cuda/bindings_cuda.cpp: the cuda_* functions
}
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "pyllm kernels: fused dequantize-in-GEMV (decode), dequantize (+GEMM for prefill)";
    m.def("gemv", &gemv, "y[M,N] = x[M,K] @ W.T, M <= 8, W as raw GGUF blocks u8 [N, row_bytes]; precise_x: "
          "16-bit activations where the type has such a kernel (Q8_0)", py::arg("x"), py::arg("w"), py::arg("qtype"),
          py::arg("out") = py::none(), py::arg("precise_x") = false);
    m.def("gemm", &gemm, "y[M,N] = x[M,K] @ W.T for any M; kernel 'f32' (dequantized tiles + torch GEMM), "
          "'avx512-bf16', 'amx-bf16' or '' (the default, prefill_kernel())", py::arg("x"),
          py::arg("w"), py::arg("qtype"), py::arg("out") = py::none(), py::arg("kernel") = "f32");
    m.def("prefill_kernel", [] { return std::string(pyllm::cpu_prefill_name(pyllm::cpu_prefill_default())); },
          "the GEMM kernel mul_mat uses above the GEMV's rows (PYLLM_ISA can force another)");
    m.def("set_prefill_kernel", [](const std::string& name) {
        pyllm::cpu_set_prefill_kernel(prefill_kernel_named(name));
    }, "prefill GEMM kernel mul_mat uses: 'f32', 'avx512-bf16' or 'amx-bf16' (must be available)");
    m.def("gemm_min_rows", &gemm_min_rows, "smallest x row count mul_mat sends to the GEMM (fewer: 8-row GEMVs)",
          py::arg("precise_x") = false);
    m.def("prefill_kernels", [] {
        std::vector<std::string> r;
        for (auto k : {pyllm::PrefillKernel::F32, pyllm::PrefillKernel::Avx512Bf16, pyllm::PrefillKernel::AmxBf16})
            if (pyllm::cpu_prefill_available(k)) r.push_back(pyllm::cpu_prefill_name(k));
        return r;
    }, "prefill GEMM kernels this machine runs");
    // Without the GIL (ATen needs none, and the tensors are checked before any pointer is used): a prefill's
    // GEMMs take tens of milliseconds, during which a server's event loop must keep streaming other requests.
    m.def("mul_mat", &mul_mat, "y[..., N] = x[..., K] @ W.T: gemv (8-row chunks up to 32 rows), else gemm", py::arg("x"),
          py::arg("w"), py::arg("qtype"), py::arg("out") = py::none(), py::arg("precise_x") = false,
          py::call_guard<py::gil_scoped_release>());
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
          "rows8_qtype(qtype) (the decode step's layout)",
          py::arg("w"), py::arg("qtype"));
    m.def("set_isa", &set_isa, "CPU kernels to use: 'scalar', 'avx2', 'avx512' or 'amx' (default: the best available)");
    m.def("get_isa", [] { return std::string(pyllm::cpu_isa_name(pyllm::cpu_get_isa())); });
    m.def("available_isas", &available_isas);
    m.def("best_isa", [] { return std::string(pyllm::cpu_isa_name(pyllm::cpu_best_isa())); });
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
    py::class_<DecodeContext>(m, "DecodeContext",
                              "llama-family / Gemma 3 model + KV cache + scratch for decode_step (built once per model/cache)")
        .def(py::init(&make_decode_context), py::arg("weights"), py::arg("qtypes"), py::arg("attn_norm"),
             py::arg("ffn_norm"), py::arg("q_bias"), py::arg("k_bias"), py::arg("v_bias"), py::arg("q_norm"),
             py::arg("k_norm"), py::arg("token_embd"), py::arg("token_embd_qtype"), py::arg("output"),
             py::arg("output_qtype"), py::arg("output_norm"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"),
             py::arg("v_cache"), py::arg("n_embd"), py::arg("n_ff"), py::arg("n_head"), py::arg("n_kv_head"),
             py::arg("head_dim"), py::arg("rope_dim"), py::arg("rope_style"), py::arg("eps"), py::arg("scale"),
             py::arg("window"), py::arg("post_attn_norm") = std::vector<Tensor>{},
             py::arg("post_ffw_norm") = std::vector<Tensor>{}, py::arg("embd_scale") = 0.0,
             py::arg("act") = "silu", py::arg("final_softcap") = 0.0, py::arg("cos2") = py::none(),
             py::arg("sin2") = py::none(), py::arg("layer_rope") = std::vector<int64_t>{},
             py::arg("layer_window") = std::vector<int64_t>{}, py::arg("k_type") = -1, py::arg("v_type") = -1,
             py::arg("k_mu") = py::none(), py::arg("v_mu") = py::none(), py::arg("k_rot") = py::none(),
             py::arg("v_rot") = py::none(), py::arg("k_scale") = py::none(), py::arg("k_sink") = py::none(),
             py::arg("v_sink") = py::none())
        .def_property_readonly("n_vocab", [](const DecodeContext& c) { return c.model.cfg.n_vocab; })
        .def_property_readonly("max_seq", [](const DecodeContext& c) { return c.model.cfg.max_seq; });
    m.def("decode_profile", [](bool on) { pyllm::decode_profile_cpu() = pyllm::DecodeProfile{on}; },
          "zero the decode steps' phase timers and switch them on or off", py::arg("on"));
    m.def("decode_profile_read", &decode_profile_read,
          "the decode steps' phase timers since decode_profile(True): ns, weight bytes and calls per phase");
    m.def("decode_step", &decode_step, "one token at pos through all layers (K/V stored at pos) -> logits_out",
          py::arg("ctx"), py::arg("token"), py::arg("pos"), py::arg("logits_out"));
    m.def("decode_steps", &decode_steps,
          "1..GEMV_MAX_M tokens at pos.. through all layers in one pass (K/V stored at each) -> logits_out",
          py::arg("ctx"), py::arg("tokens"), py::arg("pos"), py::arg("logits_out"), py::arg("all_logits") = true);
    m.def("decode_batch", &decode_batch,
          "one token of each of 1..GEMV_MAX_M sequences (own DecodeContext / KV cache each) in one pass -> logits_out",
          py::arg("ctxs"), py::arg("tokens"), py::arg("positions"), py::arg("logits_out"));
    m.def("kv_attention", &kv_attention, "decode attention of q [H, hd] over KV rows k/v [Hkv, S, row] (tests)",
          py::arg("q"), py::arg("k"), py::arg("v"), py::arg("k_type"), py::arg("v_type"), py::arg("scale"),
          py::arg("scalar") = false);
    m.def("kv_store", &kv_store, "x [N, hd] f32 -> N KV cache rows of kv_type, as decode_step stores them",
          py::arg("x"), py::arg("kv_type"));
    m.attr("GEMV_MAX_M") = pyllm::GEMV_MAX_M;
    m.attr("GEMV_CHUNKED_MAX_M") = GEMV_CHUNKED_MAX_M;
#ifdef PYLLM_CUDA
    pyllm::register_cuda(m);
#endif
}
