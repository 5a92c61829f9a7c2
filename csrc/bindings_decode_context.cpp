// Python bindings that build the C++ decode step's inputs: DecodeArch (pyllm.models.spec.ArchSpec as the step
// reads it), DecodeCachePart (one KV cache part) and DecodeContext (a model's weights, rope tables and cache,
// plus its LoRA terms).  Every tensor is checked here, once, when a context is built (bindings_checks.h); the
// steps (bindings_decode.cpp) then check only what each call is given.
#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "bindings_decode.h"
#include "common/arch.h"

namespace pyllm {
namespace bind {
namespace {

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

}  // namespace

void register_decode_context(py::module& m) {
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
}

}  // namespace bind
}  // namespace pyllm
