// One decode token (M = 1) through every layer of a model ArchSpec describes (the llama family, Gemma 3, the
// mixture-of-experts families, gpt-oss) in a single call: the per-token work outside the GEMVs (RMSNorm, bias,
// QK-norm, RoPE, KV store, attention, SiLU, residuals) is a few microseconds of arithmetic, but as ~50 torch ops
// per layer it cost ~25 ms per token in dispatch.  Semantics follow Transformer.forward_on_device
// (pyllm/models/transformer.py) for t == 1; the GEMVs run the same row kernels as the gemv_cpu calls qmatmul makes,
// so only summation order in the small ops differs.  q/k/v and gate/up each go through one gemv_parts_cpu call:
// their shared input is quantized once per format and their rows share one parallel region (a region's start and
// end barrier cost microseconds, ~7 per layer).  The KV cache may hold any KVType per part (K and V apart):
// kv_rows.cpp stores the new row and attention.cpp attends over the stored rows directly (the stage around it:
// decode_attention.cpp).  No torch here: the decode bindings (bindings_decode_context.cpp, bindings_decode.cpp)
// checked every size.
//
// decode_steps_cpu runs M <= GEMV_MAX_M consecutive tokens in one pass (speculative decoding verifies drafted
// tokens this way): each GEMV reads its weights once for all M rows, the rows' attention shares one parallel
// region, and everything else is the one-token code applied row by row, so row m computes what a one-token step
// at pos + m would, bit for bit (the row kernels sum a row in one order whatever M is).
//
// decode_batch_cpu runs one token of each of B <= GEMV_MAX_M independent sequences (a server's concurrent
// requests) the same way: one GEMV pass over the weights for all rows, attention of each row over its own cache.
// The GEMV row kernels give each row the same bits for every M, so a row's logits equal its sequence's one-token
// step's (tests/test_decode_batch.py).
//
// Each of them may run part of a model (kernels.h DecodeRange): a run of layers entered with a hidden state and/or
// left before the head, which is how a model split between two devices runs each side's layers fused
// (pyllm/backends/split.py); the layer loop is the same, so the parts chain to the whole model's bits.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "common/decode.h"
#include "decode_attention.h"
#include "kernels.h"

namespace pyllm {

namespace {

// y = x * rsqrt(mean(x^2) + eps) * w
// The sum of squares in 8 double partial sums: one running sum is a chain of dependent adds, 3x slower at these
// sizes.
inline void rms_norm(const float* x, const float* w, float* y, int n, float eps) {
    double part[8] = {};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; ++l) part[l] += static_cast<double>(x[i + l]) * x[i + l];
    for (; i < n; ++i) part[i & 7] += static_cast<double>(x[i]) * x[i];
    const double ss = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
    const float r = 1.0f / std::sqrt(static_cast<float>(ss / n) + eps);
    for (int i = 0; i < n; ++i) y[i] = x[i] * r * w[i];
}

// y [M, N] += (x [M, K] A^T) bt: a LoRA'd matrix's low-rank term (kernels.h DecodeLora), t: [M, rank] scratch.
// Each row's sums run in one order whatever M is, so a multi-row pass keeps a one-token step's bits.  The axpys
// over y's rows are split among the threads only when the term is large (a 7B model's ffn_down at rank 16 is
// 11008 x 16): a small model's whole term costs less than starting a parallel region.
void add_lora(const DecodeLora& l, const float* x, int M, int K, float* y, int N, float* t) {
    if (l.rank == 0) return;
    const int R = l.rank;
    for (int m = 0; m < M; ++m)
        for (int j = 0; j < R; ++j) t[m * R + j] = dot8(l.a + static_cast<size_t>(j) * K, x + static_cast<size_t>(m) * K, K);
    constexpr int kChunk = 512;  // columns of y per task
    const int chunks = (N + kChunk - 1) / kChunk;
    const size_t work = static_cast<size_t>(M) * R * N;
    const int nt = work >= (size_t{1} << 18) ? std::min(cpu_get_num_threads(), chunks) : 1;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int c = 0; c < chunks; ++c) {
        const int n0 = c * kChunk, n1 = std::min(N, n0 + kChunk);
        for (int m = 0; m < M; ++m) {
            float* ym = y + static_cast<size_t>(m) * N;
            for (int j = 0; j < R; ++j) {
                const float tj = t[m * R + j];
                const float* b = l.bt + static_cast<size_t>(j) * N;
                for (int n = n0; n < n1; ++n) ym[n] += tj * b[n];
            }
        }
    }
}

// gpt-oss's clamped SwiGLU, in place on g (models/transformer.py swiglu_oai, in its order of operations):
// g = min(g, limit), u = clamp(u, -limit, limit), g = (u + 1) * (g * sigmoid(alpha * g)).  std::min / max keep a
// NaN where torch's clamp keeps it (the NaN is their first argument).
inline void swiglu_oai(float* g, const float* u, int n, float alpha, float limit) {
    for (int i = 0; i < n; ++i) {
        const float a = std::min(g[i], limit);
        const float b = std::max(std::min(u[i], limit), -limit);
        g[i] = (b + 1.0f) * (a * (1.0f / (1.0f + std::exp(-(a * alpha)))));
    }
}

inline void rope(float* x, const float* c, const float* s, int rope_dim, bool neox) {
    const int half = rope_dim / 2;
    if (neox) {
        for (int i = 0; i < half; ++i) {
            const float a = x[i], b = x[i + half];
            x[i] = a * c[i] - b * s[i];
            x[i + half] = b * c[i] + a * s[i];
        }
    } else {
        for (int i = 0; i < half; ++i) {
            const float a = x[2 * i], b = x[2 * i + 1];
            x[2 * i] = a * c[i] - b * s[i];
            x[2 * i + 1] = b * c[i] + a * s[i];
        }
    }
}

// The profile's running clock: to(slot) charges the time since the last mark to slot.  Off: one branch.
struct PhaseClock {
    bool on;
    uint64_t last = 0;
    static uint64_t now() {
        return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                         std::chrono::steady_clock::now().time_since_epoch())
                                         .count());
    }
    explicit PhaseClock(bool on_) : on(on_) { if (on) last = now(); }
    void to(uint64_t& slot) {
        if (!on) return;
        const uint64_t t = now();
        slot += t - last;
        last = t;
    }
    void skip() { if (on) last = now(); }  // after a GEMV, which charges its own GemvStats
};

}  // namespace

DecodeProfile& decode_profile_cpu() {
    static DecodeProfile p;
    return p;
}

void DecodeScratch::resize(const DecodeModel& m) {
    const DecodeConfig& c = m.cfg;
    const size_t R = GEMV_MAX_M;  // rows of the multi-token step
    x.assign(R * c.n_embd, 0.f);
    h.assign(R * c.n_embd, 0.f);
    q.assign(R * c.n_head * c.head_dim, 0.f);
    k.assign(R * c.n_kv_head * c.head_dim, 0.f);
    v.assign(R * c.n_kv_head * c.head_dim, 0.f);
    att.assign(R * c.n_head * c.head_dim, 0.f);
    g.assign(R * c.n_ff, 0.f);
    u.assign(R * c.n_ff, 0.f);
    if (c.n_expert) {
        const size_t k = c.n_expert_used;
        moe_logits.assign(R * c.n_expert, 0.f);
        moe_g.assign(R * k * c.n_ff, 0.f);
        moe_u.assign(R * k * c.n_ff, 0.f);
        moe_d.assign(R * k * c.n_embd, 0.f);
        sh_g.assign(R * c.n_ff_shexp, 0.f);
        sh_u.assign(R * c.n_ff_shexp, 0.f);
        sh_d.assign(R * c.n_embd, 0.f);
    }
    // Attention scratch per query head, in a slot per key part of one row, or per half of a multi-row step's rows
    // and per row of a half's pairs (slots sub and sub + 2): those attend at once.
    const size_t slots = std::max(4, KEY_PARTS_MAX);
    scores.assign(slots * c.n_head * c.max_seq, 0.f);
    tmp.assign(slots * std::max(c.n_head, 1) * 2 * c.head_dim, 0.f);
    sink.assign(slots * c.n_head * (c.head_dim + 3), 0.f);
    part_o.assign(R * KEY_PARTS_MAX * c.n_head * c.head_dim, 0.f);
    part_lse.assign(R * KEY_PARTS_MAX * c.n_head, 0.f);
    int rank = std::max(m.token_embd_lora.rank, m.output_lora.rank);
    for (const DecodeLayer& L : m.layers)
        for (const DecodeLora& l : L.lora) rank = std::max(rank, l.rank);
    lora_t.assign(R * rank, 0.f);
}

namespace {

// The mixture-of-experts MLP of layer L on h [M, D] (normed), its output written over h (models/transformer.py
// Transformer.moe is the reference): per row the router's float32 softmax, its n_expert_used largest (the first
// of equal values), renormalised when norm_top_k -- or, with softmax_weight, the largest logits and a softmax over
// those; the selected experts' gate and up in one gemv_each_cpu pass, SwiGLU (or swiglu_oai), their down in
// another, weighted and summed in selection order; plus the shared expert, gated by sigmoid(h . shexp_gate) where
// the layer has that gate.  Where the layer has biases (gpt-oss) the router's is added to its logits and each
// selected expert's to its gate, up and down rows.
void moe_mlp(const DecodeConfig& c, const DecodeLayer& L, DecodeScratch& s, float* h, int M) {
    const int D = c.n_embd, F = c.n_ff, E = c.n_expert, k = c.n_expert_used, FS = c.n_ff_shexp;
    float* const logits = s.moe_logits.data();
    // The router a row at a time: its float32 kernels unroll by rows (dot_float), and each row's route must be its
    // one-token step's bit for bit for a multi-row pass to be exact (backends/cpu.py rows_exact).  It is n_expert
    // rows, so reading it M times costs next to nothing.
    for (int r = 0; r < M; ++r) {
        const GemvPart router{L.router.qtype, L.router.data, L.router.row_bytes, logits + static_cast<size_t>(r) * E, E};
        gemv_parts_cpu(&router, 1, h + static_cast<size_t>(r) * D, 1, D);
    }
    if (L.b_router)
        for (int r = 0; r < M; ++r)
            for (int e = 0; e < E; ++e) logits[static_cast<size_t>(r) * E + e] += L.b_router[e];
    thread_local std::vector<int> ids;  // the step's own buffers, grown once (a step allocates nothing after)
    thread_local std::vector<float> weight;
    thread_local std::vector<GemvPart> parts;
    thread_local std::vector<const float*> xs;
    ids.resize(static_cast<size_t>(M) * k);
    weight.resize(static_cast<size_t>(M) * k);
    parts.resize(static_cast<size_t>(2) * M * k);
    xs.resize(parts.size());
    for (int r = 0; r < M; ++r) {
        float* p = logits + static_cast<size_t>(r) * E;
        if (!c.softmax_weight) {  // the top k of the softmax: the softmax first
            float mx = p[0];
            for (int e = 1; e < E; ++e) mx = std::max(mx, p[e]);
            float sum = 0.f;
            for (int e = 0; e < E; ++e) sum += p[e] = std::exp(p[e] - mx);
            for (int e = 0; e < E; ++e) p[e] /= sum;
        }
        float total = 0.f;
        for (int j = 0; j < k; ++j) {  // k passes over E values: k and E are small
            int best = -1;
            for (int e = 0; e < E; ++e) {
                bool taken = false;
                for (int i = 0; i < j; ++i) taken |= ids[static_cast<size_t>(r) * k + i] == e;
                if (!taken && (best < 0 || p[e] > p[best])) best = e;
            }
            ids[static_cast<size_t>(r) * k + j] = best;
            total += weight[static_cast<size_t>(r) * k + j] = p[best];
        }
        if (c.softmax_weight) {  // the softmax of the k logits, the largest first
            float* wr = weight.data() + static_cast<size_t>(r) * k;
            const float mx = wr[0];
            total = 0.f;
            for (int j = 0; j < k; ++j) total += wr[j] = std::exp(wr[j] - mx);
            for (int j = 0; j < k; ++j) wr[j] /= total;
            total = 1.f;
        }
        if (c.norm_top_k)
            for (int j = 0; j < k; ++j) weight[static_cast<size_t>(r) * k + j] /= total;
    }
    const size_t gate_expert = static_cast<size_t>(F) * L.wgate.row_bytes, up_expert = static_cast<size_t>(F) * L.wup.row_bytes;
    const size_t down_expert = static_cast<size_t>(D) * L.wdown.row_bytes;
    for (int a = 0; a < M * k; ++a) {
        const size_t e = static_cast<size_t>(ids[a]);
        parts[2 * a] = {L.wgate.qtype, L.wgate.data + e * gate_expert, L.wgate.row_bytes,
                        s.moe_g.data() + static_cast<size_t>(a) * F, F};
        parts[2 * a + 1] = {L.wup.qtype, L.wup.data + e * up_expert, L.wup.row_bytes,
                            s.moe_u.data() + static_cast<size_t>(a) * F, F};
        xs[2 * a] = xs[2 * a + 1] = h + static_cast<size_t>(a / k) * D;
    }
    gemv_each_cpu(parts.data(), xs.data(), 2 * M * k, D);
    for (int a = 0; a < M * k; ++a) {
        float* g = s.moe_g.data() + static_cast<size_t>(a) * F;
        float* u = s.moe_u.data() + static_cast<size_t>(a) * F;
        if (L.b_gate_exps) {
            const size_t e = static_cast<size_t>(ids[a]) * F;
            for (int i = 0; i < F; ++i) g[i] += L.b_gate_exps[e + i];
            for (int i = 0; i < F; ++i) u[i] += L.b_up_exps[e + i];
        }
        if (c.swiglu_oai)
            swiglu_oai(g, u, F, c.swiglu_alpha, c.swiglu_limit);
        else
            glu_cpu(c.gelu_tanh, g, u, F);
    }
    for (int a = 0; a < M * k; ++a) {
        parts[a] = {L.wdown.qtype, L.wdown.data + static_cast<size_t>(ids[a]) * down_expert, L.wdown.row_bytes,
                    s.moe_d.data() + static_cast<size_t>(a) * D, D};
        xs[a] = s.moe_g.data() + static_cast<size_t>(a) * F;
    }
    gemv_each_cpu(parts.data(), xs.data(), M * k, F);
    if (L.b_down_exps)
        for (int a = 0; a < M * k; ++a) {
            float* d = s.moe_d.data() + static_cast<size_t>(a) * D;
            const float* b = L.b_down_exps + static_cast<size_t>(ids[a]) * D;
            for (int i = 0; i < D; ++i) d[i] += b[i];
        }
    if (L.wgate_sh.data) {  // the shared expert reads h before h is overwritten below
        const GemvPart gate_up[2] = {{L.wgate_sh.qtype, L.wgate_sh.data, L.wgate_sh.row_bytes, s.sh_g.data(), FS},
                                     {L.wup_sh.qtype, L.wup_sh.data, L.wup_sh.row_bytes, s.sh_u.data(), FS}};
        gemv_parts_cpu(gate_up, 2, h, M, D);
        for (int r = 0; r < M; ++r)
            glu_cpu(c.gelu_tanh, s.sh_g.data() + static_cast<size_t>(r) * FS, s.sh_u.data() + static_cast<size_t>(r) * FS, FS);
        const GemvPart down{L.wdown_sh.qtype, L.wdown_sh.data, L.wdown_sh.row_bytes, s.sh_d.data(), D};
        gemv_parts_cpu(&down, 1, s.sh_g.data(), M, FS);
        if (L.shexp_gate)
            for (int r = 0; r < M; ++r) {
                const float* hr = h + static_cast<size_t>(r) * D;
                float dot = 0.f;
                for (int i = 0; i < D; ++i) dot += hr[i] * L.shexp_gate[i];
                const float gate = 1.f / (1.f + std::exp(-dot));
                for (int i = 0; i < D; ++i) s.sh_d[static_cast<size_t>(r) * D + i] *= gate;
            }
    }
    for (int r = 0; r < M; ++r) {
        float* out = h + static_cast<size_t>(r) * D;
        for (int i = 0; i < D; ++i) {
            float acc = 0.f;
            for (int j = 0; j < k; ++j)
                acc += s.moe_d[(static_cast<size_t>(r) * k + j) * D + i] * weight[static_cast<size_t>(r) * k + j];
            out[i] = L.wgate_sh.data ? acc + s.sh_d[static_cast<size_t>(r) * D + i] : acc;
        }
    }
}

// The rows' shared body: row r is tokens[r] at position pos[r] of the cache caches[r] (K/V parts); the weights
// are read once for all M rows, attention is per row over its own cache.
void decode_rows(const DecodeModel& m, DecodeScratch& s, const int64_t* tokens, int M, const int* pos_of,
                 const KVPart* const* caches, float* logits, bool all_logits, RowArgmax* argmax,
                 const DecodeRange& range) {
    const DecodeConfig& c = m.cfg;
    const int D = c.n_embd, H = c.n_head, Hkv = c.n_kv_head, hd = c.head_dim, F = c.n_ff;
    // Row r of each buffer belongs to tokens[r] at position pos0 + r.
    float* const x0 = s.x.data();   // [M, D]
    float* const h0b = s.h.data();  // [M, D]
    float* const q0 = s.q.data();   // [M, H * hd]
    float* const k0 = s.k.data();   // [M, Hkv * hd]
    float* const v0 = s.v.data();   // [M, Hkv * hd]
    float* const att0 = s.att.data();  // [M, H * hd]
    float* const g0 = s.g.data();   // [M, F]
    float* const u0 = s.u.data();   // [M, F]
    DecodeProfile& prof = decode_profile_cpu();
    PhaseClock clk(prof.on);
    const uint64_t step_t0 = clk.last;
    GemvStats* const st_qkv = prof.on ? &prof.qkv : nullptr;
    GemvStats* const st_wo = prof.on ? &prof.wo : nullptr;
    GemvStats* const st_gate_up = prof.on ? &prof.gate_up : nullptr;
    GemvStats* const st_down = prof.on ? &prof.down : nullptr;
    GemvStats* const st_output = prof.on ? &prof.output : nullptr;

    if (range.x_in)  // the hidden state the layers before this range left (a split model's other side)
        std::memcpy(x0, range.x_in, sizeof(float) * M * D);
    else
        dequantize_rows_cpu(m.token_embd.qtype, m.token_embd.data, m.token_embd.row_bytes, tokens, M, D, x0);
    float* const lora_t = s.lora_t.data();  // [M, rank] A x of the LoRA term being added
    if (const DecodeLora& el = m.token_embd_lora; el.rank && !range.x_in)  // the embedding's term is a row lookup
        for (int r = 0; r < M; ++r)
            for (int j = 0; j < el.rank; ++j) {
                const float a = el.a[tokens[r] * el.rank + j];
                const float* b = el.bt + static_cast<size_t>(j) * D;
                float* xr = x0 + static_cast<size_t>(r) * D;
                for (int n = 0; n < D; ++n) xr[n] += a * b[n];
            }
    if (c.embd_scale != 0.f && !range.x_in)
        for (size_t i = 0; i < static_cast<size_t>(M) * D; ++i) x0[i] *= c.embd_scale;
    const int nt = std::min(cpu_get_num_threads(), H);
    clk.to(prof.embed_ns);

    const int last_layer = range.last_layer < 0 ? c.n_layer : range.last_layer;
    for (int il = range.first_layer; il < last_layer; ++il) {
        const DecodeLayer& L = m.layers[il];
        for (int r = 0; r < M; ++r) rms_norm(x0 + static_cast<size_t>(r) * D, L.attn_norm, h0b + static_cast<size_t>(r) * D, D, c.eps);
        clk.to(prof.norm_ns);
        {
            const GemvPart qkv[3] = {{L.wq.qtype, L.wq.data, L.wq.row_bytes, q0, H * hd},
                                     {L.wk.qtype, L.wk.data, L.wk.row_bytes, k0, Hkv * hd},
                                     {L.wv.qtype, L.wv.data, L.wv.row_bytes, v0, Hkv * hd}};
            gemv_parts_cpu(qkv, 3, h0b, M, D, false, st_qkv);
        }
        clk.skip();
        add_lora(L.lora[0], h0b, M, D, q0, H * hd, lora_t);
        add_lora(L.lora[1], h0b, M, D, k0, Hkv * hd, lora_t);
        add_lora(L.lora[2], h0b, M, D, v0, Hkv * hd, lora_t);
        const size_t lrow = static_cast<size_t>(il) * Hkv;  // first (layer, head) index of this layer
        const size_t n_lh = static_cast<size_t>(c.n_layer) * Hkv;
        // First every row's K/V is stored (row r at pos_of[r]), then every row attends over its cache's keys up to
        // its own position: rows stored after row r lie beyond its keys, or in another sequence's cache.
        for (int r = 0; r < M; ++r) {
            const int pos = pos_of[r];
            const KVPart* const* kvp = caches + 2 * r;  // [K, V] of this row's cache
            float* q = q0 + static_cast<size_t>(r) * H * hd;
            float* k = k0 + static_cast<size_t>(r) * Hkv * hd;
            float* v = v0 + static_cast<size_t>(r) * Hkv * hd;
            if (L.bq) {
                for (int i = 0; i < H * hd; ++i) q[i] += L.bq[i];
                for (int i = 0; i < Hkv * hd; ++i) k[i] += L.bk[i];
                for (int i = 0; i < Hkv * hd; ++i) v[i] += L.bv[i];
            }
            clk.to(prof.norm_ns);
            if (L.q_norm) {
                for (int hh = 0; hh < H; ++hh) rms_norm(q + hh * hd, L.q_norm, q + hh * hd, hd, c.eps);
                for (int hh = 0; hh < Hkv; ++hh) rms_norm(k + hh * hd, L.k_norm, k + hh * hd, hd, c.eps);
            }
            if (L.rope >= 0) {
                const size_t rope_off = static_cast<size_t>(pos) * (c.rope_dim / 2);
                const float* cs = (L.rope ? m.cos2 : m.cos) + rope_off;
                const float* sn = (L.rope ? m.sin2 : m.sin) + rope_off;
                for (int hh = 0; hh < H; ++hh) rope(q + hh * hd, cs, sn, c.rope_dim, c.neox);
                for (int hh = 0; hh < Hkv; ++hh) rope(k + hh * hd, cs, sn, c.rope_dim, c.neox);
            }

            // Store K/V at pos: row (layer, head, pos) of each part, centered ((x - mu)) and rotated (R^T) as the part
            // says -- the same storage basis kv_cache.py writes.
            float* tmp = s.tmp.data();
            for (int hh = 0; hh < Hkv; ++hh) {
                for (int part = 0; part < 2; ++part) {
                    const KVPart& P = *kvp[part];
                    const float* x = (part ? v : k) + static_cast<size_t>(hh) * hd;
                    if (P.mu) {
                        const float* mu = P.mu + (lrow + hh) * hd;
                        for (int d = 0; d < hd; ++d) tmp[d] = x[d] - mu[d];
                        x = tmp;
                    }
                    if (P.scale) {
                        const float* sc = P.scale + (lrow + hh) * hd;
                        for (int d = 0; d < hd; ++d) tmp[d] = x[d] / sc[d];
                        x = tmp;
                    }
                    if (P.rot) {
                        kv_rotate(P.rot, x, tmp + hd, hd, true);
                        x = tmp + hd;
                    }
                    if (P.sink && pos == 0) std::memcpy(P.sink + (lrow + hh) * hd, x, sizeof(float) * hd);
                    kv_store_row(P.type, x, hd, kv_row(P, lrow + hh, n_lh, c.max_seq, pos));
                }
            }

            clk.to(prof.attn_ns);
        }  // rows

        attend_rows(c, L, s, M, pos_of, caches, lrow, nt);
        clk.to(prof.attn_ns);
        const size_t MD = static_cast<size_t>(M) * D;
        {
            const GemvPart wo{L.wo.qtype, L.wo.data, L.wo.row_bytes, h0b, D};
            gemv_parts_cpu(&wo, 1, att0, M, H * hd, false, st_wo);
        }
        clk.skip();
        add_lora(L.lora[3], att0, M, H * hd, h0b, D, lora_t);
        if (L.bo)
            for (int r = 0; r < M; ++r)
                for (int i = 0; i < D; ++i) h0b[static_cast<size_t>(r) * D + i] += L.bo[i];
        if (L.post_attn_norm)
            for (int r = 0; r < M; ++r) rms_norm(h0b + static_cast<size_t>(r) * D, L.post_attn_norm, h0b + static_cast<size_t>(r) * D, D, c.eps);
        for (size_t i = 0; i < MD; ++i) x0[i] += h0b[i];
        for (int r = 0; r < M; ++r) rms_norm(x0 + static_cast<size_t>(r) * D, L.ffn_norm, h0b + static_cast<size_t>(r) * D, D, c.eps);
        clk.to(prof.norm_ns);
        if (c.n_expert) {
            moe_mlp(c, L, s, h0b, M);
            clk.skip();
        } else {
            {
                const GemvPart gate_up[2] = {{L.wgate.qtype, L.wgate.data, L.wgate.row_bytes, g0, F},
                                             {L.wup.qtype, L.wup.data, L.wup.row_bytes, u0, F}};
                gemv_parts_cpu(gate_up, 2, h0b, M, D, false, st_gate_up);
            }
            clk.skip();
            add_lora(L.lora[4], h0b, M, D, g0, F, lora_t);
            add_lora(L.lora[5], h0b, M, D, u0, F, lora_t);
            // Row by row, so that each row's 8-wide part and scalar tail are the same for every M.
            for (int r = 0; r < M; ++r) glu_cpu(c.gelu_tanh, g0 + static_cast<size_t>(r) * F, u0 + static_cast<size_t>(r) * F, F);
            clk.to(prof.act_ns);
            {
                const GemvPart down{L.wdown.qtype, L.wdown.data, L.wdown.row_bytes, h0b, D};
                gemv_parts_cpu(&down, 1, g0, M, F, false, st_down);
            }
            clk.skip();
            add_lora(L.lora[6], g0, M, F, h0b, D, lora_t);
        }
        if (L.post_ffw_norm)
            for (int r = 0; r < M; ++r) rms_norm(h0b + static_cast<size_t>(r) * D, L.post_ffw_norm, h0b + static_cast<size_t>(r) * D, D, c.eps);
        for (size_t i = 0; i < MD; ++i) x0[i] += h0b[i];
        clk.to(prof.norm_ns);
    }
    if (!range.head) {  // every row's hidden state, for the layers after this range
        std::memcpy(logits, x0, sizeof(float) * M * D);
        if (prof.on) {
            prof.steps += 1;
            prof.step_ns += PhaseClock::now() - step_t0;
        }
        return;
    }
    // Only the last row's logits unless all are asked for: the output GEMV is the largest in small models.
    const int r0 = all_logits ? 0 : M - 1, n_out = M - r0;
    for (int r = r0; r < M; ++r) rms_norm(x0 + static_cast<size_t>(r) * D, m.output_norm, h0b + static_cast<size_t>(r) * D, D, c.eps);
    clk.to(prof.norm_ns);
    // the softcap can tie logits the GEMV kept apart, and a LoRA term moves them: then the argmax waits for both
    const bool late_argmax = c.final_softcap != 0.f || m.output_lora.rank != 0;
    {
        const GemvPart out{m.output.qtype, m.output.data, m.output.row_bytes, logits, c.n_vocab};
        // as ops.qmatmul_output
        gemv_parts_cpu(&out, 1, h0b + static_cast<size_t>(r0) * D, n_out, D, /*precise_x=*/true, st_output,
                       late_argmax ? nullptr : argmax);
    }
    clk.skip();
    add_lora(m.output_lora, h0b + static_cast<size_t>(r0) * D, n_out, D, logits, c.n_vocab, lora_t);
    if (c.final_softcap != 0.f) {
        const float cap = c.final_softcap;
        for (size_t i = 0; i < static_cast<size_t>(n_out) * c.n_vocab; ++i) logits[i] = std::tanh(logits[i] / cap) * cap;
    }
    if (argmax && late_argmax)
        for (int r = 0; r < n_out; ++r) argmax[r] = row_argmax_cpu(logits + static_cast<size_t>(r) * c.n_vocab, c.n_vocab);
    clk.to(prof.act_ns);
    if (prof.on) {
        prof.steps += 1;
        prof.step_ns += clk.last - step_t0;
    }
}

}  // namespace

void decode_steps_cpu(const DecodeModel& m, DecodeScratch& s, const int64_t* tokens, int M, int pos0, float* logits,
                      bool all_logits, RowArgmax* argmax, const DecodeRange& range) {
    int pos[GEMV_MAX_M];
    const KVPart* caches[2 * GEMV_MAX_M];
    for (int r = 0; r < M; ++r) {
        pos[r] = pos0 + r;
        caches[2 * r] = &m.k_cache;
        caches[2 * r + 1] = &m.v_cache;
    }
    decode_rows(m, s, tokens, M, pos, caches, logits, all_logits, argmax, range);
}

void decode_batch_cpu(const DecodeModel* const* seqs, DecodeScratch& s, const int64_t* tokens, const int* pos, int B,
                      float* logits, RowArgmax* argmax, const DecodeRange& range) {
    const KVPart* caches[2 * GEMV_MAX_M];
    for (int b = 0; b < B; ++b) {
        caches[2 * b] = &seqs[b]->k_cache;
        caches[2 * b + 1] = &seqs[b]->v_cache;
    }
    decode_rows(*seqs[0], s, tokens, B, pos, caches, logits, true, argmax, range);
}

void decode_step_cpu(const DecodeModel& m, DecodeScratch& s, int64_t token, int pos, float* logits,
                     RowArgmax* argmax) {
    decode_steps_cpu(m, s, &token, 1, pos, logits, true, argmax);
}

// ---- Prefill's row operations: the step's own per-row code over T rows, rows split among the kernel threads --
namespace {
// Row tasks of at least ~32K floats each, so that small calls stay on one thread.
int row_threads(int rows, size_t floats_per_row) {
    const size_t total = floats_per_row * static_cast<size_t>(rows);
    return static_cast<int>(std::clamp<size_t>(total >> 15, 1, std::min<size_t>(rows, cpu_get_num_threads())));
}
}  // namespace

void rms_norm_rows_cpu(const float* x, const float* w, float* y, int rows, int n, float eps) {
    const int nt = row_threads(rows, n);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int r = 0; r < rows; ++r) rms_norm(x + static_cast<size_t>(r) * n, w, y + static_cast<size_t>(r) * n, n, eps);
}

void rope_rows_cpu(float* x, int T, int H, int hd, const float* cos, const float* sin, int rope_dim, bool neox) {
    const int half = rope_dim / 2, nt = row_threads(T, static_cast<size_t>(H) * hd);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int t = 0; t < T; ++t)
        for (int h = 0; h < H; ++h)
            rope(x + (static_cast<size_t>(t) * H + h) * hd, cos + static_cast<size_t>(t) * half,
                 sin + static_cast<size_t>(t) * half, rope_dim, neox);
}

void glu_rows_cpu(bool gelu_tanh, float* g, const float* u, int rows, int n) {
    const int nt = row_threads(rows, n);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int r = 0; r < rows; ++r)
        glu_cpu(gelu_tanh, g + static_cast<size_t>(r) * n, u + static_cast<size_t>(r) * n, static_cast<size_t>(n));
}

}  // namespace pyllm
