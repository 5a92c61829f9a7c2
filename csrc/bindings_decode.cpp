// Python bindings of the C++ decode step (csrc/cpu/decode_step.cpp): DecodeContext, decode_step(s),
// decode_batch, the KV-row helpers and the step's profile.  Tensors are checked by bindings_checks.h, once, when a
// context is built; the per-token calls check only what they are given.
#include <cmath>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "bindings_checks.h"
#include "common/arch.h"

namespace pyllm {
namespace bind {
namespace {

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
    check_weight(kDC, w, tr, K, name.c_str());
    if (N >= 0)
        PYLLM_CHECK_VALUE(w.size(0) == N, kDC, ": ", name, " has ", w.size(0), " rows, expected ", N);
    check_rows8(kDC, name.c_str(), w, qtype);
    c.keep.push_back(w);
    return {w.data_ptr<uint8_t>(), static_cast<size_t>(w.size(1)), static_cast<QType>(qtype)};
}

const float* decode_vec(DecodeContext& c, const std::string& name, const Tensor& t, int64_t n) {
    check_tensor(kDC, name.c_str(), t, at::kFloat, 1);
    PYLLM_CHECK_VALUE(t.size(0) == n, kDC, ": ", name, " has ", t.size(0), " values, expected ", n);
    c.keep.push_back(t);
    return t.data_ptr<float>();
}

// A KV cache part: kv_type 0 f32, 1 f16, 2 q8_0, 3 q4_0 (pyllm.runtime.kv_cache's storage); t has `lead` dims then
// head_dim values (float types) or head_dim/32 blocks as bytes (uint8).  Returns the row bytes.
size_t check_kv_rows(const char* fn, const char* name, const Tensor& t, int64_t kv_type, int64_t head_dim,
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

const float* check_kv_extra(const char* fn, const char* name, const std::optional<Tensor>& t, int64_t numel,
                            std::vector<Tensor>& keep) {
    if (!t) return nullptr;
    PYLLM_CHECK_TYPE(t->scalar_type() == at::kFloat, fn, ": ", name, " must be float32, got ",
                     c10::toString(t->scalar_type()));
    PYLLM_CHECK_VALUE(t->device().is_cpu() && t->is_contiguous() && t->numel() == numel, fn, ": ", name,
                      " must be a contiguous CPU tensor of ", numel, " values, got shape ", t->sizes());
    keep.push_back(*t);
    return t->data_ptr<float>();
}

// ---- DecodeArch (csrc/common/arch.h): pyllm.models.spec.ArchSpec as the decode steps read it -----------------
// Built by its checked constructor below: every field named as ArchSpec names it, each checked here with an error
// naming it.  The kernels' own copy is DecodeConfig (plus each DecodeLayer's rope table and window), filled from it
// when a context is built; the CUDA row kernels read it as it is (csrc/cuda/bindings_cuda.cpp).
constexpr const char* kDA = "DecodeArch";

DecodeArch make_decode_arch(int64_t n_embd, int64_t n_ff, int64_t n_head, int64_t n_kv_head, int64_t head_dim,
                            int64_t rope_dim, const std::string& rope_style, double rms_eps, double attn_scale,
                            bool qkv_bias, bool qk_norm, bool post_norms, const std::string& act, double embd_scale,
                            double final_softcap, const std::vector<int64_t>& layer_rope,
                            const std::vector<int64_t>& layer_window, int64_t n_expert, int64_t n_expert_used,
                            int64_t n_ff_shexp, bool shexp_gate, bool norm_top_k, bool attn_sinks,
                            bool attn_out_bias, bool expert_bias, const std::string& expert_gating,
                            double swiglu_alpha, double swiglu_limit) {
    DecodeArch a;
    PYLLM_CHECK_VALUE(n_expert >= 0 && n_expert <= 65536, kDA, ": n_expert must be in [0, 65536], got ", n_expert);
    PYLLM_CHECK_VALUE(n_expert ? n_expert_used >= 1 && n_expert_used <= n_expert : n_expert_used == 0, kDA,
                      ": n_expert_used must be in [1, n_expert=", n_expert, "] (0 without experts), got ", n_expert_used);
    PYLLM_CHECK_VALUE(n_ff_shexp >= 0 && n_ff_shexp <= INT32_MAX && (n_expert || !n_ff_shexp), kDA,
                      ": n_ff_shexp must be in [0, 2**31) and 0 without experts, got ", n_ff_shexp);
    PYLLM_CHECK_VALUE(!shexp_gate || n_ff_shexp, kDA, ": shexp_gate needs a shared expert (n_ff_shexp > 0)");
    a.n_expert = n_expert;
    a.n_expert_used = n_expert_used;
    a.n_ff_shexp = n_ff_shexp;
    a.shexp_gate = shexp_gate;
    a.norm_top_k = norm_top_k;
    const std::pair<const char*, int64_t> sizes[] = {{"n_embd", n_embd}, {"n_ff", n_ff}, {"n_head", n_head},
                                                     {"n_kv_head", n_kv_head}, {"head_dim", head_dim}};
    for (const auto& [name, v] : sizes)
        PYLLM_CHECK_VALUE(v >= 1 && v <= INT32_MAX, kDA, ": ", name, " must be in [1, 2**31), got ", v);
    PYLLM_CHECK_VALUE(n_head % n_kv_head == 0, kDA, ": n_head ", n_head, " is not a multiple of n_kv_head ",
                      n_kv_head);
    PYLLM_CHECK_VALUE(rope_dim >= 2 && rope_dim % 2 == 0 && rope_dim <= head_dim, kDA, ": rope_dim ", rope_dim,
                      " must be even and in [2, head_dim=", head_dim, "]");
    PYLLM_CHECK_VALUE(rope_style == "norm" || rope_style == "neox", kDA, ": rope_style must be 'norm' or 'neox', got '",
                      rope_style, "'");
    PYLLM_CHECK_VALUE(act == "silu" || act == "gelu_tanh" || act == "swiglu_oai", kDA,
                      ": act must be 'silu', 'gelu_tanh' or 'swiglu_oai', got '", act, "'");
    PYLLM_CHECK_VALUE(act != "swiglu_oai" || n_expert, kDA, ": act 'swiglu_oai' needs experts (n_expert > 0): the "
                      "routed experts' MLPs take it");
    PYLLM_CHECK_VALUE(expert_gating == "softmax" || expert_gating == "softmax_weight", kDA,
                      ": expert_gating must be 'softmax' or 'softmax_weight', got '", expert_gating, "'");
    PYLLM_CHECK_VALUE(n_expert || (expert_gating == "softmax" && !expert_bias), kDA, ": expert_gating '",
                      expert_gating, "' and expert_bias ", expert_bias, " are expert fields, but n_expert is 0");
    PYLLM_CHECK_VALUE(std::isfinite(swiglu_alpha) && swiglu_alpha > 0, kDA, ": swiglu_alpha must be finite and > 0, "
                      "got ", swiglu_alpha);
    PYLLM_CHECK_VALUE(std::isfinite(swiglu_limit) && swiglu_limit > 0, kDA, ": swiglu_limit must be finite and > 0, "
                      "got ", swiglu_limit);
    PYLLM_CHECK_VALUE(std::isfinite(rms_eps) && rms_eps > 0, kDA, ": rms_eps must be finite and > 0, got ", rms_eps);
    PYLLM_CHECK_VALUE(std::isfinite(attn_scale) && attn_scale > 0, kDA, ": attn_scale must be finite and > 0, got ",
                      attn_scale);
    PYLLM_CHECK_VALUE(std::isfinite(embd_scale) && embd_scale >= 0, kDA, ": embd_scale must be finite and >= 0 (0: "
                      "none), got ", embd_scale);
    PYLLM_CHECK_VALUE(std::isfinite(final_softcap) && final_softcap >= 0, kDA, ": final_softcap must be finite and "
                      ">= 0 (0: none), got ", final_softcap);
    // no layers: a context holding only a split model's embedding and head (csrc/kernels.h DecodeModel)
    PYLLM_CHECK_VALUE(layer_window.size() <= 4096, kDA, ": layer_window must have one entry per layer (0..4096), got ",
                      layer_window.size());
    PYLLM_CHECK_VALUE(layer_rope.size() == layer_window.size(), kDA, ": layer_rope has ", layer_rope.size(),
                      " entries but layer_window ", layer_window.size(), ": one each per layer");
    for (int64_t w : layer_window)
        PYLLM_CHECK_VALUE(w >= 0 && w <= INT32_MAX, kDA, ": layer_window entries must be in [0, 2**31), got ", w);
    for (int64_t r : layer_rope) {
        PYLLM_CHECK_VALUE(r >= -1 && r <= 1, kDA, ": layer_rope entries must be 0 or 1 (two rope tables at most) or "
                          "-1 (no rope), got ", r);
        a.n_rope = std::max(a.n_rope, r + 1);
    }
    a.n_layer = static_cast<int64_t>(layer_window.size());
    a.n_embd = n_embd;
    a.n_ff = n_ff;
    a.n_head = n_head;
    a.n_kv_head = n_kv_head;
    a.head_dim = head_dim;
    a.rope_dim = rope_dim;
    a.neox = rope_style == "neox";
    a.qkv_bias = qkv_bias;
    a.qk_norm = qk_norm;
    a.post_norms = post_norms;
    a.gelu_tanh = act == "gelu_tanh";
    a.swiglu_oai = act == "swiglu_oai";
    a.swiglu_alpha = swiglu_alpha;
    a.swiglu_limit = swiglu_limit;
    a.attn_sinks = attn_sinks;
    a.attn_out_bias = attn_out_bias;
    a.expert_bias = expert_bias;
    a.softmax_weight = expert_gating == "softmax_weight";
    a.rms_eps = rms_eps;
    a.attn_scale = attn_scale;
    a.embd_scale = embd_scale;
    a.final_softcap = final_softcap;
    a.layer_rope = layer_rope;
    a.layer_window = layer_window;
    return a;
}

// A KV cache part as the step reads it (kernels.h KVPart): rows (n_layer, n_kv_head, max_seq, row) of `type`
// (0 f32, 1 f16, 2 q8_0, 3 q4_0; -1: f32 / f16 from the dtype) and the storage transform's tensors, if any.
// Paged (pyllm/runtime/kv_pool.py): data is the pool, (n_blocks, n_layer, n_kv_head, block_rows, row), and
// block_table int32 [max_seq / block_rows] the sequence's blocks (kernels.h KVPart), read live: the Python side
// fills its entries as the sequence grows, and every step checks those it will touch.
struct DecodeCachePart {
    Tensor data;
    int64_t type = -1;
    std::optional<Tensor> mu, rot, scale, sink, block_table;
    int64_t block_rows = 0;
};

// weights / qtypes: 7 per layer in the order q, k, v, output, gate, up, down (uint8 [N, row_bytes]).
// token_embd None: the layers are not the model's first (the passes take a hidden state); output and output_norm
// None: they stop before the head (the passes leave the hidden state).  Either way the context holds a run of a
// model's layers, the arch and the cache the run's own (kernels.h DecodeModel).
// vectors: name -> one float32 tensor per layer: attn_norm and ffn_norm always; attn_q.bias, attn_k.bias and
// attn_v.bias with qkv_bias; attn_q_norm and attn_k_norm with qk_norm; post_attention_norm and post_ffw_norm with
// post_norms; ffn_gate_inp_shexp with shexp_gate; attn_sinks [n_head] with attn_sinks; attn_output.bias with
// attn_out_bias; ffn_gate_inp.bias [n_expert] and the stacked experts' ffn_gate_exps.bias / ffn_up_exps.bias
// [n_expert * n_ff] and ffn_down_exps.bias [n_expert * n_embd] (expert e's at e * rows) with expert_bias (no other
// names).  rope: arch.n_rope (cos, sin) tables [max_pos, rope_dim/2].
std::unique_ptr<DecodeContext> make_decode_context(
    const DecodeArch& arch, const std::vector<Tensor>& weights, const std::vector<int64_t>& qtypes,
    const std::map<std::string, std::vector<Tensor>>& vectors,
    const std::optional<Tensor>& token_embd, int64_t token_embd_qtype, const std::optional<Tensor>& output,
    int64_t output_qtype, const std::optional<Tensor>& output_norm,
    const std::vector<std::pair<Tensor, Tensor>>& rope, const DecodeCachePart& k_part,
    const DecodeCachePart& v_part, const std::vector<Tensor>& moe_weights, const std::vector<int64_t>& moe_qtypes) {
    auto ctx = std::make_unique<DecodeContext>();
    pyllm::DecodeConfig& c = ctx->model.cfg;
    const int64_t n_layer = arch.n_layer, n_embd = arch.n_embd, n_ff = arch.n_ff, head_dim = arch.head_dim;
    const int64_t n_kv_head = arch.n_kv_head, rope_dim = arch.rope_dim;
    PYLLM_CHECK_VALUE(n_layer >= 1 || (token_embd && output), kDC, ": a context without layers holds a model's "
                      "embedding and head: token_embd and output are needed");
    PYLLM_CHECK_VALUE(output.has_value() == output_norm.has_value(), kDC, ": output and output_norm go together (the "
                      "head), got only ", output ? "output" : "output_norm");
    PYLLM_CHECK_VALUE(weights.size() == 7 * static_cast<size_t>(n_layer) && qtypes.size() == weights.size(), kDC,
                      ": expected 7 weights and qtypes per layer (", 7 * n_layer, "), got ", weights.size(), " and ",
                      qtypes.size());
    // The per-layer vectors the arch says the model has, and no others.
    std::vector<std::pair<std::string, int64_t>> want = {{"attn_norm", n_embd}, {"ffn_norm", n_embd}};
    const int64_t qd = arch.n_head * head_dim, kvd = n_kv_head * head_dim;
    if (arch.qkv_bias) want.insert(want.end(), {{"attn_q.bias", qd}, {"attn_k.bias", kvd}, {"attn_v.bias", kvd}});
    if (arch.qk_norm) want.insert(want.end(), {{"attn_q_norm", head_dim}, {"attn_k_norm", head_dim}});
    if (arch.post_norms) want.insert(want.end(), {{"post_attention_norm", n_embd}, {"post_ffw_norm", n_embd}});
    if (arch.shexp_gate) want.push_back({"ffn_gate_inp_shexp", n_embd});
    if (arch.attn_sinks) want.push_back({"attn_sinks", arch.n_head});
    if (arch.attn_out_bias) want.push_back({"attn_output.bias", n_embd});
    if (arch.expert_bias)
        want.insert(want.end(), {{"ffn_gate_inp.bias", arch.n_expert}, {"ffn_gate_exps.bias", arch.n_expert * n_ff},
                                 {"ffn_up_exps.bias", arch.n_expert * n_ff},
                                 {"ffn_down_exps.bias", arch.n_expert * n_embd}});
    const size_t moe_per_layer = arch.n_expert ? (arch.n_ff_shexp ? 4 : 1) : 0;
    PYLLM_CHECK_VALUE(moe_weights.size() == moe_per_layer * n_layer && moe_qtypes.size() == moe_weights.size(), kDC,
                      ": expected ", moe_per_layer, " moe_weights and moe_qtypes per layer (router",
                      moe_per_layer == 4 ? ", shared gate, up, down" : "", "), got ", moe_weights.size(), " and ",
                      moe_qtypes.size());
    for (const auto& [name, n] : want) {
        const auto it = vectors.find(name);
        PYLLM_CHECK_VALUE(it != vectors.end(), kDC, ": vectors has no ", name, ", which the arch needs");
        PYLLM_CHECK_VALUE(it->second.size() == static_cast<size_t>(n_layer), kDC, ": vectors[", name, "] has ",
                          it->second.size(), " tensors, expected one per layer (", n_layer, ")");
    }
    for (const auto& [name, list] : vectors) {
        bool known = false;
        for (const auto& w : want) known = known || w.first == name;
        PYLLM_CHECK_VALUE(known, kDC, ": vectors has ", name, ", which the arch does not use (qkv_bias=", arch.qkv_bias,
                          " qk_norm=", arch.qk_norm, " post_norms=", arch.post_norms, " attn_sinks=", arch.attn_sinks,
                          " attn_out_bias=", arch.attn_out_bias, " expert_bias=", arch.expert_bias, ")");
    }
    PYLLM_CHECK_VALUE(rope.size() == static_cast<size_t>(arch.n_rope), kDC, ": rope has ", rope.size(),
                      " (cos, sin) tables, but the arch's layer_rope uses ", arch.n_rope);

    // KV cache: K and V each (n_layer, n_kv_head, max_seq, row) of its own type (-1: f16/f32 from the dtype).
    const Tensor& k_cache = k_part.data;
    const Tensor& v_cache = v_part.data;
    const int64_t k_type = k_part.type >= 0 ? k_part.type : k_cache.scalar_type() == at::kHalf ? 1 : 0;
    const int64_t v_type = v_part.type >= 0 ? v_part.type : v_cache.scalar_type() == at::kHalf ? 1 : 0;
    const bool paged = k_part.block_table.has_value();
    PYLLM_CHECK_VALUE(paged == v_part.block_table.has_value(), kDC, ": k_cache and v_cache must both be paged or "
                      "neither");
    int64_t max_seq = 0, block_shift = 0;
    if (!paged) {
        check_kv_rows(kDC, "k_cache", k_cache, k_type, head_dim, 3);
        check_kv_rows(kDC, "v_cache", v_cache, v_type, head_dim, 3);
        PYLLM_CHECK_VALUE(k_cache.size(0) == n_layer && k_cache.size(1) == n_kv_head && k_cache.size(2) >= 1, kDC,
                          ": k_cache has shape ", k_cache.sizes(), ", expected (", n_layer, ", ", n_kv_head,
                          ", max_seq, row)");
        PYLLM_CHECK_VALUE(v_cache.sizes().slice(0, 3) == k_cache.sizes().slice(0, 3), kDC, ": v_cache has shape ",
                          v_cache.sizes(), " but k_cache has ", k_cache.sizes());
        max_seq = k_cache.size(2);
    } else {
        check_kv_rows(kDC, "k_cache", k_cache, k_type, head_dim, 4);
        check_kv_rows(kDC, "v_cache", v_cache, v_type, head_dim, 4);
        const int64_t B = k_part.block_rows;
        PYLLM_CHECK_VALUE(B >= 1 && B <= (1 << 20) && (B & (B - 1)) == 0 && v_part.block_rows == B, kDC,
                          ": block_rows must be a power of two, the same for K and V, got ", B, " and ",
                          v_part.block_rows);
        while ((int64_t{1} << block_shift) < B) ++block_shift;
        PYLLM_CHECK_VALUE(k_cache.size(0) >= 1 && k_cache.size(0) <= INT32_MAX && k_cache.size(1) == n_layer &&
                              k_cache.size(2) == n_kv_head && k_cache.size(3) == B,
                          kDC, ": paged k_cache has shape ", k_cache.sizes(), ", expected (n_blocks, ", n_layer, ", ",
                          n_kv_head, ", ", B, ", row)");
        PYLLM_CHECK_VALUE(v_cache.sizes().slice(0, 4) == k_cache.sizes().slice(0, 4), kDC, ": v_cache has shape ",
                          v_cache.sizes(), " but k_cache has ", k_cache.sizes());
        for (const DecodeCachePart* p : {&k_part, &v_part}) {
            const Tensor& t = *p->block_table;
            check_tensor(kDC, "block_table", t, at::kInt, 1);
            PYLLM_CHECK_VALUE(t.size(0) >= 1 && t.size(0) * B <= INT32_MAX && t.size(0) == k_part.block_table->size(0),
                              kDC, ": block_table has ", t.size(0), " entries; K and V need the same number >= 1");
        }
        max_seq = k_part.block_table->size(0) * B;
    }
    PYLLM_CHECK_VALUE(max_seq <= INT32_MAX, kDC, ": max_seq too large");
    for (size_t t = 0; t < rope.size(); ++t) {
        const std::string cn = "rope[" + std::to_string(t) + "] cos", sn = "rope[" + std::to_string(t) + "] sin";
        check_tensor(kDC, cn.c_str(), rope[t].first, at::kFloat, 2);
        check_tensor(kDC, sn.c_str(), rope[t].second, at::kFloat, 2);
        const Tensor& cos = rope[t].first;
        PYLLM_CHECK_VALUE(cos.size(1) == rope_dim / 2 && rope[t].second.sizes() == cos.sizes() && cos.size(0) >= 1 &&
                              cos.sizes() == rope[0].first.sizes(),
                          kDC, ": rope[", t, "] cos/sin have shapes ", cos.sizes(), "/", rope[t].second.sizes(),
                          ", expected equal [max_pos, ", rope_dim / 2, "] (every table alike)");
    }

    c.n_layer = static_cast<int>(n_layer);
    c.n_embd = static_cast<int>(n_embd);
    c.n_ff = static_cast<int>(n_ff);
    c.n_head = static_cast<int>(arch.n_head);
    c.n_kv_head = static_cast<int>(n_kv_head);
    c.head_dim = static_cast<int>(head_dim);
    c.rope_dim = static_cast<int>(rope_dim);
    c.max_pos = static_cast<int>(std::min<int64_t>(rope[0].first.size(0), INT32_MAX));
    c.max_seq = static_cast<int>(max_seq);
    c.gelu_tanh = arch.gelu_tanh;
    c.embd_scale = static_cast<float>(arch.embd_scale);
    c.final_softcap = static_cast<float>(arch.final_softcap);
    c.neox = arch.neox;
    c.eps = static_cast<float>(arch.rms_eps);
    c.scale = static_cast<float>(arch.attn_scale);
    c.n_expert = static_cast<int>(arch.n_expert);
    c.n_expert_used = static_cast<int>(arch.n_expert_used);
    c.n_ff_shexp = static_cast<int>(arch.n_ff_shexp);
    c.norm_top_k = arch.norm_top_k;
    c.softmax_weight = arch.softmax_weight;
    c.swiglu_oai = arch.swiglu_oai;
    c.swiglu_alpha = static_cast<float>(arch.swiglu_alpha);
    c.swiglu_limit = static_cast<float>(arch.swiglu_limit);

    DecodeContext& d = *ctx;
    d.keep.insert(d.keep.end(), {k_cache, v_cache});
    for (const auto& [cos, sin] : rope) d.keep.insert(d.keep.end(), {cos, sin});
    d.model.cos = rope[0].first.data_ptr<float>();
    d.model.sin = rope[0].second.data_ptr<float>();
    if (rope.size() > 1) {
        d.model.cos2 = rope[1].first.data_ptr<float>();
        d.model.sin2 = rope[1].second.data_ptr<float>();
    }
    const int64_t mu_n = n_layer * n_kv_head * head_dim;
    auto part = [&](const char* which, const DecodeCachePart& p, int64_t type, size_t row) {
        const std::string w(which);
        pyllm::KVPart kp{static_cast<pyllm::KVType>(type), p.data.data_ptr(), row,
                         check_kv_extra(kDC, (w + "_mu").c_str(), p.mu, mu_n, d.keep),
                         check_kv_extra(kDC, (w + "_rot").c_str(), p.rot, head_dim * head_dim, d.keep)};
        kp.scale = check_kv_extra(kDC, (w + "_scale").c_str(), p.scale, mu_n, d.keep);
        // the sinks are written by the step (position 0); check_kv_extra checked they are contiguous float32
        kp.sink = const_cast<float*>(check_kv_extra(kDC, (w + "_sink").c_str(), p.sink, mu_n, d.keep));
        if (paged) {
            d.keep.push_back(*p.block_table);
            kp.table = p.block_table->data_ptr<int32_t>();
            kp.block_shift = static_cast<int>(block_shift);
            kp.n_blocks = static_cast<int>(p.data.size(0));
        }
        return kp;
    };
    d.model.k_cache = part("k", k_part, k_type, pyllm::kv_row_bytes(static_cast<pyllm::KVType>(k_type),
                                                                    static_cast<int>(head_dim)));
    d.model.v_cache = part("v", v_part, v_type, pyllm::kv_row_bytes(static_cast<pyllm::KVType>(v_type),
                                                                    static_cast<int>(head_dim)));
    PYLLM_CHECK_VALUE(!v_part.scale, kDC, ": v_scale is not supported (only keys are scaled)");
    d.model.layers.resize(n_layer);
    auto vec = [&](const std::string& name, int64_t i, int64_t n) {
        return decode_vec(d, "layer " + std::to_string(i) + " " + name, vectors.at(name)[i], n);
    };
    for (int64_t i = 0; i < n_layer; ++i) {
        pyllm::DecodeLayer& L = d.model.layers[i];
        const std::string p = "layer " + std::to_string(i) + " ";
        const Tensor* w = &weights[7 * i];
        const int64_t* t = &qtypes[7 * i];
        L.wq = decode_weight(d, p + "attn_q", w[0], t[0], qd, n_embd);
        L.wk = decode_weight(d, p + "attn_k", w[1], t[1], kvd, n_embd);
        L.wv = decode_weight(d, p + "attn_v", w[2], t[2], kvd, n_embd);
        L.wo = decode_weight(d, p + "attn_output", w[3], t[3], n_embd, qd);
        // stacked experts come as [n_expert * rows, row_bytes]: expert e's rows are the e-th slice
        const int64_t ne = std::max<int64_t>(arch.n_expert, 1);
        L.wgate = decode_weight(d, p + "ffn_gate", w[4], t[4], ne * n_ff, n_embd);
        L.wup = decode_weight(d, p + "ffn_up", w[5], t[5], ne * n_ff, n_embd);
        L.wdown = decode_weight(d, p + "ffn_down", w[6], t[6], ne * n_embd, n_ff);
        if (arch.n_expert) {
            const Tensor* mw = &moe_weights[moe_per_layer * i];
            const int64_t* mt = &moe_qtypes[moe_per_layer * i];
            L.router = decode_weight(d, p + "ffn_gate_inp", mw[0], mt[0], arch.n_expert, n_embd);
            if (arch.n_ff_shexp) {
                L.wgate_sh = decode_weight(d, p + "ffn_gate_shexp", mw[1], mt[1], arch.n_ff_shexp, n_embd);
                L.wup_sh = decode_weight(d, p + "ffn_up_shexp", mw[2], mt[2], arch.n_ff_shexp, n_embd);
                L.wdown_sh = decode_weight(d, p + "ffn_down_shexp", mw[3], mt[3], n_embd, arch.n_ff_shexp);
            }
            if (arch.shexp_gate) L.shexp_gate = vec("ffn_gate_inp_shexp", i, n_embd);
            if (arch.expert_bias) {
                L.b_router = vec("ffn_gate_inp.bias", i, arch.n_expert);
                L.b_gate_exps = vec("ffn_gate_exps.bias", i, arch.n_expert * n_ff);
                L.b_up_exps = vec("ffn_up_exps.bias", i, arch.n_expert * n_ff);
                L.b_down_exps = vec("ffn_down_exps.bias", i, arch.n_expert * n_embd);
            }
        }
        if (arch.attn_sinks) L.attn_sinks = vec("attn_sinks", i, arch.n_head);
        if (arch.attn_out_bias) L.bo = vec("attn_output.bias", i, n_embd);
        L.attn_norm = vec("attn_norm", i, n_embd);
        L.ffn_norm = vec("ffn_norm", i, n_embd);
        if (arch.qkv_bias) {
            L.bq = vec("attn_q.bias", i, qd);
            L.bk = vec("attn_k.bias", i, kvd);
            L.bv = vec("attn_v.bias", i, kvd);
        }
        if (arch.qk_norm) {
            L.q_norm = vec("attn_q_norm", i, head_dim);
            L.k_norm = vec("attn_k_norm", i, head_dim);
        }
        if (arch.post_norms) {
            L.post_attn_norm = vec("post_attention_norm", i, n_embd);
            L.post_ffw_norm = vec("post_ffw_norm", i, n_embd);
        }
        L.rope = static_cast<int>(arch.layer_rope[i]);
        L.window = static_cast<int>(arch.layer_window[i]);
    }
    if (token_embd) {
        d.model.token_embd = decode_weight(d, "token_embd", *token_embd, token_embd_qtype, -1, n_embd);
        d.vocab_rows = token_embd->size(0);
    }
    if (output) {
        d.model.output = decode_weight(d, "output", *output, output_qtype, -1, n_embd);
        PYLLM_CHECK_VALUE(output->size(0) <= INT32_MAX, kDC, ": output has too many rows");
        c.n_vocab = static_cast<int>(output->size(0));
        d.model.output_norm = decode_vec(d, "output_norm", *output_norm, n_embd);
    }
    d.scratch.resize(d.model);
    return ctx;
}

// A LoRA term (kernels.h DecodeLora) on one matrix: slot 7 i + j is layer i's matrix j (q, k, v, output, gate, up,
// down), slot 7 n_layer the output projection, 7 n_layer + 1 the token embedding.  a: f32 [rank, K] (the
// embedding's: [vocab rows, rank]), bt: f32 [rank, N], the scales already in bt.
void decode_set_lora(DecodeContext& d, int64_t slot, const Tensor& a, const Tensor& bt) {
    const char* fn = "DecodeContext.set_lora";
    const pyllm::DecodeConfig& c = d.model.cfg;
    const int64_t n_layer = c.n_layer, D = c.n_embd, qd = int64_t{c.n_head} * c.head_dim,
                  kvd = int64_t{c.n_kv_head} * c.head_dim;
    PYLLM_CHECK_VALUE(slot >= 0 && slot <= 7 * n_layer + 1, fn, ": slot ", slot, " is out of range 0..",
                      7 * n_layer + 1);
    check_tensor(fn, "a", a, at::kFloat, 2);
    check_tensor(fn, "bt", bt, at::kFloat, 2);
    const bool embd = slot == 7 * n_layer + 1;
    const int64_t rank = embd ? a.size(1) : a.size(0);
    int64_t K = D, N = D;
    pyllm::DecodeLora* l = nullptr;
    if (slot < 7 * n_layer) {
        const int64_t j = slot % 7;
        const int64_t Ks[7] = {D, D, D, qd, D, D, c.n_ff}, Ns[7] = {qd, kvd, kvd, D, c.n_ff, c.n_ff, D};
        K = Ks[j];
        N = Ns[j];
        l = &d.model.layers[slot / 7].lora[j];
    } else if (!embd) {
        PYLLM_CHECK_VALUE(d.model.output.data, fn, ": slot ", slot, " is the output projection, which this context "
                          "does not hold");
        N = c.n_vocab;
        l = &d.model.output_lora;
    } else {
        PYLLM_CHECK_VALUE(d.model.token_embd.data, fn, ": slot ", slot, " is the token embedding, which this "
                          "context does not hold");
        K = d.vocab_rows;  // a's rows: one per token
        l = &d.model.token_embd_lora;
    }
    PYLLM_CHECK_VALUE(rank >= 1 && rank <= INT32_MAX && bt.size(0) == rank && bt.size(1) == N &&
                          (embd ? a.size(0) : a.size(1)) == K,
                      fn, ": slot ", slot, ": a ", a.sizes(), " and bt ", bt.sizes(), " do not fit a matrix of ", N,
                      " x ", K, " (expected a [", embd ? K : rank, ", ", embd ? rank : K, "], bt [", rank, ", ", N,
                      "])");
    d.keep.insert(d.keep.end(), {a, bt});
    *l = {a.data_ptr<float>(), bt.data_ptr<float>(), static_cast<int>(rank)};
    d.scratch.resize(d.model);
}

// A paged cache's blocks for positions 0..upto-1 must lie in its pool: the Python side fills the table, so each
// step checks the entries it will read or write (upto / block_rows of them: nothing next to the attention).
void check_block_table(const char* fn, const pyllm::DecodeModel& m, int64_t upto) {
    for (const pyllm::KVPart* p : {&m.k_cache, &m.v_cache}) {
        if (!p->table) continue;
        const int64_t n = (upto + (int64_t{1} << p->block_shift) - 1) >> p->block_shift;
        for (int64_t i = 0; i < n; ++i)
            PYLLM_CHECK_INDEX(p->table[i] >= 0 && p->table[i] < p->n_blocks, fn, ": block table entry ", i, " is ",
                              p->table[i], ", outside the pool's ", p->n_blocks, " blocks");
    }
}

// logits_out: f32 [n_vocab] (or [1, n_vocab]) filled with the logits of `token` at position `pos`.  Returns their
// argmax (the first of ties), or -1 where a logit is NaN or infinite.
int64_t decode_step(DecodeContext& ctx, int64_t token, int64_t pos, const Tensor& logits_out) {
    const pyllm::DecodeConfig& c = ctx.model.cfg;
    PYLLM_CHECK_VALUE(ctx.model.token_embd.data && ctx.model.output.data, "decode_step: the context holds part of a "
                      "model (no embedding or no head): decode_steps runs its layers");
    PYLLM_CHECK_INDEX(token >= 0 && token < ctx.vocab_rows, "decode_step: token ", token, " is out of range for ",
                      ctx.vocab_rows, " embedding rows");
    const int64_t limit = std::min(c.max_seq, c.max_pos);
    PYLLM_CHECK_INDEX(pos >= 0 && pos < limit, "decode_step: pos ", pos, " is out of range: the KV cache holds ",
                      c.max_seq, " positions and the rope tables ", c.max_pos);
    PYLLM_CHECK_TYPE(logits_out.scalar_type() == at::kFloat, "decode_step: logits_out must be float32, got ",
                     c10::toString(logits_out.scalar_type()));
    PYLLM_CHECK_VALUE(logits_out.device().is_cpu() && logits_out.is_contiguous() && logits_out.numel() == c.n_vocab,
                      "decode_step: logits_out must be a contiguous CPU tensor of ", c.n_vocab,
                      " values, got shape ", logits_out.sizes());
    check_block_table("decode_step", ctx.model, pos + 1);
    pybind11::gil_scoped_release nogil;
    pyllm::RowArgmax top;
    pyllm::decode_step_cpu(ctx.model, ctx.scratch, token, static_cast<int>(pos), logits_out.data_ptr<float>(), &top);
    return top.index;
}

// tokens: int64 [M], 1 <= M <= GEMV_MAX_M, at positions pos..pos+M-1; logits_out: f32 [M, n_vocab] (all_logits)
// or [n_vocab] / [1, n_vocab] (the last token's).  K/V are stored at every position.  Returns each row of logits'
// argmax, as decode_step's.
// The rows a pass enters with and the part of the model it runs (kernels.h DecodeRange), checked against the
// context: `tokens` int64 [M] (embedded: the context's embedding, from its first layer) or float32 [M, n_embd]
// (the hidden state entering layer first_layer); layers [first_layer, last_layer) (-1: to the last); head: the
// final norm and logits after them (the context's head, after its last layer), else the hidden state.
struct PassRows {
    pyllm::DecodeRange range;
    const int64_t* tokens = nullptr;
    int64_t M = 0;
};

PassRows check_pass(const char* fn, const DecodeContext& ctx, const Tensor& tokens, int64_t first_layer,
                    int64_t last_layer, bool head) {
    const pyllm::DecodeModel& m = ctx.model;
    const int64_t n_layer = m.cfg.n_layer, D = m.cfg.n_embd;
    PassRows p;
    if (last_layer < 0) last_layer = n_layer;
    PYLLM_CHECK_INDEX(first_layer >= 0 && first_layer <= last_layer && last_layer <= n_layer, fn, ": layers ",
                      first_layer, "..", last_layer, " are not a range of the context's ", n_layer);
    PYLLM_CHECK_VALUE(!head || (m.output.data && last_layer == n_layer), fn, ": head=True needs the context's head ",
                      m.output.data ? "after its last layer" : "(it holds none)");
    if (tokens.scalar_type() == at::kFloat) {
        check_tensor(fn, "hidden state", tokens, at::kFloat, 2);
        PYLLM_CHECK_VALUE(tokens.size(1) == D, fn, ": the hidden state has ", tokens.size(1), " values a row, the "
                          "model ", D);
        p.range.x_in = tokens.data_ptr<float>();
    } else {
        check_tensor(fn, "tokens", tokens, at::kLong, 1);
        PYLLM_CHECK_VALUE(m.token_embd.data && first_layer == 0, fn, ": tokens enter at the embedding, ",
                          m.token_embd.data ? "before layer 0" : "which this context does not hold",
                          ": give the hidden state (float32 [rows, n_embd])");
        p.tokens = tokens.data_ptr<int64_t>();
    }
    p.M = tokens.size(0);
    PYLLM_CHECK_VALUE(p.M >= 1 && p.M <= pyllm::GEMV_MAX_M, fn, ": ", p.M, " rows; it takes 1..", pyllm::GEMV_MAX_M);
    for (int64_t i = 0; p.tokens && i < p.M; ++i)
        PYLLM_CHECK_INDEX(p.tokens[i] >= 0 && p.tokens[i] < ctx.vocab_rows, fn, ": token ", p.tokens[i],
                          " is out of range for ", ctx.vocab_rows, " embedding rows");
    p.range.first_layer = static_cast<int>(first_layer);
    p.range.last_layer = static_cast<int>(last_layer);
    p.range.head = head;
    return p;
}

std::vector<int64_t> decode_steps(DecodeContext& ctx, const Tensor& tokens, int64_t pos, const Tensor& logits_out,
                                  bool all_logits, int64_t first_layer, int64_t last_layer, bool head) {
    const pyllm::DecodeConfig& c = ctx.model.cfg;
    const PassRows pass = check_pass("decode_steps", ctx, tokens, first_layer, last_layer, head);
    const int64_t M = pass.M;
    const int64_t* tk = pass.tokens;
    const int64_t limit = std::min(c.max_seq, c.max_pos);
    PYLLM_CHECK_INDEX(pos >= 0 && pos + M <= limit, "decode_steps: positions ", pos, "..", pos + M - 1,
                      " are out of range: the KV cache holds ", c.max_seq, " positions and the rope tables ", c.max_pos);
    PYLLM_CHECK_TYPE(logits_out.scalar_type() == at::kFloat, "decode_steps: logits_out must be float32, got ",
                     c10::toString(logits_out.scalar_type()));
    const int64_t rows = all_logits || !head ? M : 1, width = head ? c.n_vocab : c.n_embd;
    PYLLM_CHECK_VALUE(logits_out.device().is_cpu() && logits_out.is_contiguous() &&
                          logits_out.numel() == rows * width,
                      "decode_steps: logits_out must be a contiguous CPU tensor of ", rows, " x ", width,
                      head ? " values" : " values (the hidden state)", ", got shape ", logits_out.sizes());
    check_block_table("decode_steps", ctx.model, pos + M);
    pyllm::RowArgmax top[pyllm::GEMV_MAX_M];
    {
        pybind11::gil_scoped_release nogil;
        pyllm::decode_steps_cpu(ctx.model, ctx.scratch, tk, static_cast<int>(M), static_cast<int>(pos),
                                logits_out.data_ptr<float>(), all_logits, top, pass.range);
    }
    std::vector<int64_t> out(head ? rows : 0);
    for (size_t r = 0; r < out.size(); ++r) out[r] = top[r].index;
    return out;
}


// Rows of up to GEMV_MAX_M sequences, each with its own DecodeContext (its KV cache) built over the same weights:
// row b is tokens[b] at positions[b] of ctxs[b]'s cache, a sequence's rows consecutive (one token per sequence
// at decode, k + 1 of a speculative check); tokens/positions int64 [B], 1 <= B <= GEMV_MAX_M; logits_out f32
// [B, n_vocab].  Runs on ctxs[0]'s scratch.
std::vector<int64_t> decode_batch(const std::vector<DecodeContext*>& ctxs, const Tensor& tokens,
                                  const Tensor& positions, const Tensor& logits_out, int64_t first_layer,
                                  int64_t last_layer, bool head) {
    const char* fn = "decode_batch";
    const int64_t B = static_cast<int64_t>(ctxs.size());
    PYLLM_CHECK_VALUE(B >= 1 && B <= pyllm::GEMV_MAX_M, fn, ": ", B, " sequences; it takes 1..", pyllm::GEMV_MAX_M);
    PYLLM_CHECK_VALUE(ctxs[0] != nullptr, fn, ": context 0 is None");
    const PassRows pass = check_pass(fn, *ctxs[0], tokens, first_layer, last_layer, head);
    check_tensor(fn, "positions", positions, at::kLong, 1);
    PYLLM_CHECK_VALUE(tokens.size(0) == B && positions.size(0) == B, fn, ": tokens and positions need ", B,
                      " entries (one per context), got ", tokens.size(0), " and ", positions.size(0));
    const pyllm::DecodeModel& m0 = ctxs[0]->model;
    const pyllm::DecodeConfig& c = m0.cfg;
    const int64_t* tk = pass.tokens;
    const int64_t* ps = positions.data_ptr<int64_t>();
    std::vector<const pyllm::DecodeModel*> seqs(B);
    int pos[pyllm::GEMV_MAX_M];
    const int64_t limit = std::min(c.max_seq, c.max_pos);
    for (int64_t b = 0; b < B; ++b) {
        PYLLM_CHECK_VALUE(ctxs[b] != nullptr, fn, ": context ", b, " is None");
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
            for (int j = 0; same && j < 7; ++j) same = L.lora[j].a == L0.lora[j].a && L.lora[j].bt == L0.lora[j].bt;
        }
        same = same && m.output_lora.a == m0.output_lora.a && m.token_embd_lora.a == m0.token_embd_lora.a;
        PYLLM_CHECK_VALUE(same, fn, ": context ", b, " was built over other weights or sizes than context 0");
        // Caches of one pool differ in their block tables (the pool hands a block being written to one sequence).
        // A sequence may have several rows (a speculative check): the same cache in consecutive rows at
        // consecutive positions, each row attending up to its own position as in decode_steps.
        auto shares = [&](int64_t j) {
            const pyllm::DecodeModel& o = ctxs[j]->model;
            return (m.k_cache.data == o.k_cache.data && m.k_cache.table == o.k_cache.table) ||
                   (m.v_cache.data == o.v_cache.data && m.v_cache.table == o.v_cache.table);
        };
        const bool next_row = b > 0 && shares(b - 1) && ps[b] == ps[b - 1] + 1;
        for (int64_t j = 0; j < b; ++j)
            PYLLM_CHECK_VALUE(!shares(j) || next_row, fn, ": contexts ", j, " and ", b,
                              " share a KV cache (a sequence's rows must be consecutive rows at consecutive "
                              "positions)");
        PYLLM_CHECK_INDEX(!tk || (tk[b] >= 0 && tk[b] < ctxs[b]->vocab_rows), fn, ": token ", tk ? tk[b] : 0,
                          " (row ", b, ") is out of range for ", ctxs[b]->vocab_rows, " embedding rows");
        PYLLM_CHECK_INDEX(ps[b] >= 0 && ps[b] < limit, fn, ": pos ", ps[b], " (row ", b,
                          ") is out of range: the KV cache holds ", c.max_seq, " positions and the rope tables ",
                          c.max_pos);
        check_block_table(fn, m, ps[b] + 1);
        seqs[b] = &m;
        pos[b] = static_cast<int>(ps[b]);
    }
    PYLLM_CHECK_TYPE(logits_out.scalar_type() == at::kFloat, fn, ": logits_out must be float32, got ",
                     c10::toString(logits_out.scalar_type()));
    const int64_t width = head ? c.n_vocab : c.n_embd;
    PYLLM_CHECK_VALUE(logits_out.device().is_cpu() && logits_out.is_contiguous() && logits_out.numel() == B * width,
                      fn, ": logits_out must be a contiguous CPU tensor of ", B, " x ", width,
                      head ? " values" : " values (the hidden state)", ", got shape ", logits_out.sizes());
    pyllm::RowArgmax top[pyllm::GEMV_MAX_M];
    {
        pybind11::gil_scoped_release nogil;
        pyllm::decode_batch_cpu(seqs.data(), ctxs[0]->scratch, tk, pos, static_cast<int>(B),
                                logits_out.data_ptr<float>(), top, pass.range);
    }
    std::vector<int64_t> out(head ? B : 0);
    for (size_t b = 0; b < out.size(); ++b) out[b] = top[b].index;
    return out;
}


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

void register_decode(py::module& m) {
    py::class_<DecodeArch>(m, "DecodeArch",
                           "pyllm.models.spec.ArchSpec as the decode step reads it (checked field by field)")
        .def(py::init(&make_decode_arch), py::kw_only(), py::arg("n_embd"), py::arg("n_ff"), py::arg("n_head"),
             py::arg("n_kv_head"), py::arg("head_dim"), py::arg("rope_dim"), py::arg("rope_style"), py::arg("rms_eps"),
             py::arg("attn_scale"), py::arg("qkv_bias"), py::arg("qk_norm"), py::arg("post_norms"), py::arg("act"),
             py::arg("embd_scale"), py::arg("final_softcap"), py::arg("layer_rope"), py::arg("layer_window"),
             py::arg("n_expert") = 0, py::arg("n_expert_used") = 0, py::arg("n_ff_shexp") = 0,
             py::arg("shexp_gate") = false, py::arg("norm_top_k") = false, py::arg("attn_sinks") = false,
             py::arg("attn_out_bias") = false, py::arg("expert_bias") = false, py::arg("expert_gating") = "softmax",
             py::arg("swiglu_alpha") = 1.702, py::arg("swiglu_limit") = 7.0)
        .def_readonly("n_layer", &DecodeArch::n_layer)
        .def_readonly("n_rope", &DecodeArch::n_rope)
        // the fields the CUDA row kernels read (csrc/common/arch.h), readable for their stand-ins and errors
        .def_readonly("n_embd", &DecodeArch::n_embd)
        .def_readonly("n_ff", &DecodeArch::n_ff)
        .def_readonly("n_head", &DecodeArch::n_head)
        .def_readonly("n_kv_head", &DecodeArch::n_kv_head)
        .def_readonly("head_dim", &DecodeArch::head_dim)
        .def_readonly("rope_dim", &DecodeArch::rope_dim)
        .def_readonly("neox", &DecodeArch::neox)
        .def_readonly("qkv_bias", &DecodeArch::qkv_bias)
        .def_readonly("qk_norm", &DecodeArch::qk_norm)
        .def_readonly("gelu_tanh", &DecodeArch::gelu_tanh)
        .def_readonly("swiglu_oai", &DecodeArch::swiglu_oai)
        .def_readonly("attn_sinks", &DecodeArch::attn_sinks)
        .def_readonly("softmax_weight", &DecodeArch::softmax_weight)
        .def_readonly("rms_eps", &DecodeArch::rms_eps)
        .def_readonly("layer_rope", &DecodeArch::layer_rope);
    py::class_<DecodeCachePart>(m, "DecodeCachePart", "one KV cache part (K or V) as the decode step reads it")
        .def(py::init([](Tensor data, int64_t type, std::optional<Tensor> mu, std::optional<Tensor> rot,
                         std::optional<Tensor> scale, std::optional<Tensor> sink, std::optional<Tensor> block_table,
                         int64_t block_rows) {
                 return DecodeCachePart{std::move(data), type,           std::move(mu),          std::move(rot),
                                        std::move(scale), std::move(sink), std::move(block_table), block_rows};
             }),
             py::arg("data"), py::arg("type") = -1, py::arg("mu") = py::none(), py::arg("rot") = py::none(),
             py::arg("scale") = py::none(), py::arg("sink") = py::none(), py::arg("block_table") = py::none(),
             py::arg("block_rows") = 0);
    py::class_<DecodeContext>(m, "DecodeContext", "a model (DecodeArch + weights) + KV cache + scratch for "
                              "decode_step (built once per model and cache)")
        .def(py::init(&make_decode_context), py::arg("arch"), py::arg("weights"), py::arg("qtypes"),
             py::arg("vectors"), py::arg("token_embd"), py::arg("token_embd_qtype"), py::arg("output"),
             py::arg("output_qtype"), py::arg("output_norm"), py::arg("rope"), py::arg("k_cache"), py::arg("v_cache"),
             py::arg("moe_weights") = std::vector<Tensor>{}, py::arg("moe_qtypes") = std::vector<int64_t>{})
        .def("set_lora", &decode_set_lora,
             "adds a LoRA term to one matrix: slot 7*layer + j (q, k, v, output, gate, up, down), 7*n_layer the "
             "output projection, 7*n_layer + 1 the token embedding; a f32 [rank, K] (embedding: [vocab, rank]), "
             "bt f32 [rank, N] with the scales in it",
             py::arg("slot"), py::arg("a"), py::arg("bt"))
        .def_property_readonly("n_vocab", [](const DecodeContext& c) { return c.model.cfg.n_vocab; })
        .def_property_readonly("max_seq", [](const DecodeContext& c) { return c.model.cfg.max_seq; })
        .def_property_readonly("n_layer", [](const DecodeContext& c) { return c.model.cfg.n_layer; })
        .def_property_readonly("n_embd", [](const DecodeContext& c) { return c.model.cfg.n_embd; })
        .def_property_readonly("has_embedding", [](const DecodeContext& c) { return c.model.token_embd.data != nullptr; })
        .def_property_readonly("has_head", [](const DecodeContext& c) { return c.model.output.data != nullptr; });
    m.def("decode_profile", [](bool on) { pyllm::decode_profile_cpu() = pyllm::DecodeProfile{on}; },
          "zero the decode steps' phase timers and switch them on or off", py::arg("on"));
    m.def("decode_profile_read", &decode_profile_read,
          "the decode steps' phase timers since decode_profile(True): ns, weight bytes and calls per phase");
    m.def("decode_step", &decode_step,
          "one token at pos through all layers (K/V stored at pos) -> logits_out; returns its argmax (-1: not finite)",
          py::arg("ctx"), py::arg("token"), py::arg("pos"), py::arg("logits_out"));
    m.def("decode_steps", &decode_steps,
          "1..GEMV_MAX_M tokens at pos.. through all layers in one pass (K/V stored at each) -> logits_out; returns "
          "each row's argmax (-1: not finite).  Part of a model: tokens the hidden state f32 [M, n_embd] entering "
          "layer first_layer, layers up to last_layer (-1: the last), head=False: logits_out [M, n_embd] gets the "
          "hidden state after them (and no argmax is returned)",
          py::arg("ctx"), py::arg("tokens"), py::arg("pos"), py::arg("logits_out"), py::arg("all_logits") = true,
          py::arg("first_layer") = 0, py::arg("last_layer") = -1, py::arg("head") = true);
    m.def("decode_batch", &decode_batch,
          "1..GEMV_MAX_M rows of one or more sequences (own DecodeContext / KV cache each, a sequence's rows "
          "consecutive at consecutive positions) in one pass -> logits_out; "
          "returns each row's argmax (-1: not finite)",
          py::arg("ctxs"), py::arg("tokens"), py::arg("positions"), py::arg("logits_out"), py::arg("first_layer") = 0,
          py::arg("last_layer") = -1, py::arg("head") = true);
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
