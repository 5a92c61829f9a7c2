// Host-run check of the CUDA GEMV's per-type slot math (csrc/cuda/gemv_types.cuh, AWQ rows included), for CI machines with nvcc
// but no GPU: tools/check_cuda_compile.sh builds this with nvcc and runs it on the CPU.
//
// For random blocks (random bytes, finite random fp16 scales) and random int8 activations with random scales,
// the sum over a block's slots of GemvType<T>::dot(load(slot)) must equal the float64 dot of the shared
// decoder's dequant_block() values (csrc/common/decode.h, itself tested against gguf.quants) with the
// activation values codes * d.  This catches every slot/nibble/bit indexing mistake without a GPU; what
// it cannot catch (warp reductions, grid indexing, alignment faults) is tests/gpu's job.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/gemv_types.cuh"

using namespace pyllm;
using namespace pyllm::cuda;

namespace {

std::mt19937 rng(1234);

uint16_t random_fp16(bool allow_negative) {
    // exponent 8..14: magnitudes 2^-7 .. 2^-0, random mantissa
    const uint16_t sign = allow_negative ? static_cast<uint16_t>((rng() & 1u) << 15) : 0;
    return static_cast<uint16_t>(sign | ((8 + rng() % 7) << 10) | (rng() & 0x3ffu));
}

template <class B>
void fill_block(B& b);  // random bytes, then valid scales

template <class B>
void random_bytes(B& b) {
    uint8_t* p = reinterpret_cast<uint8_t*>(&b);
    for (size_t i = 0; i < sizeof(B); ++i) p[i] = static_cast<uint8_t>(rng());
}
template <> void fill_block(block_q4_0& b) { random_bytes(b); b.d = random_fp16(true); }
template <> void fill_block(block_q4_1& b) { random_bytes(b); b.d = random_fp16(true); b.m = random_fp16(true); }
template <> void fill_block(block_q5_0& b) { random_bytes(b); b.d = random_fp16(true); }
template <> void fill_block(block_q8_0& b) { random_bytes(b); b.d = random_fp16(true); }
template <> void fill_block(block_q4_K& b) { random_bytes(b); b.d = random_fp16(true); b.dmin = random_fp16(true); }
template <> void fill_block(block_q5_K& b) { random_bytes(b); b.d = random_fp16(true); b.dmin = random_fp16(true); }
template <> void fill_block(block_q6_K& b) { random_bytes(b); b.d = random_fp16(true); }

template <QType T, class B>
int check(const char* name, int trials) {
    using Ty = GemvType<T>;
    static_assert(sizeof(B) == Ty::kBytes, "GemvType kBytes disagrees with blocks.h");
    constexpr int E = Ty::kElems;
    int bad = 0;
    double worst = 0;
    for (int t = 0; t < trials; ++t) {
        B b;
        fill_block(b);
        alignas(16) int8_t xq[E];
        float2 ds[E / kActBlock];
        for (int g = 0; g < E / kActBlock; ++g) {
            const float d = std::ldexp(1.0f + static_cast<float>(rng() % 1000) / 1000.0f, -static_cast<int>(rng() % 8));
            int sum = 0;
            for (int j = 0; j < kActBlock; ++j) {
                // full int8 range, including -128 is never produced by quantize_act (|code| <= 127)
                const int q = static_cast<int>(rng() % 255) - 127;
                xq[g * kActBlock + j] = static_cast<int8_t>(q);
                sum += q;
            }
            ds[g] = make_float2(d, d * static_cast<float>(sum));
        }
        float w[E];
        dequant_block(b, w);
        double ref = 0, mag = 0;
        for (int e = 0; e < E; ++e) {
            const double xv = static_cast<double>(xq[e]) * ds[e / kActBlock].x;
            ref += static_cast<double>(w[e]) * xv;
            mag += std::fabs(static_cast<double>(w[e]) * xv);
        }
        double got = 0;
        alignas(16) B copy = b;  // 16-byte aligned, as the device rows are
        for (int s = 0; s < Ty::kSlots; ++s) {
            const typename Ty::Frag f = Ty::load(reinterpret_cast<const uint8_t*>(&copy), s);
            got += Ty::dot(f, s, xq, ds);
        }
        const double err = std::fabs(got - ref) / (mag + 1e-30);
        worst = err > worst ? err : worst;
        if (err > 2e-6) {
            if (bad < 3) std::printf("  %s trial %d: slots sum %.9g, reference %.9g (rel. to sum|w*x| %.3g)\n", name, t, got, ref, err);
            ++bad;
        }
    }
    std::printf("%-5s %d blocks: %s (worst error / sum|w*x| = %.2g)\n", name, trials, bad ? "FAIL" : "ok", worst);
    return bad;
}

// AWQ rows: random codes, zeros and scales, each row at an odd byte offset (rows of 3K/G + K/2 bytes are not
// aligned); the slots over the whole row against dequant_awq_row (the CPU's exact fp32 decoder).
int check_awq(int G, int trials) {
    constexpr int K = 512;
    const int ng = K / G, rb = 3 * ng + K / 2;
    int bad = 0;
    double worst = 0;
    std::vector<uint8_t> buf(rb + 1);
    for (int t = 0; t < trials; ++t) {
        uint8_t* row = buf.data() + 1;
        for (int i = 0; i < rb; ++i) row[i] = static_cast<uint8_t>(rng());
        for (int g = 0; g < ng; ++g) {
            const uint16_t s = random_fp16(true);
            std::memcpy(row + 2 * g, &s, 2);
            row[2 * ng + g] = static_cast<uint8_t>(rng() % 16);
        }
        alignas(16) int8_t xq[K];
        float2 ds[K / kActBlock];
        for (int b = 0; b < K / kActBlock; ++b) {
            const float d = std::ldexp(1.0f + static_cast<float>(rng() % 1000) / 1000.0f, -static_cast<int>(rng() % 8));
            int sum = 0;
            for (int j = 0; j < kActBlock; ++j) {
                const int q = static_cast<int>(rng() % 255) - 127;
                xq[b * kActBlock + j] = static_cast<int8_t>(q);
                sum += q;
            }
            ds[b] = make_float2(d, d * static_cast<float>(sum));
        }
        std::vector<float> w(K);
        dequant_awq_row(row, K, G, w.data());
        double ref = 0, mag = 0;
        for (int e = 0; e < K; ++e) {
            const double xv = static_cast<double>(xq[e]) * ds[e / kActBlock].x;
            ref += static_cast<double>(w[e]) * xv;
            mag += std::fabs(static_cast<double>(w[e]) * xv);
        }
        double got = 0;
        for (int kb = 0; kb < K / GemvAwq::kElems; ++kb)
            for (int s = 0; s < GemvAwq::kSlots; ++s)
                got += GemvAwq::dot(GemvAwq::load(row, ng, G, kb, s), s, xq + kb * GemvAwq::kElems, ds + kb);
        const double err = std::fabs(got - ref) / (mag + 1e-30);
        worst = err > worst ? err : worst;
        if (err > 2e-6) {
            if (bad < 3) std::printf("  AWQ G=%d trial %d: slots sum %.9g, reference %.9g (rel. %.3g)\n", G, t, got, ref, err);
            ++bad;
        }
    }
    std::printf("AWQ G=%-3d %d rows: %s (worst error / sum|w*x| = %.2g)\n", G, trials, bad ? "FAIL" : "ok", worst);
    return bad;
}

}  // namespace

int main() {
    int bad = 0;
    bad += check<QType::Q4_0, block_q4_0>("Q4_0", 2000);
    bad += check<QType::Q4_1, block_q4_1>("Q4_1", 2000);
    bad += check<QType::Q5_0, block_q5_0>("Q5_0", 2000);
    bad += check<QType::Q8_0, block_q8_0>("Q8_0", 2000);
    bad += check<QType::Q4_K, block_q4_K>("Q4_K", 2000);
    bad += check<QType::Q5_K, block_q5_K>("Q5_K", 2000);
    bad += check<QType::Q6_K, block_q6_K>("Q6_K", 2000);
    for (int G : {32, 64, 128, 256}) bad += check_awq(G, 300);
    std::printf(bad ? "gemv host selftest: FAILED\n" : "gemv host selftest: ok\n");
    return bad ? 1 : 0;
}
