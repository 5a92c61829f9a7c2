// CPU features and the kernels' instruction set: what this CPU and its OS run (CPUID, XCR0, Linux's AMX tile
// permission), the ISA in use (the best by default, PYLLM_ISA or set_isa to force; AVX-512 emulated on AVX2 for
// tests), and the thread count (physical cores by default).
#include <omp.h>
#include <sched.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <set>
#include <thread>
#include <utility>

#include "cpu_impl.h"

namespace pyllm {

namespace {

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


Isa pick_default() {
    for (int i = ISA_COUNT - 1; i > 0; --i) {
        const Isa isa = static_cast<Isa>(i);
        if (cpu_isa_available(isa) && !(isa == Isa::Avx512 && cpu_avx512_emulated())) return isa;
    }
    return Isa::Scalar;
}

std::atomic<bool> g_emulate_avx512{false};
std::atomic<int> g_rows8_pairs{-1};  // -1: not decided yet (cpu_rows8_pairs), else 0 / 1

// CPUID leaf 0's vendor string is "AuthenticAMD" (AMD's AVX-512 cores: kernels.h cpu_rows8_pairs).
bool cpu_is_amd() {
#if defined(__x86_64__)
    unsigned r[4];
    cpuid(0, 0, r);
    char vendor[13] = {};
    std::memcpy(vendor, &r[1], 4);
    std::memcpy(vendor + 4, &r[3], 4);
    std::memcpy(vendor + 8, &r[2], 4);
    return std::strcmp(vendor, "AuthenticAMD") == 0;
#else
    return false;
#endif
}

Isa g_isa = Isa::Scalar;  // set on first use from cpu_best_isa() (PYLLM_ISA: see bindings_kernels.cpp)
bool g_isa_set = false;
int g_threads = 0;  // 0 = not chosen yet: physical cores

}  // namespace

bool cpu_isa_available(Isa isa) {
    switch (isa) {
        case Isa::Scalar: return true;
        case Isa::Avx2: return cpu::avx2_compiled() && cpu_runs_avx2();
        case Isa::Avx512: return cpu::avx512_runs_natively() || cpu_avx512_emulated();
        case Isa::Amx: return cpu::avx512_runs_natively() && cpu::amx_usable();
    }
    return false;
}
bool cpu_emulate_avx512(bool on) {
    const bool can = !cpu::avx512_runs_natively() && cpu_isa_available(Isa::Avx2) &&
                     cpu::row_kernel_vnni_emulated(QType::Q4_0).available();
    g_emulate_avx512 = on && can;
    if (!g_emulate_avx512 && cpu_get_isa() == Isa::Avx512 && !cpu::avx512_runs_natively()) cpu_set_isa(cpu_best_isa());
    return g_emulate_avx512;
}
bool cpu_avx512_emulated() { return g_emulate_avx512.load(); }

bool cpu_rows8_pairs() {
    int on = g_rows8_pairs.load(std::memory_order_relaxed);
    if (on < 0) {  // PYLLM_ROWS8_PAIRS is applied by the extension's loader (pyllm/_ext.py), which checks it
        on = !cpu_is_amd();
        g_rows8_pairs.store(on, std::memory_order_relaxed);
    }
    return on != 0;
}
void cpu_set_rows8_pairs(bool on) { g_rows8_pairs.store(on, std::memory_order_relaxed); }

namespace cpu {
bool avx512_runs_natively() {
    static const bool ok = avx2_compiled() && avx512_compiled() && cpu_runs_avx512();
    return ok;
}
}  // namespace cpu

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

// Weak: the runtime the extension meets at load (torch's libgomp) may predate OpenMP 5.0.
#pragma weak omp_pause_resource_all

bool cpu_release_thread_pool() {
    if (&omp_pause_resource_all == nullptr) return false;
    return omp_pause_resource_all(omp_pause_soft) == 0;
}

size_t cpu_advise_huge_pages(void* p, size_t n) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    constexpr uintptr_t HUGE = uintptr_t{1} << 21;
    const uintptr_t a = (reinterpret_cast<uintptr_t>(p) + HUGE - 1) & ~(HUGE - 1);
    const uintptr_t e = (reinterpret_cast<uintptr_t>(p) + n) & ~(HUGE - 1);
    if (e <= a || madvise(reinterpret_cast<void*>(a), e - a, MADV_HUGEPAGE) != 0) return 0;
    return e - a;
#else
    (void)p;
    (void)n;
    return 0;
#endif
}

void cpu_set_num_threads(int n) { g_threads = n; }
int cpu_get_num_threads() {
    if (g_threads <= 0) g_threads = cpu_physical_cores();
    return g_threads;
}

}  // namespace pyllm
