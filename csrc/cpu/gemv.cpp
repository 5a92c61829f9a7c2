// CPU dispatch: picks the row kernel for (ISA, type), prepares the activations once, and splits the output
// rows over OpenMP threads.  Also the thread count, ISA selection and the bandwidth probe.
//
// The OpenMP runtime is torch's own libgomp (same soname, loaded first), so our threads and torch's share
// one pool; we pass num_threads() per region instead of omp_set_num_threads() so that pyllm's setting does
// not change torch's.
#include <omp.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "cpu_impl.h"

namespace pyllm {

using cpu::Act;
using cpu::RowKernel;

namespace {

constexpr int kTypeIds = QTYPE_ID_LIMIT;

bool cpu_runs_avx512_natively();

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
            const RowKernel v = cpu_runs_avx512_natively() ? cpu::row_kernel_avx512(q) : cpu::row_kernel_vnni_emulated(q);
            k[2][t] = k[3][t] = v.available() ? v : k[1][t];
            RowKernel g16 = cpu::row_kernel_generic_x16(q);
            if (!g16.available()) g16 = cpu::row_kernel_generic_rows8_x16(q);
            const RowKernel a16 = cpu::row_kernel_avx2_x16(q);
            x16[0][t] = g16.available() ? g16 : k[0][t];
            x16[1][t] = a16.available() ? a16 : (g16.available() ? g16 : k[1][t]);
            x16[2][t] = x16[3][t] = a16.available() || g16.available() ? x16[1][t] : k[2][t];
        }
    }
};

const Tables& tables() {
    static const Tables t;
    return t;
}

bool cpu_runs_avx2() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
    return false;
#endif
}

#if defined(__x86_64__)
void cpuid(unsigned leaf, unsigned sub, unsigned r[4]) {
    __asm__ __volatile__("cpuid" : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3]) : "a"(leaf), "c"(sub));
}
// XCR0: which register states the OS saves on a context switch (xgetbv needs CPUID.1:ECX.OSXSAVE).
uint64_t xcr0() {
    unsigned r[4];
    cpuid(1, 0, r);
    if (!(r[2] & (1u << 27))) return 0;
    unsigned lo, hi;
    __asm__ __volatile__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (static_cast<uint64_t>(hi) << 32) | lo;
}
#endif

// AVX-512 F + BW + VL + VNNI in CPUID, and the OS saves the opmask and all 32 ZMM registers (XCR0 bits 5-7,
// with SSE and AVX state, bits 1-2).  A kernel or hypervisor may hide AVX-512 state although CPUID lists it.
bool cpu_runs_avx512() {
#if defined(__x86_64__)
    if (!cpu_runs_avx2()) return false;
    unsigned r[4];
    cpuid(0, 0, r);
    if (r[0] < 7) return false;
    cpuid(7, 0, r);
    const bool f = r[1] & (1u << 16), bw = r[1] & (1u << 30), vl = r[1] & (1u << 31), vnni = r[2] & (1u << 11);
    return f && bw && vl && vnni && (xcr0() & 0xE6) == 0xE6;
#else
    return false;
#endif
}

// Built with the AVX-512 kernels, and this CPU and its OS run them.
bool cpu_runs_avx512_natively() {
    static const bool ok = cpu::avx2_compiled() && cpu::avx512_compiled() && cpu_runs_avx512();
    return ok;
}

Isa pick_default() {
    for (int i = ISA_COUNT - 1; i > 0; --i) {
        const Isa isa = static_cast<Isa>(i);
        if (cpu_isa_available(isa) && !(isa == Isa::Avx512 && cpu_avx512_emulated())) return isa;
    }
    return Isa::Scalar;
}

std::atomic<bool> g_emulate_avx512{false};

Isa g_isa = Isa::Scalar;  // set on first use from cpu_best_isa() (PYLLM_ISA: see bindings_kernels.cpp)
bool g_isa_set = false;
int g_threads = 0;  // 0 = not chosen yet: physical cores

// Below this many weight bytes a parallel region costs more than it saves.
constexpr size_t kMinParallelBytes = 64 * 1024;

}  // namespace

bool cpu_type_supported(QType t) {
    const int id = static_cast<int>(t);
    return id >= 0 && id < kTypeIds && tables().k[0][id].available();
}


bool cpu_isa_available(Isa isa) {
    switch (isa) {
        case Isa::Scalar: return true;
        case Isa::Avx2: return cpu::avx2_compiled() && cpu_runs_avx2();
        case Isa::Avx512: return cpu_runs_avx512_natively() || cpu_avx512_emulated();
        case Isa::Amx: return cpu_runs_avx512_natively() && cpu::amx_usable();
    }
    return false;
}
bool cpu_emulate_avx512(bool on) {
    const bool can = !cpu_runs_avx512_natively() && cpu_isa_available(Isa::Avx2) &&
                     cpu::row_kernel_vnni_emulated(QType::Q4_0).available();
    g_emulate_avx512 = on && can;
    if (!g_emulate_avx512 && cpu_get_isa() == Isa::Avx512 && !cpu_runs_avx512_natively()) cpu_set_isa(cpu_best_isa());
    return g_emulate_avx512;
}
bool cpu_avx512_emulated() { return g_emulate_avx512.load(); }

Isa cpu_best_isa() {
    static const Isa best = pick_default();
    return best;
}
void cpu_set_isa(Isa isa) {
    g_isa = isa;
    g_isa_set = true;
}
Isa cpu_get_isa() {
    if (!g_isa_set) cpu_set_isa(cpu_best_isa());
    return g_isa;
}
const char* cpu_isa_name(Isa isa) {
    static const char* const names[ISA_COUNT] = {"scalar", "avx2", "avx512", "amx"};
    const int i = static_cast<int>(isa);
    return i >= 0 && i < ISA_COUNT ? names[i] : "?";
}
bool cpu_isa_from_name(const char* name, Isa* isa) {
    for (int i = 0; i < ISA_COUNT; ++i)
        if (std::strcmp(name, cpu_isa_name(static_cast<Isa>(i))) == 0) {
            *isa = static_cast<Isa>(i);
            return true;
        }
    return false;
}

int cpu_physical_cores() {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) != 0) return std::max(1u, std::thread::hardware_concurrency());
    // SMT siblings share a core's load/store units; decode GEMV is bandwidth-bound, so one thread per core.
    std::set<std::pair<int, int>> cores;
    int n_cpus = 0;
    for (int c = 0; c < CPU_SETSIZE; ++c) {
        if (!CPU_ISSET(c, &set)) continue;
        ++n_cpus;
        int pkg = 0, core = c;
        char path[128];
        snprintf(path, sizeof(path), "/sys/devices/system/cpu/cpu%d/topology/physical_package_id", c);
        if (FILE* f = fopen(path, "r")) { if (fscanf(f, "%d", &pkg) != 1) pkg = 0; fclose(f); }
        snprintf(path, sizeof(path), "/sys/devices/system/cpu/cpu%d/topology/core_id", c);
        if (FILE* f = fopen(path, "r")) { if (fscanf(f, "%d", &core) != 1) core = c; fclose(f); }
        cores.insert({pkg, core});
    }
    return std::max(1, cores.empty() ? n_cpus : static_cast<int>(cores.size()));
}

void cpu_set_num_threads(int n) { g_threads = n; }
int cpu_get_num_threads() {
    if (g_threads <= 0) g_threads = cpu_physical_cores();
    return g_threads;
}

namespace {

// Q8_K activations have one scale per 256 values, so one large value rounds the other 255 of its block on a
// coarse grid.  Gemma 3's MLP and attention outputs carry such values: its Q4_K/Q6_K attn_output and ffn_down
// GEMVs were most of the decode path's error (Gemma-3-270M, 3 short prompts, last position vs the float32
// reference: max error 6.4% of the max logit and mean KL 3.8e-3; those two layers in float32: 2.2% / 1.6e-3).
// Such rows get a second Q8_K row holding the rounding residual x - d q, and the row dot runs with both
// (the M = 2 kernel: the weights are decoded once), which leaves ~1/254 of the error (2.5% / 1.8e-3 in the same
// measurement; per-32 scales instead: 2.9% / 2.0e-3).  "Such rows": the blocks' mean squared max is above
// kOutlier^2 times the mean square, where a Gaussian row gives ~2.9^2; rows without outliers keep one Q8_K row
// (the second dot costs ~15% CPU time on Q4_K).
constexpr float kOutlier = 6.0f;

bool q8_K_needs_residual(const float* x, int K) {
    float amax2 = 0.f, ss[8] = {};
    for (int i = 0; i < K / QK_K; ++i) {
        const float* xb = x + QK_K * i;
        float mx = 0.f;
        for (int j = 0; j < QK_K; j += 8)
            for (int l = 0; l < 8; ++l) {
                mx = std::max(mx, std::fabs(xb[j + l]));
                ss[l] += xb[j + l] * xb[j + l];
            }
        amax2 += mx * mx;
    }
    const float sum = ((ss[0] + ss[1]) + (ss[2] + ss[3])) + ((ss[4] + ss[5]) + (ss[6] + ss[7]));
    return amax2 * QK_K > kOutlier * kOutlier * sum;
}

void quantize_q8_K(bool simd, const float* x, int K, block_q8_K* out) {
    simd ? cpu::quantize_q8_K_avx2(x, K, out) : cpu::quantize_q8_K_generic(x, K, out);
}

// r = x - d q per block: what the Q8_K row q misses of x (fp32).
void q8_K_residual(const float* x, const block_q8_K* q, int K, float* r) {
    for (int i = 0; i < K / QK_K; ++i)
        for (int j = 0; j < QK_K; ++j) r[QK_K * i + j] = x[QK_K * i + j] - q[i].d * static_cast<float>(q[i].qs[j]);
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

}  // namespace

void gemv_parts_cpu(const GemvPart* parts, int n_parts, const float* x, int M, int K, bool precise_x,
                    GemvStats* stats) {
    const Tables& tab = tables();
    const Isa isa = cpu_get_isa();
    const bool simd = cpu_isa_simd(isa);
    const uint64_t t0 = stats ? now_ns() : 0;
    if (n_parts > kMaxParts) {  // never from the decode step; keeps the fixed-size tables below honest
        for (int p = 0; p < n_parts; p += kMaxParts)
            gemv_parts_cpu(parts + p, std::min(kMaxParts, n_parts - p), x, M, K, precise_x, stats);
        return;
    }
    const RowKernel* kern[kMaxParts];
    bool uses_q8_K = false;
    for (int p = 0; p < n_parts; ++p) {
        kern[p] = &(precise_x ? tab.x16 : tab.k)[static_cast<int>(isa)][static_cast<int>(parts[p].t)];
        uses_q8_K |= kern[p]->act == Act::Q8_K;
    }

    // Which rows carry outliers is decided per row, and only those take a residual row: the row kernels give a
    // row the same bits whatever the other rows of the call, so a row's result never depends on them (verifying
    // k drafted tokens in one call gives each the logits it gets alone: speculative decoding's greedy equality).
    // (An all-zero residual row for the others would add exactly 0, at the cost of a whole row's dot.)
    bool residual = false;
    thread_local std::vector<uint8_t> needs;
    int first[GEMV_MAX_M + 1] = {};  // with residual: row m's activation row; first[M] = rows in all
    if (uses_q8_K) {
        needs.assign(M, 0);
        for (int m = 0; m < M; ++m) residual |= (needs[m] = q8_K_needs_residual(x + static_cast<size_t>(m) * K, K));
        for (int m = 0; m < M; ++m) first[m + 1] = first[m] + 1 + needs[m];
        if (residual && first[M] > GEMV_MAX_M) {  // the rows must fit one row-dot call: consecutive runs that do
            for (int m0 = 0; m0 < M;) {
                int mc = 0;
                while (m0 + mc < M && first[m0 + mc + 1] - first[m0] <= GEMV_MAX_M) ++mc;
                GemvPart sub[kMaxParts];
                thread_local std::vector<float> part[kMaxParts];
                for (int p = 0; p < n_parts; ++p) {
                    sub[p] = parts[p];
                    part[p].resize(static_cast<size_t>(mc) * parts[p].N);
                    sub[p].y = part[p].data();
                }
                gemv_parts_cpu(sub, n_parts, x + static_cast<size_t>(m0) * K, mc, K, precise_x, stats);
                for (int p = 0; p < n_parts; ++p)
                    std::copy(part[p].begin(), part[p].begin() + static_cast<size_t>(mc) * parts[p].N,
                              parts[p].y + static_cast<size_t>(m0) * parts[p].N);
                m0 += mc;
            }
            return;
        }
    }

    // Activations prepared once per format, shared read-only by all threads and parts.  Only Q8_K rows take a
    // residual row.
    thread_local std::vector<uint8_t> act_buf[kActCount];
    bool have[kActCount] = {};
    Prepared prep[kActCount] = {};
    struct Job {
        cpu::RowDot fn;
        cpu::RowsDot rows;
        const uint8_t* w;
        size_t row_bytes;
        const uint8_t* xa;
        size_t xs;
        float* y;
        int N;
        void run(int K, int n0, int n1) const {  // rows n0..n1-1
            if (rows) return rows(K, n1 - n0, w + row_bytes * n0, row_bytes, xa, xs, y + n0, N);
            for (int n = n0; n < n1; ++n) fn(K, w + row_bytes * n, xa, xs, y + n, N);
        }
    };
    Job job[kMaxParts];
    thread_local std::vector<float> y_buf[kMaxParts];
    size_t total_bytes = 0;
    int total_rows = 0;
    for (int p = 0; p < n_parts; ++p) {
        const int a = static_cast<int>(kern[p]->act);
        const bool res = residual && kern[p]->act == Act::Q8_K;
        if (!have[a]) {
            prep[a] = prepare(kern[p]->act, simd, x, M, K, res, needs.data(), first, first[M], act_buf[a]);
            have[a] = true;
        }
        const GemvPart& P = parts[p];
        float* yo = P.y;
        if (res) {
            if (y_buf[p].size() < static_cast<size_t>(first[M]) * P.N) y_buf[p].resize(static_cast<size_t>(first[M]) * P.N);
            yo = y_buf[p].data();
        }
        const int fm = (res ? first[M] : M) - 1;
        job[p] = {kern[p]->fn[fm], kern[p]->rows[fm], P.w, P.row_bytes, prep[a].xa, prep[a].xs, yo, P.N};
        total_bytes += P.row_bytes * static_cast<size_t>(P.N);
        total_rows += P.N;
    }
    const uint64_t t1 = stats ? now_ns() : 0;

    int nt = std::min(cpu_get_num_threads(), total_rows);
    if (total_bytes < kMinParallelBytes) nt = 1;
    uint64_t busy = 0;
    if (nt <= 1) {
        for (int p = 0; p < n_parts; ++p) job[p].run(K, 0, job[p].N);
        busy = stats ? now_ns() - t1 : 0;
    } else {
        // Chunks of about equal weight bytes (~8 per thread), taken dynamically so a thread slowed by another
        // process does not hold the others up; each chunk is a contiguous run of one part's rows for the hardware
        // prefetcher.
        struct Chunk {
            int p, n0, n1;
        };
        thread_local std::vector<Chunk> chunks;
        chunks.clear();
        const size_t chunk_bytes = std::max<size_t>(1, total_bytes / (static_cast<size_t>(nt) * 8));
        for (int p = 0; p < n_parts; ++p) {
            const int g = kern[p]->group;  // N is a multiple of it (bindings check)
            const int rows = (static_cast<int>(std::max<size_t>(1, chunk_bytes / job[p].row_bytes)) + g - 1) / g * g;
            for (int n0 = 0; n0 < job[p].N; n0 += rows) chunks.push_back({p, n0, std::min(job[p].N, n0 + rows)});
        }
        const int n_chunks = static_cast<int>(chunks.size());
        const Chunk* const ck = chunks.data();  // chunks is this thread's: the team reads it through a pointer
        const bool timed = stats != nullptr;
#pragma omp parallel num_threads(nt) reduction(+ : busy)
        {
            const uint64_t b0 = timed ? now_ns() : 0;
#pragma omp for schedule(dynamic, 1) nowait
            for (int c = 0; c < n_chunks; ++c) {
                const Chunk ch = ck[c];
                job[ch.p].run(K, ch.n0, ch.n1);
            }
            if (timed) busy += now_ns() - b0;
        }
    }
    const uint64_t t2 = stats ? now_ns() : 0;
    for (int p = 0; p < n_parts; ++p) {
        if (!(residual && kern[p]->act == Act::Q8_K)) continue;
        const int N = parts[p].N;
        for (int m = 0; m < M; ++m) {
            const float* a = job[p].y + static_cast<size_t>(first[m]) * N;
            float* y = parts[p].y + static_cast<size_t>(m) * N;
            if (needs[m]) {
                for (int n = 0; n < N; ++n) y[n] = a[n] + a[N + n];
            } else {
                std::copy(a, a + N, y);
            }
        }
    }
    if (stats) {
        stats->calls += 1;
        stats->bytes += total_bytes;
        stats->quant_ns += t1 - t0 + (now_ns() - t2);
        stats->wall_ns += t2 - t1;
        stats->busy_ns += busy;
        stats->thread_ns += static_cast<uint64_t>(nt) * (t2 - t1);
    }
}

void gemv_cpu(QType t, const uint8_t* w, size_t row_bytes, const float* x, float* y, int M, int N, int K,
              bool precise_x) {
    const GemvPart part{t, w, row_bytes, y, N};
    gemv_parts_cpu(&part, 1, x, M, K, precise_x);
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
