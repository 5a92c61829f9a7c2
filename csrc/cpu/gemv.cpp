// CPU dispatch: picks the row kernel for (ISA, type), prepares the activations once, and splits the output
// rows over OpenMP threads.  Also the thread count, ISA selection and the bandwidth probe.
//
// The OpenMP runtime is torch's own libgomp (same soname, loaded first), so our threads and torch's share
// one pool; we pass num_threads() per region instead of omp_set_num_threads() so that pyllm's setting does
// not change torch's.
#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <cstdio>
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

struct Tables {
    RowKernel k[2][kTypeIds];    // [Isa][type id]; the SIMD row falls back to generic per type
    RowKernel x16[2][kTypeIds];  // precise_x kernels, or the plain ones where a type has none
    Tables() {
        for (int t = 0; t < kTypeIds; ++t) {
            const QType q = static_cast<QType>(t);
            k[0][t] = cpu::row_kernel_generic(q);
            RowKernel s = cpu::row_kernel_avx2_legacy(q);
            if (!s.fn[0]) s = cpu::row_kernel_avx2_kquants(q);
            if (!s.fn[0]) s = cpu::row_kernel_avx2_awq(q);
            k[1][t] = s.fn[0] ? s : k[0][t];
            const RowKernel g16 = cpu::row_kernel_generic_x16(q), a16 = cpu::row_kernel_avx2_x16(q);
            x16[0][t] = g16.fn[0] ? g16 : k[0][t];
            x16[1][t] = a16.fn[0] ? a16 : (g16.fn[0] ? g16 : k[1][t]);
        }
    }
};

const Tables& tables() {
    static const Tables t;
    return t;
}

bool cpu_runs_avx2() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

Isa g_isa = (cpu::avx2_compiled() && cpu_runs_avx2()) ? Isa::Avx2 : Isa::Scalar;
int g_threads = 0;  // 0 = not chosen yet: physical cores

// Below this many weight bytes a parallel region costs more than it saves.
constexpr size_t kMinParallelBytes = 64 * 1024;

}  // namespace

bool cpu_type_supported(QType t) {
    const int id = static_cast<int>(t);
    return id >= 0 && id < kTypeIds && tables().k[0][id].fn[0] != nullptr;
}

bool cpu_isa_available(Isa isa) {
    return isa == Isa::Scalar || (isa == Isa::Avx2 && cpu::avx2_compiled() && cpu_runs_avx2());
}
void cpu_set_isa(Isa isa) { g_isa = isa; }
Isa cpu_get_isa() { return g_isa; }
const char* cpu_isa_name(Isa isa) { return isa == Isa::Avx2 ? "avx2" : "scalar"; }

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

void gemv_cpu(QType t, const uint8_t* w, size_t row_bytes, const float* x, float* y, int M, int N, int K,
              bool precise_x) {
    const Tables& tab = tables();
    const RowKernel& k = (precise_x ? tab.x16 : tab.k)[static_cast<int>(g_isa)][static_cast<int>(t)];
    const bool simd = g_isa == Isa::Avx2;

    // Activations prepared once per call, shared read-only by all threads: [M, act_row_bytes]
    thread_local std::vector<uint8_t> act_buf;
    const uint8_t* xa = reinterpret_cast<const uint8_t*>(x);
    const size_t xs = cpu::act_row_bytes(k.act, K);
    if (k.act != Act::F32) {
        if (act_buf.size() < xs * M) act_buf.resize(xs * M);
        for (int m = 0; m < M; ++m) {
            uint8_t* dst = act_buf.data() + xs * m;
            const float* xm = x + static_cast<size_t>(m) * K;
            if (k.act == Act::Q8_32) {
                const cpu::Q8Row r = cpu::q8_row(dst, K);
                simd ? cpu::quantize_q8_32_avx2(xm, K, r) : cpu::quantize_q8_32_generic(xm, K, r);
            } else if (k.act == Act::Q16_32) {
                const cpu::Q16Row r = cpu::q16_row(dst, K);
                simd ? cpu::quantize_q16_32_avx2(xm, K, r) : cpu::quantize_q16_32_generic(xm, K, r);
            } else {
                auto* b = reinterpret_cast<block_q8_K*>(dst);
                simd ? cpu::quantize_q8_K_avx2(xm, K, b) : cpu::quantize_q8_K_generic(xm, K, b);
            }
        }
        xa = act_buf.data();
    }

    const cpu::RowDot fn = k.fn[M - 1];
    int nt = std::min(cpu_get_num_threads(), N);
    if (row_bytes * static_cast<size_t>(N) < kMinParallelBytes) nt = 1;
    if (nt <= 1) {
        for (int n = 0; n < N; ++n) fn(K, w + row_bytes * n, xa, xs, y + n, N);
        return;
    }
    // Dynamic chunks (~8 per thread) so a thread slowed by another process does not hold the others up;
    // each chunk is still a contiguous run of rows for the hardware prefetcher.
    const int chunk = std::max(1, N / (nt * 8));
#pragma omp parallel for num_threads(nt) schedule(dynamic, chunk)
    for (int n = 0; n < N; ++n) fn(K, w + row_bytes * n, xa, xs, y + n, N);
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
