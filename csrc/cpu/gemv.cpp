// CPU dispatch: picks the row kernel for (ISA, type), prepares the activations once, and splits the output
// rows over OpenMP threads.  Also the bandwidth probe (the ISA selection and thread count: isa.cpp).
//
// The OpenMP runtime is torch's own libgomp (same soname, loaded first), so our threads and torch's share
// one pool; we pass num_threads() per region instead of omp_set_num_threads() so that pyllm's setting does
// not change torch's.
#include <omp.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <vector>

#include "common/decode.h"
#include "cpu_impl.h"
#include "q8k_outliers.h"

namespace pyllm {

using cpu::Act;
using cpu::RowKernel;
using cpu::add_outlier_dots;
using cpu::classify_q8_K;
using cpu::Outliers;
using cpu::q8_K_outliers;
using cpu::q8_K_residual;
using cpu::RowKind;

namespace {

constexpr int kTypeIds = QTYPE_ID_LIMIT;


struct Tables {
    RowKernel k[ISA_COUNT][kTypeIds];    // [Isa][type id]; each ISA falls back per type to the one below it
    RowKernel x16[ISA_COUNT][kTypeIds];  // precise_x kernels, or the plain ones where a type has none
    Tables() {
        for (int t = 0; t < kTypeIds; ++t) {
            const QType q = static_cast<QType>(t);
            k[0][t] = cpu::row_kernel_generic(q);
            if (!k[0][t].available()) k[0][t] = cpu::row_kernel_generic_rows8(q);
            RowKernel s = cpu::row_kernel_avx2_legacy(q);
            if (!s.available()) s = cpu::row_kernel_avx2_kquants(q);
            if (!s.available()) s = cpu::row_kernel_avx2_awq(q);
            k[1][t] = s.available() ? s : k[0][t];
            // Even the table lookup is compiled for AVX-512 (its file's target pragma): ask only a CPU that has it.
            // Elsewhere the row holds the same kernels compiled as AVX2 code, reachable only while the tests
            // emulate AVX-512 (cpu_emulate_avx512).
            const bool native = cpu::avx512_runs_natively();
            const RowKernel v = native ? cpu::row_kernel_avx512(q) : cpu::row_kernel_vnni_emulated(q);
            k[2][t] = k[3][t] = v.available() ? v : k[1][t];
            RowKernel g16 = cpu::row_kernel_generic_x16(q);
            if (!g16.available()) g16 = cpu::row_kernel_generic_rows8_x16(q);
            const RowKernel a16 = cpu::row_kernel_avx2_x16(q);
            x16[0][t] = g16.available() ? g16 : k[0][t];
            x16[1][t] = a16.available() ? a16 : (g16.available() ? g16 : k[1][t]);
            const RowKernel v16 = native ? cpu::row_kernel_avx512_x16(q) : cpu::row_kernel_vnni_emulated_x16(q);
            x16[2][t] = x16[3][t] = v16.available() ? v16 : (a16.available() || g16.available() ? x16[1][t] : k[2][t]);
        }
    }
};

const Tables& tables() {
    static const Tables t;
    return t;
}

// Below this many weight bytes a parallel region costs more than it saves.
constexpr size_t kMinParallelBytes = 64 * 1024;
// The largest piece of one GEMV a thread takes at a time (gemv_parts_cpu).
constexpr size_t kMaxChunkBytes = size_t{1} << 20;

}  // namespace

namespace cpu {
int32_t* thread_scratch_i32(size_t n) {
    thread_local std::vector<int32_t> buf;
    if (buf.size() < n) buf.resize(n);
    return buf.data();
}

void q8_K_rows_with_bsum_pairs(const uint8_t* xa, size_t xs, int M, int nb, const block_q8_K** xr,
                               const int32_t** bw) {
    int32_t* out = thread_scratch_i32(static_cast<size_t>(M) * nb * 4);
    for (int m = 0; m < M; ++m) {
        const block_q8_K* x = xr[m] = reinterpret_cast<const block_q8_K*>(xa + xs * m);
        bw[m] = out + static_cast<size_t>(m) * nb * 4;
        for (int b = 0; b < nb; ++b) {
            const int16_t* s = x[b].bsums;
            for (int t = 0; t < 4; ++t) {
                const uint16_t lo = static_cast<uint16_t>(s[4 * t] + s[4 * t + 1]);
                const uint16_t hi = static_cast<uint16_t>(s[4 * t + 2] + s[4 * t + 3]);
                out[(static_cast<size_t>(m) * nb + b) * 4 + t] =
                    static_cast<int32_t>(lo | (static_cast<uint32_t>(hi) << 16));
            }
        }
    }
}
}  // namespace cpu

bool cpu_type_supported(QType t) {
    const int id = static_cast<int>(t);
    return id >= 0 && id < kTypeIds && tables().k[0][id].available();
}


namespace {

void quantize_q8_K(bool simd, const float* x, int K, block_q8_K* out) {
    simd ? cpu::quantize_q8_K_avx2(x, K, out) : cpu::quantize_q8_K_generic(x, K, out);
}

}  // namespace

namespace {

uint64_t now_ns() {
    return static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
            .count());
}

// x [M, K] prepared in one activation format: [rows, xs] bytes.  With residual (Q8_K rows where some row has
// outliers) each row m is followed by its residual row where needs[m]: row m of x starts at row first[m].
struct Prepared {
    const uint8_t* xa;
    size_t xs;
};

Prepared prepare(Act act, bool simd, const float* x, int M, int K, bool residual, const uint8_t* needs,
                 const int* first, int rows, std::vector<uint8_t>& buf) {
    if (act == Act::F32) return {reinterpret_cast<const uint8_t*>(x), cpu::act_row_bytes(act, K)};
    thread_local std::vector<float> res_buf;
    const size_t xs = cpu::act_row_bytes(act, K);
    if (!residual) rows = M;
    if (buf.size() < xs * rows) buf.resize(xs * rows);
    for (int m = 0; m < M; ++m) {
        uint8_t* dst = buf.data() + xs * (residual ? first[m] : m);
        const float* xm = x + static_cast<size_t>(m) * K;
        if (act == Act::Q8_32) {
            const cpu::Q8Row r = cpu::q8_row(dst, K);
            simd ? cpu::quantize_q8_32_avx2(xm, K, r) : cpu::quantize_q8_32_generic(xm, K, r);
        } else if (act == Act::Q16_32) {
            const cpu::Q16Row r = cpu::q16_row(dst, K);
            simd ? cpu::quantize_q16_32_avx2(xm, K, r) : cpu::quantize_q16_32_generic(xm, K, r);
        } else {
            auto* b = reinterpret_cast<block_q8_K*>(dst);
            quantize_q8_K(simd, xm, K, b);
            if (residual && needs[m]) {
                if (res_buf.size() < static_cast<size_t>(K)) res_buf.resize(K);
                q8_K_residual(xm, b, K, res_buf.data());
                quantize_q8_K(simd, res_buf.data(), K, reinterpret_cast<block_q8_K*>(dst + xs));
            }
        }
    }
    return {buf.data(), xs};
}

constexpr int kMaxParts = 4;
constexpr int kActCount = 4;

// One weight matrix's rows against prepared activations: the unit a GEMV's parallel region hands out in chunks.
struct Job {
    cpu::RowDot fn;
    cpu::RowsDot rows;
    const uint8_t* w;
    size_t row_bytes;
    const uint8_t* xa;
    size_t xs;
    float* y;
    int N;
    QType t;
    const Outliers* outl;  // per activation row m (row first[m] of y), or null: none
    const int* first;
    int M;
    void run(int K, int n0, int n1) const {  // rows n0..n1-1
        if (rows) rows(K, n1 - n0, w + row_bytes * n0, row_bytes, xa, xs, y + n0, N);
        else
            for (int n = n0; n < n1; ++n) fn(K, w + row_bytes * n, xa, xs, y + n, N);
        if (outl)  // the outliers taken out of the Q8_K rows, added back while the chunk's weights are cached
            for (int m = 0; m < M; ++m)
                if (outl[m].n)
                    add_outlier_dots(t, w, row_bytes, K, outl[m], n0, n1, y + static_cast<size_t>(first[m]) * N);
    }
};

// A parallel GEMV's units of work: runs of one job's rows of about equal weight bytes (~8 per thread, at most
// kMaxChunkBytes), each a multiple of that job's kernel row group, taken dynamically so a thread slowed by another
// process does not hold the others up; a run is contiguous rows for the hardware prefetcher.  The cap: the last chunk
// is the other threads' wait, and Gemma 3's 178 MB output projection in 11 MB chunks left a core idle ~0.25 ms per
// token (1 MB: 0.03 ms).  group_of(p): job p's row group (its N is a multiple of it: the bindings check).
struct Chunk {
    int p, n0, n1;
};

template <class GroupOf>
void cut_chunks(std::vector<Chunk>& chunks, const Job* jobs, int n_parts, size_t total_bytes, int nt,
                GroupOf group_of) {
    chunks.clear();
    const size_t chunk_bytes = std::clamp<size_t>(total_bytes / (static_cast<size_t>(nt) * 8), 1, kMaxChunkBytes);
    for (int p = 0; p < n_parts; ++p) {
        const int g = group_of(p);
        const int rows = (static_cast<int>(std::max<size_t>(1, chunk_bytes / jobs[p].row_bytes)) + g - 1) / g * g;
        for (int n0 = 0; n0 < jobs[p].N; n0 += rows) chunks.push_back({p, n0, std::min(jobs[p].N, n0 + rows)});
    }
}

}  // namespace

int row_top_k_cpu(const float* y, int n, int k, int64_t* ids) {
    // The k best so far and the weakest of them (lowest value; of equal ones the highest id, so ties at the k-th
    // value keep the lowest ids).  A later value enters only if strictly above it, so equal later ids never do.
    // Past the first k values a 64-value chunk is looked at only when its max beats the weakest: after a few
    // thousand values that is rare, and the scan runs at the vectorized max's speed (~10x np.partition's).
    uint32_t bad = 0;
#pragma omp simd reduction(| : bad)
    for (int i = 0; i < n; ++i) {
        uint32_t b;
        std::memcpy(&b, &y[i], sizeof b);
        bad |= static_cast<uint32_t>((b & 0x7f800000u) == 0x7f800000u);
    }
    if (bad) return -1;
    std::vector<float> val(y, y + k);
    std::vector<int64_t> id(k);
    for (int j = 0; j < k; ++j) id[j] = j;
    int weak = 0;
    auto find_weak = [&] {
        weak = 0;
        for (int j = 1; j < k; ++j)
            if (val[j] < val[weak] || (val[j] == val[weak] && id[j] > id[weak])) weak = j;
    };
    find_weak();
    auto offer = [&](int i) {
        if (y[i] > val[weak]) {
            val[weak] = y[i];
            id[weak] = i;
            find_weak();
        }
    };
    int i = k;
    for (; i < n && (i & 63); ++i) offer(i);
    for (; i + 64 <= n; i += 64) {
        float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
        for (int j = 0; j < 64; ++j) m = y[i + j] > m ? y[i + j] : m;
        if (m > val[weak])
            for (int j = 0; j < 64; ++j) offer(i + j);
    }
    for (; i < n; ++i) offer(i);
    std::sort(id.begin(), id.end());
    std::copy(id.begin(), id.end(), ids);
    return k;
}

RowArgmax row_argmax_cpu(const float* y, int n) {
    // A max and an OR of exponent tests, then the first copy of the max, 64 values at a time: loops the compiler
    // vectorizes under `omp simd` (a plain float max reduction it keeps scalar: 2 cycles a value, 0.1 ms per
    // thread for Gemma 3's 262k logits).  A row holding a NaN or an infinity only reports that it does.
    float best = -std::numeric_limits<float>::infinity();
    uint32_t bad = 0;
#pragma omp simd reduction(max : best) reduction(| : bad)
    for (int i = 0; i < n; ++i) {
        const float v = y[i];
        uint32_t b;
        std::memcpy(&b, &v, sizeof b);
        bad |= static_cast<uint32_t>((b & 0x7f800000u) == 0x7f800000u);
        best = v > best ? v : best;
    }
    RowArgmax r;
    if (bad) return r;
    int i0 = 0;
    for (; i0 + 64 <= n; i0 += 64) {
        uint32_t hit = 0;
#pragma omp simd reduction(| : hit)
        for (int j = 0; j < 64; ++j) hit |= static_cast<uint32_t>(y[i0 + j] == best);
        if (hit) break;
    }
    while (y[i0] != best) ++i0;  // -0.0 == +0.0: the first of either, as np.argmax
    r.index = i0;
    r.value = best;
    return r;
}

namespace {

// The RowArgmax of a row whose chunks' RowArgmaxes are parts[0..n-1], in the order of their outputs: a later
// chunk wins only with a larger value, so ties keep the first index.
RowArgmax combine_argmax(const RowArgmax* parts, int n, int stride, const int64_t* offsets) {
    RowArgmax r;
    for (int c = 0; c < n; ++c) {
        const RowArgmax& p = parts[static_cast<size_t>(c) * stride];
        if (p.index < 0) return RowArgmax{};
        if (r.index < 0 || p.value > r.value) {
            r.value = p.value;
            r.index = offsets[c] + p.index;
        }
    }
    return r;
}

// Cuts x's M rows into row-dot calls: runs of consecutive rows whose activation rows (two for a Residual row) fit
// GEMV_MAX_M, never across a multiple of `piece` rows.  starts: each run's first row, then M.  kind null: all Plain.
void cut_runs(const RowKind* kind, int M, int piece, std::vector<int>& starts) {
    starts.clear();
    for (int m = 0; m < M;) {
        starts.push_back(m);
        const int end = std::min(M, (m / piece + 1) * piece);
        int rows = 0;
        while (m < end) {
            const int need = 1 + (kind != nullptr && kind[m] == RowKind::Residual);
            if (rows + need > GEMV_MAX_M) break;
            rows += need;
            ++m;
        }
    }
    starts.push_back(M);
}

// One row-dot call made ready: rows m0..m0+M-1 of x (at most GEMV_MAX_M activation rows) against every part, the
// activations prepared once per format the parts need and shared read-only by every thread that runs some rows of
// a part (Job::run).  Its buffers are its own, so threads can make ready the calls of different rows at once.
struct RowsCall {
    int m0 = 0, M = 0;
    bool residual = false;  // some row takes a residual row: Q8_K parts write y_buf, summed into y by finish
    uint8_t needs[GEMV_MAX_M] = {};
    int first[GEMV_MAX_M + 1] = {};  // row m's activation row; first[M] = rows in all
    std::vector<float> dense;        // x with the Sparse rows' outliers zeroed (what their Q8_K rows round)
    std::vector<uint8_t> act_buf[kActCount];
    std::vector<float> y_buf[kMaxParts];
    Job job[kMaxParts];
    size_t total_bytes = 0;
    int total_rows = 0;

    // kind / outl: the row kinds of all of x's rows (classify_q8_K), or null where no part takes Q8_K.
    void ready(const RowKernel* const* kern, const GemvPart* parts, int n_parts, const float* x, int row0, int rows,
               int K, bool simd, const RowKind* kind, const Outliers* outl) {
        m0 = row0;
        M = rows;
        const float* xr = x + static_cast<size_t>(m0) * K;
        residual = false;
        bool sparse = false;
        for (int m = 0; m < M; ++m) {
            const RowKind k = kind ? kind[m0 + m] : RowKind::Plain;
            residual |= (needs[m] = k == RowKind::Residual);
            sparse |= k == RowKind::Sparse;
            first[m + 1] = first[m] + 1 + needs[m];
        }
        const float* xk = xr;  // the rows Q8_K activations are made from
        if (sparse) {
            dense.assign(xr, xr + static_cast<size_t>(M) * K);
            for (int m = 0; m < M; ++m)
                for (int i = 0; i < outl[m0 + m].n; ++i) dense[static_cast<size_t>(m) * K + outl[m0 + m].idx[i]] = 0.f;
            xk = dense.data();
        }
        bool have[kActCount] = {};
        Prepared prep[kActCount] = {};
        total_bytes = 0;
        total_rows = 0;
        for (int p = 0; p < n_parts; ++p) {
            const bool q8k = kern[p]->act == Act::Q8_K;
            const int a = static_cast<int>(kern[p]->act);
            const bool res = residual && q8k;  // only Q8_K rows take a residual row, or lose their outliers
            if (!have[a]) {
                prep[a] = prepare(kern[p]->act, simd, q8k ? xk : xr, M, K, res, needs, first, first[M], act_buf[a]);
                have[a] = true;
            }
            const GemvPart& P = parts[p];
            float* yo = P.y + static_cast<size_t>(m0) * P.N;
            if (res) {
                const size_t n = static_cast<size_t>(first[M]) * P.N;
                if (y_buf[p].size() < n) y_buf[p].resize(n);
                yo = y_buf[p].data();
            }
            const int fm = (res ? first[M] : M) - 1;
            job[p] = {kern[p]->fn[fm], kern[p]->rows[fm], P.w, P.row_bytes, prep[a].xa, prep[a].xs, yo, P.N,
                      P.t, sparse && q8k ? outl + m0 : nullptr, first, M};
            total_bytes += P.row_bytes * static_cast<size_t>(P.N);
            total_rows += P.N;
        }
    }

    // y where a part's rows went to y_buf: each row plus its residual row.
    void finish(const RowKernel* const* kern, const GemvPart* parts, int n_parts) const {
        if (!residual) return;
        for (int p = 0; p < n_parts; ++p) {
            if (kern[p]->act != Act::Q8_K) continue;
            const int N = parts[p].N;
            for (int m = 0; m < M; ++m) {
                const float* a = job[p].y + static_cast<size_t>(first[m]) * N;
                float* y = parts[p].y + static_cast<size_t>(m0 + m) * N;
                if (needs[m]) {
                    for (int n = 0; n < N; ++n) y[n] = a[n] + a[N + n];
                } else {
                    std::copy(a, a + N, y);
                }
            }
        }
    }
};

// The parts' row kernels for this ISA (the precise_x ones where asked); whether any takes Q8_K activations.
bool row_kernels(const GemvPart* parts, int n_parts, bool precise_x, const RowKernel** kern) {
    const Tables& tab = tables();
    const Isa isa = cpu_get_isa();
    bool uses_q8_K = false;
    for (int p = 0; p < n_parts; ++p) {
        kern[p] = &(precise_x ? tab.x16 : tab.k)[static_cast<int>(isa)][static_cast<int>(parts[p].t)];
        uses_q8_K |= kern[p]->act == Act::Q8_K;
    }
    return uses_q8_K;
}

// Runs a ready call: all parts' rows in one parallel region split by weight bytes (cut_chunks), then finish.
void run_rows_call(const RowsCall& call, const RowKernel* const* kern, const GemvPart* parts, int n_parts, int K,
                   GemvStats* stats, uint64_t t0, RowArgmax* argmax) {
    const Job* const job = call.job;
    const int M = call.M;
    const uint64_t t1 = stats ? now_ns() : 0;
    int nt = std::min(cpu_get_num_threads(), call.total_rows);
    if (call.total_bytes < kMinParallelBytes) nt = 1;
    // Part 0's rows of y are final as each chunk ends unless its residual rows are added after the region.
    const bool argmax_in_chunks = argmax != nullptr && !(call.residual && kern[0]->act == Act::Q8_K);
    uint64_t busy = 0;
    if (nt <= 1) {
        for (int p = 0; p < n_parts; ++p) job[p].run(K, 0, job[p].N);
        busy = stats ? now_ns() - t1 : 0;
    } else {
        thread_local std::vector<Chunk> chunks;
        cut_chunks(chunks, job, n_parts, call.total_bytes, nt, [&](int p) { return kern[p]->group; });
        const int n_chunks = static_cast<int>(chunks.size());
        const Chunk* const ck = chunks.data();  // chunks is this thread's: the team reads it through a pointer
        const bool timed = stats != nullptr;
        // Part 0's chunks come first, in row order: chunk c's RowArgmax of row m at chunk_max[c * M + m].
        thread_local std::vector<RowArgmax> chunk_max;
        thread_local std::vector<int64_t> chunk_n0;
        int n_chunks0 = 0;
        if (argmax_in_chunks) {
            while (n_chunks0 < n_chunks && ck[n_chunks0].p == 0) ++n_chunks0;
            chunk_max.resize(static_cast<size_t>(n_chunks0) * M);
            chunk_n0.resize(n_chunks0);
            for (int c = 0; c < n_chunks0; ++c) chunk_n0[c] = ck[c].n0;
        }
        RowArgmax* const cmax = chunk_max.data();
#pragma omp parallel num_threads(nt) reduction(+ : busy)
        {
            const uint64_t b0 = timed ? now_ns() : 0;
#pragma omp for schedule(dynamic, 1) nowait
            for (int c = 0; c < n_chunks; ++c) {
                const Chunk ch = ck[c];
                job[ch.p].run(K, ch.n0, ch.n1);
                if (c < n_chunks0)
                    for (int m = 0; m < M; ++m)
                        cmax[static_cast<size_t>(c) * M + m] =
                            row_argmax_cpu(job[0].y + static_cast<size_t>(m) * job[0].N + ch.n0, ch.n1 - ch.n0);
            }
            if (timed) busy += now_ns() - b0;
        }
        if (argmax_in_chunks)
            for (int m = 0; m < M; ++m) argmax[m] = combine_argmax(cmax + m, n_chunks0, M, chunk_n0.data());
    }
    const uint64_t t2 = stats ? now_ns() : 0;
    call.finish(kern, parts, n_parts);
    if (argmax != nullptr && (nt <= 1 || !argmax_in_chunks))
        for (int m = 0; m < M; ++m)
            argmax[m] = row_argmax_cpu(parts[0].y + static_cast<size_t>(call.m0 + m) * parts[0].N, parts[0].N);
    if (stats) {
        stats->calls += 1;
        stats->bytes += call.total_bytes;
        stats->quant_ns += t1 - t0 + (now_ns() - t2);
        stats->wall_ns += t2 - t1;
        stats->busy_ns += busy;
        stats->thread_ns += static_cast<uint64_t>(nt) * (t2 - t1);
    }
}

// A piece of a GEMV over many rows of x (gemv_chunks_cpu): rows n0..n1-1 of part p against the row-dot calls
// r0..r1-1.  A tile's weights (~kTileBytes) stay in L1/L2 while those calls' activations pass them, so a weight
// byte comes from memory once per kTileRuns calls (128 rows of x), not once per call.
struct Tile {
    int p, n0, n1, r0, r1;
};

// Measured on Zen 3, 2 threads, M = 512, SmolLM2's and Qwen2.5's matrices: 16-64 KiB x 8-16 calls within ~10%
// of each other, 32 KiB x 16 the fastest; 128 KiB or 4 calls 20-40% slower.
constexpr size_t kTileBytes = 32 * 1024;
constexpr int kTileRuns = 16;

// Tiles covering every part's rows against n_runs calls: weight rows in runs of ~kTileBytes (a multiple of the
// kernel's row group), calls kTileRuns at a time, or fewer until there are 8 tiles per thread to balance.
void cut_tiles(std::vector<Tile>& tiles, const GemvPart* parts, int n_parts, const RowKernel* const* kern,
               int n_runs, int nt) {
    int rows[kMaxParts];
    size_t n_cols = 0;
    for (int p = 0; p < n_parts; ++p) {
        const int g = kern[p]->group;
        rows[p] = (static_cast<int>(std::max<size_t>(1, kTileBytes / parts[p].row_bytes)) + g - 1) / g * g;
        n_cols += (parts[p].N + rows[p] - 1) / rows[p];
    }
    int per = std::min(n_runs, kTileRuns);
    while (per > 1 && n_cols * ((n_runs + per - 1) / per) < static_cast<size_t>(8) * nt) per = (per + 1) / 2;
    tiles.clear();
    for (int p = 0; p < n_parts; ++p)
        for (int n0 = 0; n0 < parts[p].N; n0 += rows[p])
            for (int r0 = 0; r0 < n_runs; r0 += per)
                tiles.push_back({p, n0, std::min(parts[p].N, n0 + rows[p]), r0, std::min(n_runs, r0 + per)});
}

}  // namespace

void gemv_parts_cpu(const GemvPart* parts, int n_parts, const float* x, int M, int K, bool precise_x,
                    GemvStats* stats, RowArgmax* argmax) {
    const uint64_t t0 = stats ? now_ns() : 0;
    if (n_parts > kMaxParts) {  // never from the decode step; keeps the fixed-size tables below honest
        for (int p = 0; p < n_parts; p += kMaxParts)
            gemv_parts_cpu(parts + p, std::min(kMaxParts, n_parts - p), x, M, K, precise_x, stats);
        return;
    }
    const RowKernel* kern[kMaxParts];
    const bool uses_q8_K = row_kernels(parts, n_parts, precise_x, kern);
    // Which rows carry outliers, and which of them take a residual row, is decided per row: the row kernels give a
    // row the same bits whatever the other rows of the call, so a row's result never depends on them (verifying
    // k drafted tokens in one call gives each the logits it gets alone: speculative decoding's greedy equality).
    // (An all-zero residual row for the others would add exactly 0, at the cost of a whole row's dot.)
    RowKind kind[GEMV_MAX_M];
    Outliers outl[GEMV_MAX_M];
    if (uses_q8_K) classify_q8_K(x, M, K, kind, outl);
    int starts[GEMV_MAX_M + 1], n_runs = 0;
    {
        thread_local std::vector<int> cuts;
        cut_runs(uses_q8_K ? kind : nullptr, M, GEMV_MAX_M, cuts);
        n_runs = static_cast<int>(cuts.size()) - 1;
        std::copy(cuts.begin(), cuts.end(), starts);
    }
    thread_local RowsCall call;
    for (int r = 0; r < n_runs; ++r) {  // one run unless residual rows overflow one row-dot call
        call.ready(kern, parts, n_parts, x, starts[r], starts[r + 1] - starts[r], K, cpu_isa_simd(cpu_get_isa()),
                   uses_q8_K ? kind : nullptr, outl);
        run_rows_call(call, kern, parts, n_parts, K, stats, r == 0 ? t0 : (stats ? now_ns() : 0),
                      argmax ? argmax + starts[r] : nullptr);
    }
}

void gemv_chunks_cpu(const GemvPart* parts, int n_parts, const float* x, int M, int K, bool precise_x) {
    if (n_parts > kMaxParts) {
        for (int p = 0; p < n_parts; p += kMaxParts)
            gemv_chunks_cpu(parts + p, std::min(kMaxParts, n_parts - p), x, M, K, precise_x);
        return;
    }
    const RowKernel* kern[kMaxParts];
    const bool uses_q8_K = row_kernels(parts, n_parts, precise_x, kern);
    const bool simd = cpu_isa_simd(cpu_get_isa());
    // This thread's buffers, read by the whole team through these pointers and references.
    thread_local std::vector<RowKind> kind_tl;
    thread_local std::vector<Outliers> outl_tl;
    thread_local std::vector<int> starts_tl;
    thread_local std::vector<RowsCall> calls_tl;
    thread_local std::vector<Tile> tiles_tl;
    if (uses_q8_K) {
        kind_tl.resize(M);
        outl_tl.resize(M);
    }
    RowKind* const kind = uses_q8_K ? kind_tl.data() : nullptr;
    Outliers* const outl = outl_tl.data();
    std::vector<int>& starts = starts_tl;
    std::vector<RowsCall>& calls = calls_tl;
    std::vector<Tile>& tiles = tiles_tl;
    size_t total_bytes = 0;
    for (int p = 0; p < n_parts; ++p) total_bytes += parts[p].row_bytes * static_cast<size_t>(parts[p].N);
    const int nt = total_bytes * static_cast<size_t>(M) < kMinParallelBytes * GEMV_MAX_M
                       ? 1 : std::max(1, cpu_get_num_threads());
#pragma omp parallel num_threads(nt)
    {
        if (kind != nullptr) {
#pragma omp for schedule(static)
            for (int m = 0; m < M; ++m) kind[m] = q8_K_outliers(x + static_cast<size_t>(m) * K, K, outl[m]);
        }
#pragma omp single
        {
            cut_runs(kind, M, GEMV_MAX_M, starts);
            const int n_runs = static_cast<int>(starts.size()) - 1;
            if (calls.size() < static_cast<size_t>(n_runs)) calls.resize(n_runs);
            cut_tiles(tiles, parts, n_parts, kern, n_runs, nt);
        }
        const int n_runs = static_cast<int>(starts.size()) - 1;
        RowsCall* const cs = calls.data();
#pragma omp for schedule(dynamic, 1)
        for (int r = 0; r < n_runs; ++r) {
            cs[r].ready(kern, parts, n_parts, x, starts[r], starts[r + 1] - starts[r], K, simd, kind, outl);
        }
        const int n_tiles = static_cast<int>(tiles.size());
        const Tile* const tl = tiles.data();
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < n_tiles; ++i) {
            const Tile t = tl[i];
            for (int r = t.r0; r < t.r1; ++r) cs[r].job[t.p].run(K, t.n0, t.n1);
        }
#pragma omp for schedule(dynamic, 1)
        for (int r = 0; r < n_runs; ++r) cs[r].finish(kern, parts, n_parts);
    }
}

void gemv_cpu(QType t, const uint8_t* w, size_t row_bytes, const float* x, float* y, int M, int N, int K,
              bool precise_x, RowArgmax* argmax) {
    const GemvPart part{t, w, row_bytes, y, N};
    gemv_parts_cpu(&part, 1, x, M, K, precise_x, nullptr, argmax);
}

void gemv_each_cpu(const GemvPart* parts, const float* const* x, int n_parts, int K) {
    if (n_parts <= 0) return;
    const Tables& tab = tables();
    const Isa isa = cpu_get_isa();
    const bool simd = cpu_isa_simd(isa);
    // One prepared activation row per distinct (x row, activation format): a token's experts share its row.
    struct Src {
        const float* x;
        Act act;
        Outliers outl;
        bool residual;  // a Q8_K row with more outliers than kMaxSparse: its residual row follows it
        Prepared prep;
    };
    thread_local std::vector<Src> srcs;
    thread_local std::vector<int> src_of;
    thread_local std::vector<std::vector<uint8_t>> bufs;
    thread_local std::vector<float> dense;
    thread_local std::vector<Job> jobs;
    thread_local std::vector<std::vector<float>> y_res;  // [2, N] of the parts whose row has a residual row
    srcs.clear();
    src_of.assign(n_parts, -1);
    for (int p = 0; p < n_parts; ++p) {
        const Act act = tab.k[static_cast<int>(isa)][static_cast<int>(parts[p].t)].act;
        for (size_t s = 0; s < srcs.size() && src_of[p] < 0; ++s)
            if (srcs[s].x == x[p] && srcs[s].act == act) src_of[p] = static_cast<int>(s);
        if (src_of[p] >= 0) continue;
        src_of[p] = static_cast<int>(srcs.size());
        srcs.push_back({x[p], act, {}, false, {}});
    }
    if (bufs.size() < srcs.size()) bufs.resize(srcs.size());
    for (size_t s = 0; s < srcs.size(); ++s) {
        Src& S = srcs[s];
        const float* xk = S.x;
        uint8_t needs = 0;
        if (S.act == Act::Q8_K) {  // as gemv_parts_cpu treats each of its rows (the same bits as a one-row call)
            const RowKind kind = q8_K_outliers(S.x, K, S.outl);
            S.residual = needs = kind == RowKind::Residual;
            if (kind == RowKind::Sparse) {
                dense.assign(S.x, S.x + K);
                for (int i = 0; i < S.outl.n; ++i) dense[S.outl.idx[i]] = 0.f;
                xk = dense.data();
            }
        }
        const int first[2] = {0, 1 + needs};
        S.prep = prepare(S.act, simd, xk, 1, K, S.residual, &needs, first, first[1], bufs[s]);
    }
    jobs.resize(n_parts);
    if (y_res.size() < static_cast<size_t>(n_parts)) y_res.resize(n_parts);
    static const int kFirst[2][2] = {{0, 1}, {0, 2}};
    size_t total_bytes = 0;
    int total_rows = 0;
    for (int p = 0; p < n_parts; ++p) {
        const GemvPart& P = parts[p];
        const Src& S = srcs[src_of[p]];
        const RowKernel& kern = tab.k[static_cast<int>(isa)][static_cast<int>(P.t)];
        const int fm = S.residual ? 1 : 0;
        float* yo = P.y;
        if (S.residual) {
            y_res[p].resize(static_cast<size_t>(2) * P.N);
            yo = y_res[p].data();
        }
        jobs[p] = {kern.fn[fm], kern.rows[fm], P.w, P.row_bytes, S.prep.xa, S.prep.xs, yo, P.N, P.t,
                   S.act == Act::Q8_K && S.outl.n ? &S.outl : nullptr, kFirst[fm], 1};
        total_bytes += P.row_bytes * static_cast<size_t>(P.N);
        total_rows += P.N;
    }
    int nt = std::min(cpu_get_num_threads(), total_rows);
    if (total_bytes < kMinParallelBytes) nt = 1;
    const Job* const jb = jobs.data();
    if (nt <= 1) {
        for (int p = 0; p < n_parts; ++p) jb[p].run(K, 0, jb[p].N);
    } else {
        thread_local std::vector<Chunk> chunks;
        cut_chunks(chunks, jb, n_parts, total_bytes, nt,
                   [&](int p) { return tab.k[static_cast<int>(isa)][static_cast<int>(parts[p].t)].group; });
        const int n_chunks = static_cast<int>(chunks.size());
        const Chunk* const ck = chunks.data();
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
        for (int c = 0; c < n_chunks; ++c) jb[ck[c].p].run(K, ck[c].n0, ck[c].n1);
    }
    for (int p = 0; p < n_parts; ++p) {
        if (!srcs[src_of[p]].residual) continue;
        const int N = parts[p].N;
        const float* a = y_res[p].data();
        for (int n = 0; n < N; ++n) parts[p].y[n] = a[n] + a[N + n];
    }
}

uint64_t read_sum_cpu(const uint8_t* p, size_t n, int threads) {
    const uint64_t* q = reinterpret_cast<const uint64_t*>(p);
    const int64_t words = static_cast<int64_t>(n / 8);
    uint64_t total = 0;
#pragma omp parallel for num_threads(std::max(1, threads)) schedule(static) reduction(+ : total)
    for (int64_t i = 0; i < words; ++i) total += q[i];
    return total;
}

}  // namespace pyllm
