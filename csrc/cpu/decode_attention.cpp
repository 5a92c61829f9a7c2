// The decode step's attention stage (decode_attention.h attend_rows): the tasks a pass's rows are split into, the
// key parts of long rows and their merge, exact sink rows, attention sinks, and the storage basis of rotated,
// scaled or centered caches around the kernels (attention.cpp).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "decode_attention.h"

namespace pyllm {

namespace {

// A row's keys: first key j0 (the window's), row 0 kept apart (an exact sink row) from the n stored keys after it,
// which are attended in `parts` parts.
struct RowKeys {
    int j0, r_first, n, parts;
    bool sink;
};
// Parts of at least KEYS_PER_PART keys, at most KEY_PARTS_MAX: enough for a few kv heads to fill the threads,
// few enough that merging costs nothing.
constexpr int KEYS_PER_PART = 256;
inline int key_parts(int n) { return std::min(KEY_PARTS_MAX, std::max(1, n / KEYS_PER_PART)); }
// Part p of n keys starts here (whole 8-key blocks, as the kernels take them); part `parts` ends at n.
inline int part_begin(int n, int parts, int p) {
    return p >= parts ? n : static_cast<int>((static_cast<int64_t>(n) * p / parts) & ~int64_t{7});
}

}  // namespace

void attend_rows(const DecodeConfig& c, const DecodeLayer& L, DecodeScratch& s, int M, const int* pos_of,
                 const KVPart* const* caches, size_t lrow, int nt) {
    const int H = c.n_head, Hkv = c.n_kv_head, hd = c.head_dim;
    const int group = H / Hkv;
    const size_t n_lh = static_cast<size_t>(c.n_layer) * Hkv;
    float* const q0 = s.q.data();      // [M, H * hd]
    float* const k0 = s.k.data();      // [M, Hkv * hd]
    float* const v0 = s.v.data();      // [M, Hkv * hd]
    float* const att0 = s.att.data();  // [M, H * hd]
    // Attention of each query head over keys j0..pos of its kv head, in the storage basis: q R^T for rotated
    // keys (centered keys need nothing: softmax ignores the per-query shift q . mu_k), then o R + mu_v for
    // rotated / centered values.  At pos 0 the Python path attends to the fresh fp32 K/V (not their rounded
    // cache copies): one key, so the output is v itself.
    // A row with many stored keys attends to them in key_parts(n) parts, each normalized on its own with its
    // log-sum-exp and merged afterwards: then one task reads each key and value row of a kv head, and the
    // parts spread a few kv heads over the threads.  The parts depend on the row's key count alone, so a row
    // gets the same bits in a one-token step and in a multi-row pass.
    auto first_key = [&](int pos) { return L.window > 0 ? std::max(0, pos - L.window + 1) : 0; };  // window
    auto row_keys = [&](int r) {
        const int pos = pos_of[r];
        RowKeys k;
        k.j0 = first_key(pos);
        // Exact sink rows: softmax over the stored rows 1..pos and over row 0 (its exact float copy where the
        // part keeps one) separately, then merged by their log-sum-exps -- the same softmax over all keys.
        k.sink = pos > 0 && k.j0 == 0 && (caches[2 * r]->sink || caches[2 * r + 1]->sink);
        k.r_first = k.sink ? 1 : 0;
        k.n = pos + 1 - k.j0 - k.r_first;
        k.parts = pos > 0 ? key_parts(k.n) : 1;
        return k;
    };
    float* const part_o = s.part_o.data();      // [GEMV_MAX_M, KEY_PARTS_MAX, H, hd] a part's output
    float* const part_lse = s.part_lse.data();  // [GEMV_MAX_M, KEY_PARTS_MAX, H] and its log-sum-exp
    auto part_at = [&](int r, int part, int hh) { return (static_cast<size_t>(r) * KEY_PARTS_MAX + part) * H + hh; };
    // Output rows of heads h0..h1-1 (storage basis, `o_stride` apart) -> att in the model's basis.  With
    // attention sinks, lse holds each head's log-sum-exp over its keys' scores (storage basis, h1 - h0 of them):
    // the sink's term in the denominator scales the whole output (values included: the sink carries none) by
    // e^lse / (e^lse + e^sink).  Centered keys scored q . (k - mu_k), so the true scores are the stored ones
    // plus scale * q . mu_k: the sink is compared with lse shifted by that.
    auto finish = [&](int r, int kh, int h0, int h1, const float* og, size_t o_stride, const float* lse) {
        const KVPart& KP = *caches[2 * r];
        const KVPart& VP = *caches[2 * r + 1];
        float* att = att0 + static_cast<size_t>(r) * H * hd;
        for (int hh = h0; hh < h1; ++hh) {
            float* o = att + static_cast<size_t>(hh) * hd;
            if (VP.rot) kv_rotate(VP.rot, og + (hh - h0) * o_stride, o, hd, false);
            if (VP.mu) {
                const float* mu = VP.mu + (lrow + kh) * hd;
                for (int d = 0; d < hd; ++d) o[d] += mu[d];
            }
            if (L.attn_sinks) {
                float total = lse[hh - h0];
                if (KP.mu)
                    total += c.scale * dot8(q0 + (static_cast<size_t>(r) * H + hh) * hd, KP.mu + (lrow + kh) * hd, hd);
                const float keep = 1.0f / (1.0f + std::exp(L.attn_sinks[hh] - total));
                for (int d = 0; d < hd; ++d) o[d] *= keep;
            }
        }
    };
    // Row r, query heads h0..h1-1 of kv head kh, keys of part `part` of the row's parts, on scratch slot `slot`
    // (tasks running at once use distinct (slot, head) regions).  With `defer`, a whole row without an exact
    // sink row is not attended here: its kernel call goes into *defer (true returned) for the caller to run
    // beside another row's (kv_attend_group_pair), then finish(r, kh, h0, h1, o, o_stride, lse) as below.
    auto attend = [&](int r, int kh, int h0, int h1, int part, int slot, KVAttendRows* defer = nullptr) -> bool {
        if (h1 <= h0) return false;
        const int pos = pos_of[r];
        const KVPart& KP = *caches[2 * r];
        const KVPart& VP = *caches[2 * r + 1];
        const float* q = q0 + static_cast<size_t>(r) * H * hd;
        const float* v = v0 + static_cast<size_t>(r) * Hkv * hd;
        float* att = att0 + static_cast<size_t>(r) * H * hd;
        if (pos == 0) {  // one key, the row's own: the output is its value (times the sink's share)
            for (int hh = h0; hh < h1; ++hh) {
                float* o = att + static_cast<size_t>(hh) * hd;
                std::memcpy(o, v + kh * hd, sizeof(float) * hd);
                if (L.attn_sinks) {
                    const float score = c.scale * dot8(q + static_cast<size_t>(hh) * hd,
                                                       k0 + (static_cast<size_t>(r) * Hkv + kh) * hd, hd);
                    const float keep = 1.0f / (1.0f + std::exp(L.attn_sinks[hh] - score));
                    for (int d = 0; d < hd; ++d) o[d] *= keep;
                }
            }
            return false;
        }
        const RowKeys rk = row_keys(r);
        const int b0 = part_begin(rk.n, rk.parts, part), b1 = part_begin(rk.n, rk.parts, part + 1);
        float* const tmp_s = s.tmp.data() + static_cast<size_t>(slot) * H * 2 * hd;
        float* const scores_s = s.scores.data() + static_cast<size_t>(slot) * H * c.max_seq;
        float* const sink_s = s.sink.data() + static_cast<size_t>(slot) * H * (hd + 3);
        float* tq = tmp_s + static_cast<size_t>(h0) * 2 * hd;  // rotated q / pre-rotation o, per head
        const float* qg = q + static_cast<size_t>(h0) * hd;
        size_t q_stride = hd;
        if (KP.rot || KP.scale) {  // (q * s) R^T; the head's second half of tmp holds q * s until o lands there
            for (int hh = h0; hh < h1; ++hh) {
                const float* qh = q + static_cast<size_t>(hh) * hd;
                float* dst = tq + static_cast<size_t>(hh - h0) * 2 * hd;
                if (KP.scale) {
                    const float* sc = KP.scale + (lrow + kh) * hd;
                    for (int d = 0; d < hd; ++d) dst[hd + d] = qh[d] * sc[d];
                    qh = dst + hd;
                }
                if (KP.rot) kv_rotate(KP.rot, qh, dst, hd, true);
                else std::memcpy(dst, qh, sizeof(float) * hd);
            }
            qg = tq;
            q_stride = 2 * static_cast<size_t>(hd);
        }
        const bool whole = rk.parts == 1;
        float* og = !whole ? part_o + part_at(r, part, h0) * hd : VP.rot ? tq + hd : att + static_cast<size_t>(h0) * hd;
        const size_t o_stride = !whole ? hd : VP.rot ? 2 * static_cast<size_t>(hd) : hd;
        const int G = h1 - h0;
        float* sc = scores_s + static_cast<size_t>(h0) * c.max_seq;
        const bool sink = rk.sink && part == 0;
        float* lse = !whole ? part_lse + part_at(r, part, h0)
                     : sink || L.attn_sinks ? sink_s + static_cast<size_t>(H) * hd + h0 : nullptr;
        const int first = rk.j0 + rk.r_first + b0;
        if (defer && whole && !sink) {
            *defer = {kv_rows(KP, lrow + kh, n_lh, c.max_seq, first), kv_rows(VP, lrow + kh, n_lh, c.max_seq, first),
                      qg, q_stride, b1 - b0, sc, og, o_stride, lse};
            return true;
        }
        kv_attend_group(KP.type, kv_rows(KP, lrow + kh, n_lh, c.max_seq, first), VP.type,
                        kv_rows(VP, lrow + kh, n_lh, c.max_seq, first), qg, q_stride, G, hd, b1 - b0, c.scale, sc,
                        c.max_seq, og, o_stride, lse);
        if (sink) {
            float* o0 = sink_s + static_cast<size_t>(h0) * hd;               // [G, hd] row 0's output (its v)
            float* lse0 = sink_s + static_cast<size_t>(H) * hd + H + h0;     // [G]
            float* sc0 = lse0 + H;                                           // [G] scratch
            const bool ks = KP.sink != nullptr, vs = VP.sink != nullptr;
            const size_t f32row = sizeof(float) * hd;
            kv_attend_group(ks ? KVType::F32 : KP.type,
                            ks ? kv_rows_flat(reinterpret_cast<const uint8_t*>(KP.sink + (lrow + kh) * hd), f32row)
                               : kv_rows(KP, lrow + kh, n_lh, c.max_seq, rk.j0),
                            vs ? KVType::F32 : VP.type,
                            vs ? kv_rows_flat(reinterpret_cast<const uint8_t*>(VP.sink + (lrow + kh) * hd), f32row)
                               : kv_rows(VP, lrow + kh, n_lh, c.max_seq, rk.j0),
                            qg, q_stride, G, hd, 1, c.scale, sc0, 1, o0, hd, lse0);
            for (int g = 0; g < G; ++g) {
                const float mx = std::max(lse[g], lse0[g]);
                const float w1 = std::exp(lse[g] - mx), w0 = std::exp(lse0[g] - mx), inv = 1.0f / (w0 + w1);
                float* o = og + g * o_stride;
                const float* a = o0 + static_cast<size_t>(g) * hd;
                for (int d = 0; d < hd; ++d) o[d] = (w1 * o[d] + w0 * a[d]) * inv;
                lse[g] = mx + std::log(w0 + w1);  // the part (or the row) now covers row 0 too
            }
        }
        if (whole) finish(r, kh, h0, h1, og, o_stride, lse);
        return false;
    };
    // A row's parts -> one output per query head of kv head kh: weights e^(lse_p - max), in part order.
    auto merge = [&](int r, int kh) {
        const RowKeys rk = row_keys(r);
        if (pos_of[r] == 0 || rk.parts == 1) return;
        const bool rot = caches[2 * r + 1]->rot != nullptr;
        float* att = att0 + static_cast<size_t>(r) * H * hd;
        for (int hh = kh * group; hh < (kh + 1) * group; ++hh) {
            float w[KEY_PARTS_MAX], mx = -INFINITY, sum = 0.f;
            for (int p = 0; p < rk.parts; ++p) mx = std::max(mx, part_lse[part_at(r, p, hh)]);
            for (int p = 0; p < rk.parts; ++p) sum += w[p] = std::exp(part_lse[part_at(r, p, hh)] - mx);
            const float inv = 1.0f / sum;
            float* dst = rot ? part_o + part_at(r, 0, hh) * hd : att + static_cast<size_t>(hh) * hd;  // in place
            const float* o0 = part_o + part_at(r, 0, hh) * hd;
            for (int d = 0; d < hd; ++d) dst[d] = w[0] * o0[d];
            for (int p = 1; p < rk.parts; ++p) {
                const float* op = part_o + part_at(r, p, hh) * hd;
                for (int d = 0; d < hd; ++d) dst[d] += w[p] * op[d];
            }
            for (int d = 0; d < hd; ++d) dst[d] *= inv;
            const float lse = mx + std::log(sum);  // over every key of the row (the sinks' finish reads it)
            finish(r, kh, hh, hh + 1, dst, hd, &lse);
        }
    };
    // Tasks.  One row: (kv head, key part) with the whole group when the row has several parts, else (kv head,
    // half of its query group) -- both halves then read the head's rows, but keep two cores busy when kv heads
    // are few.  Several rows: (kv head, half of the rows) with the whole group and every key part, each half on
    // its own scratch slot: a task's rows reread its head's keys and values from L1/L2, and the halves weigh
    // the same (parts as tasks here cost 5-10%: measured at 8 rows).  Either way a query's sums are those of a
    // one-row step, and one parallel region serves all rows.
    int max_parts = 1;
    for (int r = 0; r < M; ++r) max_parts = std::max(max_parts, row_keys(r).parts);
    const bool part_tasks = M == 1 && max_parts > 1;
    const int split = M > 1 ? 2 : part_tasks ? max_parts : (group >= 2 ? 2 : 1);
    const int n_tasks = Hkv * split;
    auto task = [&](int t) {
        const int kh = t / split, sub = t % split;
        if (part_tasks) {
            attend(0, kh, kh * group, (kh + 1) * group, sub, sub);
        } else if (M == 1) {
            attend(0, kh, kh * group + group * sub / split, kh * group + group * (sub + 1) / split, 0, 0);
        } else {
            const int r_end = M * (sub + 1) / split;
            for (int r = M * sub / split; r < r_end; ++r) {
                // Two whole rows of one kv type go through the kernels together, their rows interleaved: one
                // thread then has both sequences' rows in flight.  The second's scratch is slot sub + 2.
                const int h0 = kh * group, h1 = (kh + 1) * group;
                if (r + 1 < r_end && row_keys(r).parts == 1 && row_keys(r + 1).parts == 1 &&
                    caches[2 * r]->type == caches[2 * r + 2]->type &&
                    caches[2 * r + 1]->type == caches[2 * r + 3]->type) {
                    KVAttendRows d[2];
                    bool deferred[2];  // else attend ran the row (a first position, an exact sink row)
                    for (int i = 0; i < 2; ++i) deferred[i] = attend(r + i, kh, h0, h1, 0, sub + 2 * i, &d[i]);
                    if (deferred[0] && deferred[1])
                        kv_attend_group_pair(caches[2 * r]->type, caches[2 * r + 1]->type, d[0], d[1], group, hd,
                                             c.scale, c.max_seq);
                    for (int i = 0; i < 2; ++i) {
                        if (!deferred[i]) continue;
                        if (!deferred[1 - i])
                            kv_attend_group(caches[2 * r]->type, d[i].k, caches[2 * r + 1]->type, d[i].v, d[i].q,
                                            d[i].q_stride, group, hd, d[i].n, c.scale, d[i].sc, c.max_seq, d[i].o,
                                            d[i].o_stride, d[i].lse);
                        finish(r + i, kh, h0, h1, d[i].o, d[i].o_stride, d[i].lse);
                    }
                    ++r;
                    continue;
                }
                const int parts = row_keys(r).parts;
                for (int part = 0; part < parts; ++part) attend(r, kh, h0, h1, part, sub);
                merge(r, kh);
            }
        }
    };
    const int n_merges = part_tasks ? Hkv : 0;  // row 0's, once all of its parts are in
    // A parallel region costs a few microseconds: only worth it once the heads have real work.
    int64_t work = 0;
    for (int r = 0; r < M; ++r) work += pos_of[r] + 1 - first_key(pos_of[r]);
    if (nt > 1 && work * hd * H >= 32768 && n_merges > 0) {
#pragma omp parallel num_threads(std::min(nt, n_tasks))
        {
#pragma omp for schedule(static)
            for (int t = 0; t < n_tasks; ++t) task(t);
#pragma omp for schedule(static)
            for (int kh = 0; kh < n_merges; ++kh) merge(0, kh);
        }
    } else if (nt > 1 && work * hd * H >= 32768) {  // no merges: one barrier, not two
#pragma omp parallel for num_threads(std::min(nt, n_tasks)) schedule(static)
        for (int t = 0; t < n_tasks; ++t) task(t);
    } else {
        for (int t = 0; t < n_tasks; ++t) task(t);
        for (int kh = 0; kh < n_merges; ++kh) merge(0, kh);
    }
}

}  // namespace pyllm
