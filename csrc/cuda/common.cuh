// Small helpers every CUDA file uses: byte-packed integer math that also runs on the host (so the per-type
// GEMV math is checked on CPU-only CI by tests/gpu/gemv_host_selftest.cu), aligned loads, and launch checks.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <utility>

#include "../common/decode.h"

// "#pragma unroll" in __host__ __device__ code: g++ warns about the pragma in nvcc's host pass.
#if defined(__CUDA_ARCH__)
#define PYLLM_UNROLL _Pragma("unroll")
#else
#define PYLLM_UNROLL
#endif

namespace pyllm {
namespace cuda {

// Sum of the 4 signed byte products of a and b, plus c: the inner product of every quantized dot (dp4a).
PYLLM_HD inline int dp4a(int a, int b, int c) {
#if defined(__CUDA_ARCH__)
    return __dp4a(a, b, c);
#else
    for (int i = 0; i < 4; ++i)
        c += static_cast<int>(static_cast<int8_t>(a >> (8 * i))) * static_cast<int>(static_cast<int8_t>(b >> (8 * i)));
    return c;
#endif
}

// Per-byte a - b, wrapping: turns 6-bit codes 0..63 into signed int8 -32..31 four at a time (Q6_K).
PYLLM_HD inline int vsub4(int a, int b) {
#if defined(__CUDA_ARCH__)
    return static_cast<int>(__vsub4(static_cast<unsigned>(a), static_cast<unsigned>(b)));
#else
    uint32_t r = 0;
    for (int i = 0; i < 4; ++i)
        r |= static_cast<uint32_t>(static_cast<uint8_t>((a >> (8 * i)) - (b >> (8 * i)))) << (8 * i);
    return static_cast<int>(r);
#endif
}

// fp16 bits -> float; the hardware conversion on the device, the exact bit version on the host.
PYLLM_HD inline float h2f(uint16_t h) {
#if defined(__CUDA_ARCH__)
    return __half2float(__ushort_as_half(h));
#else
    return fp16_to_fp32(h);
#endif
}

// Loads at the alignment each block layout guarantees.  Blocks of 18/22/34/210 bytes are only 2-byte
// aligned, so their 32-bit words are assembled from two 16-bit loads (still coalesced across the warp).
PYLLM_HD inline uint16_t ld_u16(const uint8_t* p) { return *reinterpret_cast<const uint16_t*>(p); }
PYLLM_HD inline int ld_i32_a2(const uint8_t* p) {
    const uint16_t* q = reinterpret_cast<const uint16_t*>(p);
    return static_cast<int>(static_cast<uint32_t>(q[0]) | (static_cast<uint32_t>(q[1]) << 16));
}
PYLLM_HD inline int ld_i32(const uint8_t* p) { return *reinterpret_cast<const int*>(p); }
PYLLM_HD inline int4 ld_i128(const void* p) { return *reinterpret_cast<const int4*>(p); }  // 16-byte aligned
PYLLM_HD inline int2 ld_i64(const void* p) { return *reinterpret_cast<const int2*>(p); }   // 8-byte aligned

// Byte-assembled loads for rows with no alignment at all (AWQ rows are 3K/G + K/2 bytes, odd for odd K/G).
PYLLM_HD inline uint16_t ld_u16_b(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
PYLLM_HD inline int ld_i32_b(const uint8_t* p) {
    return static_cast<int>(static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
                            (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24));
}

// Moves bits 0..3 of h to bit 4 of bytes 0..3: the 5th bit of four Q5_0 codes.
PYLLM_HD inline int spread_bit4(uint32_t h) {
    return static_cast<int>(((h << 4) & 0x10u) | ((h << 11) & 0x1000u) | ((h << 18) & 0x100000u) |
                            ((h << 25) & 0x10000000u));
}

// Throws with the launcher's name when a launch failed (bad configuration, no kernel image for this GPU).
inline void check_launch(const char* what) {
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": CUDA launch failed: " + cudaGetErrorString(e));
}

// Programmatic dependent launch (compute capability 9.0 and later), asked for with PYLLM_CUDA_PDL=1: a decode-step
// kernel may then start while the one before it drains, so its CTAs are resident and its weights on their way to
// L2 when the previous kernel's last CTA retires, where a plain launch pays the ramp and a first HBM round trip
// after the drain, ~10 times per layer.  Each such kernel calls pdl_trigger() first (so its own successor may
// launch) and pdl_wait() before it reads anything an earlier kernel wrote or writes anything at all:
// griddepcontrol.wait returns once the kernel before it has completed with its writes visible, and that kernel
// waited for its own predecessor, so every earlier one has completed too.  Without the launch attribute both are
// no-ops.  Off by default until a GPU run measures it (tests/gpu/bench_cuda.py and tools/gpu_profile.py time both).
inline bool pdl_requested() {
    const char* e = std::getenv("PYLLM_CUDA_PDL");
    if (e == nullptr || e[0] != '1' || e[1] != 0) return false;
    int dev = 0, major = 0;
    return cudaGetDevice(&dev) == cudaSuccess &&
           cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess && major >= 9;
}

#if defined(__CUDACC__)
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Every 128-byte line of [p, p + bytes) into L2, the CTA's threads taking one line each in turn: for rows a kernel
// reads later (or, launched programmatically, before the kernel it depends on has finished).
__device__ __forceinline__ void prefetch_l2(const uint8_t* p, size_t bytes) {
    const size_t stride = static_cast<size_t>(blockDim.x) * 128;
    for (size_t off = static_cast<size_t>(threadIdx.x) * 128; off < bytes; off += stride)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p + off));
}

// kernel<<<grid, block, smem, stream>>>(args...), with programmatic stream serialization where pdl_requested().
template <class... P, class... A>
void launch_kernel(const char* what, void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                   A&&... args) {
    if (!pdl_requested()) {
        kernel<<<grid, block, smem, stream>>>(std::forward<A>(args)...);
        check_launch(what);
        return;
    }
    cudaLaunchAttribute attr[1] = {};
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, std::forward<A>(args)...);
    if (e != cudaSuccess)
        throw std::runtime_error(std::string(what) + ": CUDA launch failed: " + cudaGetErrorString(e));
}

// Sum over the 32 lanes of a warp; every lane gets the total.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
#endif

}  // namespace cuda
}  // namespace pyllm
