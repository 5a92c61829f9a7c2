// Python bindings of the C++ decode step (csrc/cpu/decode_step.cpp) over a DecodeContext
// (bindings_decode_context.cpp): decode_step (one token), decode_steps (up to GEMV_MAX_M tokens of one sequence,
// or a run of layers of a split model), decode_batch (rows of several sequences in one pass) and the step's
// profile.  The context was checked when it was built; each call checks what it is given (tokens, positions, the
// output, the paged cache's block table) before the step runs.
#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "bindings_decode.h"

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

// tokens: int64 [M], 1 <= M <= GEMV_MAX_M, at positions pos..pos+M-1; logits_out: f32 [M, n_vocab] (all_logits)
// or [n_vocab] / [1, n_vocab] (the last token's).  K/V are stored at every position.  Returns each row of logits'
// argmax, as decode_step's.
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

}  // namespace

void register_decode(py::module& m) {
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
}

}  // namespace bind
}  // namespace pyllm
