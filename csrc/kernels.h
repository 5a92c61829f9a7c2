// Every kernel launcher the bindings call: raw pointers, sizes and ints only (no torch, no pybind), so the
// kernels build and test without torch headers and the CUDA launchers can sit beside them unchanged.
//
// Shapes use torch order: a weight is N rows of K values, each row = K / block_size blocks (row_bytes bytes),
// x is [M, K] fp32 row-major, y is [M, N] fp32 row-major.  Callers (the bindings_*.cpp files) have already
// checked every size; the launchers assume valid input.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/limits.h"
#include "common/qtype.h"

namespace pyllm {

// ---- CPU (csrc/cpu) --------------------------------------------------------------------------------------
// Kernel families, each a superset of the one before: Avx512 = AVX-512 F/BW/VL + VNNI GEMV row kernels (the
// AVX2 ones where a type has none); Amx adds AMX bf16 tiles for prefill (gemm_amx.cpp), and its GEMV is Avx512's (at M <= 8
// a tile pass is not faster than the VNNI row dots).  Names: "scalar", "avx2", "avx512", "amx".
enum class Isa : int { Scalar = 0, Avx2 = 1, Avx512 = 2, Amx = 3 };
constexpr int ISA_COUNT = 4;

bool cpu_type_supported(QType t);      // gemv + dequantize exist for t
bool cpu_isa_available(Isa isa);       // compiled in, the CPU has it and the OS saves its register state
Isa cpu_best_isa();                    // the best available one (the default)
void cpu_set_isa(Isa isa);             // caller checked availability
Isa cpu_get_isa();
const char* cpu_isa_name(Isa isa);     // "scalar", "avx2", "avx512", "amx"
bool cpu_isa_from_name(const char* name, Isa* isa);  // false for an unknown name
// Tests on a CPU without AVX-512: make Isa::Avx512 available with its VNNI kernels compiled as AVX2 code
// (gemv_vnni_emulated.cpp), so their code runs here; never the default.  Returns whether emulation is on (false
// where the CPU has AVX-512 itself, or lacks AVX2).  Turning it off while avx512 is selected selects the default.
bool cpu_emulate_avx512(bool on);
bool cpu_avx512_emulated();
// Whether the AVX-512 rows-by-8 kernels take two 8-row groups per zmm register ("pairs": Q4_0 ... Q8_0 at any row
// count, Q4_K / Q5_K / Q6_K at one row) or one group per ymm register.  Both give the same bits; which is faster
// depends on the core.  On Intel's AVX-512 cores the pairs halve the instructions per weight byte (Xeon VM: Q4_K
// one-row decode 19 -> 22-24 GB/s, Qwen2.5 tg +7%); on AMD Zen 4 the same kernels ran 1.7-2.6x slower than the
// groups at one row, from DRAM on huge pages (Gemma 3 tg 75-78 -> 117-126 t/s without them).  Default: on except on AMD
// CPUs; set_rows8_pairs decides instead (PYLLM_ROWS8_PAIRS=0|1 at load, pyllm/_ext.py; A/B benchmarks, tests).
bool cpu_rows8_pairs();
void cpu_set_rows8_pairs(bool on);
// The AVX2 code paths (everything but the GEMV row kernels: quantizers, dequant, attention) serve every ISA
// above Scalar.
inline bool cpu_isa_simd(Isa isa) { return isa != Isa::Scalar; }
void cpu_set_num_threads(int n);       // n >= 1
int cpu_get_num_threads();
int cpu_physical_cores();              // cores (not SMT siblings) this process may run on
// Hands the calling thread's OpenMP worker threads back (they exit; the next parallel region of this thread starts
// new ones).  Why: libgomp keeps a pool of workers for every thread that has opened a parallel region, and once
// its threads outnumber the CPUs it throttles every barrier's spin-wait to ~100 iterations before sleeping.  A
// model loaded on one thread and run on another (the server's engine thread, a library caller's worker thread)
// then sleeps and wakes its workers at each of a step's ~200 regions: SmolLM2 decoded at 165 tok/s on a
// second thread against 310 on the loading thread (2 cores).  A thread that is done with the kernels for a while
// calls this.  Returns false where the OpenMP runtime has no omp_pause_resource_all (OpenMP < 5.0).
bool cpu_release_thread_pool();
// Asks the OS to back the 2 MiB-aligned pages inside [p, p + n) with huge pages (Linux madvise MADV_HUGEPAGE,
// which transparent huge pages in "madvise" mode need) and returns the bytes advised (0 elsewhere).  Pages already
// touched keep their 4 KiB pages, so call it before the first write.  Why: a decode step streams every weight
// copy once and reads a paged KV cache's blocks of 16 rows, which lie 180 KiB apart for one (layer, head) of
// SmolLM2; every 4 KiB page costs a TLB miss.  Measured on 2 cores (Xeon VM): one-stream decode +20-35% on the
// three fixture models with the weight copies on huge pages, and SmolLM2's 4-sequence step at 340 cached tokens
// 6.8 ms against 7.3-7.6 with the KV pool on them.
size_t cpu_advise_huge_pages(void* p, size_t n);

// What greedy sampling and the non-finite check need from a row of logits: read again by the Python sampler after
// the step, a row of 49k-262k logits cost ~2-4% of a small model's token, mostly misses on what the other thread
// wrote.  index: the first index of the row's largest value (np.argmax's choice), -1 where the row holds a NaN or
// an infinity (the caller then looks at the row itself).
struct RowArgmax {
    int64_t index = -1;
    float value = 0.f;
};
// The RowArgmax of y[0..n-1], n >= 1.
RowArgmax row_argmax_cpu(const float* y, int n);

// The ids of the k largest of y[0..n-1] (1 <= k <= n), ascending, into ids[0..k-1]: where values tie at the k-th
// largest, the lowest ids (the sampler's top-k rule).  Returns k, or -1 (ids untouched) where y holds a NaN or an
// infinity.
int row_top_k_cpu(const float* y, int n, int k, int64_t* ids);

// y[m, n] = sum_k x[m, k] * W[n, k] for 1 <= M <= GEMV_MAX_M, W read once in its quantized form.
// w: N * row_bytes bytes; x: [M, K]; y: [M, N].
// precise_x: keep the activations at 16 bits where the type has such a kernel (Q8_0; others ignore it).  For
// the output projection, whose error goes straight into the logits.  argmax: as gemv_parts_cpu's.
void gemv_cpu(QType t, const uint8_t* w, size_t row_bytes, const float* x, float* y, int M, int N, int K,
              bool precise_x = false, RowArgmax* argmax = nullptr);

// Where a GEMV's time goes (the decode step's profile, tools/decode_profile.py): added to by gemv_parts_cpu when
// the caller passes one.  busy_ns sums the threads' time inside row kernels; threads * wall_ns - busy_ns is time
// a thread spent starting, waiting at the region's end or taking chunks.
struct GemvStats {
    uint64_t calls = 0, bytes = 0;  // weight bytes read
    uint64_t quant_ns = 0;          // preparing the activations (before the region)
    uint64_t wall_ns = 0;           // the row loop: region start to its last thread's end
    uint64_t busy_ns = 0;           // sum over threads of their time in row kernels
    uint64_t thread_ns = 0;         // sum over regions of threads * wall_ns
};

// One weight matrix of a gemv_parts_cpu call: y [M, N] = x W^T.
struct GemvPart {
    QType t{};
    const uint8_t* w = nullptr;
    size_t row_bytes = 0;
    float* y = nullptr;
    int N = 0;
};
// Several GEMVs over the same x [M, K] (q/k/v, gate/up) in one pass: the activations are prepared once per
// format the parts need, and all parts' rows run in one parallel region split by weight bytes.  Every output
// row is computed by the same row kernel as gemv_cpu's, so the bits are gemv_cpu's.
// argmax (n_parts == 1 only): per row m of x, the RowArgmax of y's row m, found chunk by chunk while each
// thread's outputs are still in its cache.
void gemv_parts_cpu(const GemvPart* parts, int n_parts, const float* x, int M, int K, bool precise_x = false,
                    GemvStats* stats = nullptr, RowArgmax* argmax = nullptr);
// y [M, N] = x W^T for any M >= 1: x's rows go in row-dot calls of up to GEMV_MAX_M rows, each row's bits
// gemv_cpu's in any call (the int8-gemv prefill kernel).  The calls are prepared and run in one parallel region,
// whose tiles take ~32 KiB of a part's weight rows against 128 rows of x, so the weights are read from memory
// once per 128 rows of x and the activations are quantized on every thread.
void gemv_chunks_cpu(const GemvPart* parts, int n_parts, const float* x, int M, int K, bool precise_x = false);

// One-row GEMVs, each over its own matrix and its own activation row, in one parallel region: parts[p].y [N] =
// W_p x[p] (x[p]: K floats).  llama.cpp's MUL_MAT_ID for decode: a token's selected experts (their slices of the
// stacked expert tensors) read in one pass.  Rows given by the same pointer are prepared once (a token's gate and
// up experts share it).  Each output has gemv_cpu's bits for M = 1.
void gemv_each_cpu(const GemvPart* parts, const float* const* x, int n_parts, int K);

// ---- Prefill GEMM on bf16 (csrc/cpu/gemm_amx.cpp) ----------------------------------------------------------
// How mul_mat multiplies above the GEMV's rows.  F32: dequantize tiles + torch's fp32 GEMM (bindings_kernels.cpp).
// Avx512Bf16: vdpbf16ps.  AmxBf16: AMX tiles (TDPBF16PS).  Both bf16 kernels round W (dequantized exactly) and
// x to bf16 and accumulate in fp32: ~3e-3 relative error of y against float64.  Int8Gemv: the decode GEMV's row
// kernels (int8 activations, W read quantized) 8 rows of x at a time, as llama.cpp multiplies on CPUs without
// bf16 units; a row's bits do not depend on the rows beside it, which the fp32 GEMM's row blocking breaks.  Float
// W (F32/F16/BF16) keeps the F32 path under it.
enum class PrefillKernel : int { F32 = 0, Avx512Bf16 = 1, AmxBf16 = 2, Int8Gemv = 3 };
constexpr PrefillKernel PREFILL_KERNELS[] = {PrefillKernel::F32, PrefillKernel::Avx512Bf16, PrefillKernel::AmxBf16,
                                             PrefillKernel::Int8Gemv};
bool cpu_prefill_available(PrefillKernel k);  // compiled in, the CPU has it and the OS enables its state
PrefillKernel cpu_prefill_default();          // AMX, else AVX-512 BF16, else int8 GEMVs on SIMD, else f32
void cpu_set_prefill_kernel(PrefillKernel k);  // caller checked availability
int cpu_prefill_min_rows();                    // mul_mat's rows from which the prefill GEMM beats 8-row GEMVs
const char* cpu_prefill_name(PrefillKernel k);  // "f32", "avx512-bf16", "amx-bf16", "int8-gemv"
// y[m, n] = sum_k x[m, k] * W[n, k]; k available and not F32.  w: N * row_bytes bytes; x: [M, K]; y: [M, N].
void gemm_bf16_cpu(PrefillKernel k, QType t, const uint8_t* w, size_t row_bytes, const float* x, float* y, int M,
                   int N, int K);

// Rows of W to fp32: out[i, :] = W[ids[i], :] (ids == nullptr: all N rows, n_ids = N).  out: [n_ids, K].
void dequantize_rows_cpu(QType t, const uint8_t* w, size_t row_bytes, const int64_t* ids, int64_t n_ids, int K,
                         float* out);

// AutoAWQ "gemm" weights -> AWQ rows (common/blocks.h AwqRow) for the AWQ_G<G> types.  qweight int32 [K, N/8],
// qzeros int32 [K/G, N/8], scales fp16 bits [K/G, N] -> out [N, 3K/G + K/2].  Caller checked G in {32, 64, 128,
// 256}, K % G == 0, N % 8 == 0 and every shape.
void awq_repack_cpu(const int32_t* qweight, const int32_t* qzeros, const uint16_t* scales, int K, int N, int G,
                    uint8_t* out);

// Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K rows w [N, row_bytes] -> the same type interleaved by 8
// (QType::Q*_R8, common/blocks.h) in out (same size).  Caller checked the type, N % 8 == 0 and K % block == 0.
// unpack_rows8_row: row j (< 8) of the group at `group` back to its GGUF blocks (row_bytes at out), the exact
// bytes that were packed.
void repack_rows8_cpu(QType base, const uint8_t* w, int64_t N, int K, uint8_t* out);
void unpack_rows8_row(QType r8, const uint8_t* group, int K, int j, uint8_t* out);

// Sums n bytes as uint64 words with `threads` threads (a streaming read for measuring memory bandwidth).
uint64_t read_sum_cpu(const uint8_t* p, size_t n, int threads);

// ---- Causal attention of T new positions (csrc/cpu/causal_attention.cpp) ------------------------------------
// Queries i < T at positions S - T + i over keys 0..S-1, float32, grouped-query: query head h reads KV head
// h / (H / Hkv); position p sees keys j with max(0, p - window + 1) <= j <= p (window 0: every j <= p).
// out[i, h*hd + c] = sum_j softmax_j(scale * q_i,h . k_j,g) v_j,g[c].  q_i,h at q + i q_row + h q_head, k_j,g at
// k + j k_row + g k_head (likewise v), each hd contiguous floats; out: T rows out_row apart, heads contiguous.
// Caller checked S >= T >= 1, H % Hkv == 0 and that every row fits.
void causal_attention_cpu(const float* q, size_t q_row, size_t q_head, const float* k, size_t k_row, size_t k_head,
                          const float* v, size_t v_row, size_t v_head, float* out, size_t out_row, int T, int S, int H,
                          int Hkv, int hd, float scale, int window);
// ---- One decode token for the llama family and Gemma 3 (csrc/cpu/decode_step.cpp) ------------------------------------
struct DecodeWeight {
    const uint8_t* data = nullptr;  // N rows of row_bytes
    size_t row_bytes = 0;
    QType qtype{};
};
// A low-rank term added to a matrix's output (LoRA adapters, pyllm/lora.py): y[m] += sum_j (A x[m])_j bt[j, :],
// A [rank, K] and bt [rank, N] float32, the adapters' scales already in bt (several adapters: their ranks stacked).
// The token embedding's is looked up instead: row[tok] += sum_j A[tok, j] bt[j, :], A [n_vocab, rank].
// rank 0: none.
struct DecodeLora {
    const float* a = nullptr;
    const float* bt = nullptr;
    int rank = 0;
};
struct DecodeLayer {
    DecodeWeight wq, wk, wv, wo, wgate, wup, wdown;
    DecodeLora lora[7];  // of wq, wk, wv, wo, wgate, wup, wdown, in that order
    const float* attn_norm = nullptr;
    const float* ffn_norm = nullptr;
    const float *bq = nullptr, *bk = nullptr, *bv = nullptr;  // all or none ([H*hd], [Hkv*hd], [Hkv*hd])
    const float *q_norm = nullptr, *k_norm = nullptr;         // both or none ([hd])
    // Gemma-style norms of the attention / MLP output before each residual add (nullptr: none) ([n_embd]).
    const float *post_attn_norm = nullptr, *post_ffw_norm = nullptr;
    int rope = 0;    // 0: cos/sin, 1: cos2/sin2 (Gemma's local layers have their own RoPE base), -1: none
    int window = 0;  // this layer's sliding window (0 = full attention)
    // Mixture of experts (DecodeConfig::n_expert > 0): wgate / wup / wdown are the stacked experts, expert e's rows
    // the slice at data + e * rows * row_bytes (n_ff rows of gate / up, n_embd of down); router [n_expert, n_embd];
    // the shared expert wgate_sh / wup_sh / wdown_sh (n_ff_shexp; data null: none), scaled by sigmoid(h . shexp_gate)
    // where shexp_gate is given ([n_embd]).
    DecodeWeight router, wgate_sh, wup_sh, wdown_sh;
    const float* shexp_gate = nullptr;
    // gpt-oss (nullptr: none): attn_sinks [n_head] each head's sink logit, one more term in its softmax's
    // denominator that carries no value; bo [n_embd] the attention output's bias; the router's bias [n_expert] and
    // the stacked experts' biases, expert e's at e * rows: gate / up [n_expert, n_ff], down [n_expert, n_embd].
    const float* attn_sinks = nullptr;
    const float* bo = nullptr;
    const float *b_router = nullptr, *b_gate_exps = nullptr, *b_up_exps = nullptr, *b_down_exps = nullptr;
};
// ---- KV cache rows (csrc/cpu/kv_rows.cpp) and the decode step's attention over them (csrc/cpu/attention.cpp) ---
// One position of one KV head is a row of head_dim values: fp32, fp16, or head_dim/32 llama.cpp blocks (q8_0:
// fp16 d + 32 int8; q4_0: fp16 d + 16 bytes of nibbles, value = (code - 8) d), as pyllm/runtime/kv_cache.py stores.
enum class KVType : int { F32 = 0, F16 = 1, Q8_0 = 2, Q4_0 = 3 };
size_t kv_row_bytes(KVType t, int hd);
// Keys or values of every layer: row (layer, head, pos) at data + ((layer * n_kv_head + head) * max_seq + pos) *
// row_bytes.  Stored rows are ((x - mu) / s) R^T: mu [n_layer, n_kv_head, hd] or nullptr (not centered), s the
// same shape or nullptr (keys only: queries then attend as (q * s) R^T), R [hd, hd] row-major (orthogonal) or
// nullptr (not rotated).  sink: [n_layer, n_kv_head, hd] float rows holding position 0 exactly (storage basis),
// read by attention instead of the stored row 0, or nullptr.  Why each exists: pyllm/runtime/kv_cache.py.
// Paged (table set): the rows live in a pool of blocks of 2^block_shift positions, (n_blocks, n_layer, n_kv_head,
// 2^block_shift) rows, and position pos of a sequence is row pos % 2^block_shift of block table[pos >> block_shift]
// (pyllm/runtime/kv_pool.py): row (layer, head, pos) at data + (((table[pos >> block_shift] * n_layer + layer) *
// n_kv_head + head) << block_shift) + (pos & (2^block_shift - 1))) * row_bytes.
struct KVPart {
    KVType type = KVType::F16;
    void* data = nullptr;
    size_t row_bytes = 0;
    const float* mu = nullptr;
    const float* rot = nullptr;
    const float* scale = nullptr;
    float* sink = nullptr;
    const int32_t* table = nullptr;  // paged: the sequence's block table (entries < n_blocks), else nullptr
    int block_shift = 0;
    int n_blocks = 0;
};
// Rows of one (layer, head) of a KV part as attention reads them: row j (0-based from the first row read) at
// base + j * stride (contiguous), or, paged, position p = first + j at base + table[p >> shift] * block_stride +
// (p & (2^shift - 1)) * stride, base then pointing at the (layer, head)'s rows in block 0.
struct KVRows {
    const uint8_t* base = nullptr;
    size_t stride = 0;
    const int32_t* table = nullptr;
    size_t block_stride = 0;
    int shift = 0;
    int first = 0;
    inline const uint8_t* at(int j) const {
        if (!table) return base + static_cast<size_t>(j) * stride;
        const int p = first + j;
        return base + static_cast<size_t>(table[p >> shift]) * block_stride +
               static_cast<size_t>(p & ((1 << shift) - 1)) * stride;
    }
};
// Row `pos` of (layer, head) `lh` (= layer * n_kv_head + head, n_lh of them) of part P whose contiguous rows hold
// max_seq positions per (layer, head); and the rows from `pos` on as attention reads them.
inline uint8_t* kv_row(const KVPart& P, size_t lh, size_t n_lh, int max_seq, int pos) {
    uint8_t* d = static_cast<uint8_t*>(P.data);
    if (!P.table) return d + (lh * max_seq + pos) * P.row_bytes;
    const size_t blk = static_cast<size_t>(P.table[pos >> P.block_shift]);
    return d + (((blk * n_lh + lh) << P.block_shift) + (pos & ((1 << P.block_shift) - 1))) * P.row_bytes;
}
inline KVRows kv_rows(const KVPart& P, size_t lh, size_t n_lh, int max_seq, int pos) {
    KVRows r;
    r.stride = P.row_bytes;
    if (!P.table) {
        r.base = kv_row(P, lh, n_lh, max_seq, pos);
        return r;
    }
    r.base = static_cast<const uint8_t*>(P.data) + (lh << P.block_shift) * P.row_bytes;
    r.table = P.table;
    r.block_stride = (n_lh << P.block_shift) * P.row_bytes;
    r.shift = P.block_shift;
    r.first = pos;
    return r;
}
inline KVRows kv_rows_flat(const uint8_t* base, size_t stride) {
    KVRows r;
    r.base = base;
    r.stride = stride;
    return r;
}
// x [hd] (already centered/rotated) -> one stored row; quantization bit-identical to kv_cache.py's.
void kv_store_row(KVType t, const float* x, int hd, void* row);
// y = x R^T (rotate) or y = x R (unrotate); x, y: [hd], distinct.
void kv_rotate(const float* R, const float* x, float* y, int hd, bool transpose);
// One query head over n keys: o[hd] = sum_j softmax_j(scale * q . k_j) v_j, with k_j / v_j the rows
// k_rows.at(j) / v_rows.at(j), all in the storage basis (the caller rotates q and
// un-rotates o).  sc: n floats of scratch.  lse (or nullptr): log sum_j exp(scale * q . k_j), so that the caller
// can merge this softmax with one over other keys.  The scalar reference of kv_attend_group.
void kv_attend_head_scalar(KVType kt, const KVRows& k_rows, KVType vt, const KVRows& v_rows, const float* q, int hd,
                           int n, float scale, float* sc, float* o, float* lse = nullptr);
// G query heads sharing one KV head (GQA): q rows q_stride apart, scores sc rows sc_stride apart (n each),
// outputs o rows o_stride apart; each stored row is read once for the group.  lse: G floats (or nullptr), as
// kv_attend_head_scalar's.  AVX2: q8_0 / q4_0 keys are dotted in integers against the query rounded to q8 blocks
// (llama.cpp's vec_dot_q4_0_q8_0), which the float64 reference in tests/test_decode_step.py reproduces.
void kv_attend_group(KVType kt, const KVRows& k_rows, KVType vt, const KVRows& v_rows, const float* q,
                     size_t q_stride, int G, int hd, int n, float scale, float* sc, size_t sc_stride, float* o,
                     size_t o_stride, float* lse = nullptr);
// One kv_attend_group call's rows and buffers (its G, hd, scale and sc_stride are the pair's).
struct KVAttendRows {
    KVRows k, v;
    const float* q;
    size_t q_stride;
    int n;
    float* sc;
    float* o;
    size_t o_stride;
    float* lse;
};
// Two kv_attend_group calls of one kv type (two sequences' rows), each with the bits it gets alone: the AVX-512
// float kernels interleave the two streams block by block, so one thread has twice the rows in flight (a row pair
// after each layer's weights had passed through the caches: 25-27 -> 19-20 ns in a standalone loop); elsewhere
// the two calls one after the other.
void kv_attend_group_pair(KVType kt, KVType vt, const KVAttendRows& a, const KVAttendRows& b, int G, int hd,
                          float scale, size_t sc_stride);

// The MLP's gate times up (csrc/cpu/glu.cpp): g[i] = act(g[i]) * u[i], act SiLU or (gelu_tanh) torch's
// tanh-approximated GELU.  AVX2: exp from the softmax's polynomial (within 2 ulp of expf), ~8x the scalar libm
// loop, which was ~4% of a small model's decode step.
void glu_cpu(bool gelu_tanh, float* g, const float* u, size_t n);

// Prefill's row operations (csrc/cpu/decode_step.cpp), each row by the decode step's own code, rows split among
// the kernel threads.  rms_norm_rows: y[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w over rows of n (y may be x).
// rope_rows: x [T, H, hd] in place, position t rotated by cos/sin row t ([T, rope_dim / 2] each), pairs (i, i +
// rope_dim / 2) when neox, else (2i, 2i + 1).  glu_rows: glu_cpu on each of rows rows of n.
void rms_norm_rows_cpu(const float* x, const float* w, float* y, int rows, int n, float eps);
void rope_rows_cpu(float* x, int T, int H, int hd, const float* cos, const float* sin, int rope_dim, bool neox);
void glu_rows_cpu(bool gelu_tanh, float* g, const float* u, int rows, int n);

struct DecodeConfig {
    int n_layer = 0, n_embd = 0, n_ff = 0, n_head = 0, n_kv_head = 0, head_dim = 0, n_vocab = 0;
    int rope_dim = 0, max_pos = 0, max_seq = 0;
    bool neox = false;
    bool gelu_tanh = false;  // MLP activation of the gate: SiLU (llama) or tanh-GELU (Gemma)
    float eps = 1e-5f, scale = 1.f;
    float embd_scale = 0.f;     // 0: none; else the embedding row is multiplied by it (Gemma: sqrt(n_embd))
    float final_softcap = 0.f;  // 0: none; else logits = tanh(logits / c) * c
    // Mixture of experts (0 experts: a dense MLP): each row's n_expert_used experts of the router's softmax (its
    // top weights renormalised when norm_top_k), each expert's hidden size n_ff; the shared expert's n_ff_shexp.
    int n_expert = 0, n_expert_used = 0, n_ff_shexp = 0;
    bool norm_top_k = false;
    // softmax_weight: the router's top k logits first, then their softmax (gpt-oss), instead of the top k of the
    // softmax.  swiglu_oai: the routed experts' act(g) * u is gpt-oss's clamped SwiGLU, (min(g, limit) *
    // sigmoid(alpha * min(g, limit))) * (clamp(u, -limit, limit) + 1).
    bool softmax_weight = false, swiglu_oai = false;
    float swiglu_alpha = 0.f, swiglu_limit = 0.f;
};
struct DecodeModel {
    DecodeConfig cfg;
    std::vector<DecodeLayer> layers;
    DecodeWeight token_embd, output;
    DecodeLora token_embd_lora, output_lora;
    const float* output_norm = nullptr;
    const float *cos = nullptr, *sin = nullptr;    // [max_pos, rope_dim/2]
    const float *cos2 = nullptr, *sin2 = nullptr;  // second table (layers with rope == 1), same shape, or nullptr
    KVPart k_cache, v_cache;  // rows (n_layer, n_kv_head, max_seq) of any KVType each
    // A context may hold a contiguous run of a model's layers (one side of a model split between two devices,
    // pyllm/backends/split.py): token_embd.data null where the run starts past the model's first layer, output.data
    // null where it stops before the head; layers and K/V rows are the run's own, numbered from 0.
};
// The part of a model one decode pass runs (DecodeRange{} : the whole context): layers [first_layer, last_layer)
// of the context's (last_layer -1: to its last), entered with the hidden state x_in [M, n_embd] instead of the
// tokens' embedding where x_in is given, and, where !head, leaving the hidden state after last_layer [M, n_embd]
// (every row) in the output instead of the final norm and logits.  A split model crosses each boundary once:
// the hidden state one side leaves is the next side's x_in, bit for bit what the whole model's loop carries.
struct DecodeRange {
    int first_layer = 0, last_layer = -1;
    const float* x_in = nullptr;
    bool head = true;
};
// A decode row's stored keys are attended in up to this many parts, merged by their log-sum-exps.
constexpr int KEY_PARTS_MAX = 4;
// Per-model scratch, allocated once (resize) so a step allocates nothing.
struct DecodeScratch {
    // x, h, q, k, v, att, g, u: GEMV_MAX_M rows each (decode_steps_cpu); tmp: [n_head * 2 * head_dim] (rotations)
    std::vector<float> x, h, q, k, v, att, g, u, scores, tmp;
    std::vector<float> sink;  // [n_head * (head_dim + 3)] per slot: the sink row's output, log-sum-exps, scratch
    std::vector<float> part_o, part_lse;  // a long row's key parts: outputs and log-sum-exps (decode_step.cpp)
    std::vector<float> lora_t;  // [GEMV_MAX_M, the largest LoRA rank]: A x of each row
    // mixture of experts: router logits [M, n_expert], the selected experts' gate / up [M, k, n_ff] and down
    // [M, k, n_embd] rows, the shared expert's gate / up [M, n_ff_shexp] and down [M, n_embd] (decode_step.cpp)
    std::vector<float> moe_logits, moe_g, moe_u, moe_d, sh_g, sh_u, sh_d;
    void resize(const DecodeModel& m);
};
// Where the decode steps' time goes (tools/decode_profile.py): every decode_*_cpu call adds to it while `on`
// (off by default: the timers cost ~1% of a small model's step).
struct DecodeProfile {
    bool on = false;
    uint64_t steps = 0, step_ns = 0;  // calls and their whole time
    uint64_t embed_ns = 0;            // embedding rows
    uint64_t norm_ns = 0;             // RMSNorms, residual adds, biases
    uint64_t attn_ns = 0;             // QK-norm, RoPE, KV store, attention
    uint64_t act_ns = 0;              // SiLU / GELU times up, final softcap
    GemvStats qkv, wo, gate_up, down, output;
};
DecodeProfile& decode_profile_cpu();

// Embeds `token`, runs it at position `pos` through all layers (writing K/V at pos), logits: [n_vocab].
// Caller checked 0 <= token < vocab rows, 0 <= pos < min(max_seq, max_pos).
// argmax (optional): the logits' RowArgmax, one per row of logits.
void decode_step_cpu(const DecodeModel& m, DecodeScratch& s, int64_t token, int pos, float* logits,
                     RowArgmax* argmax = nullptr);
// M (1..GEMV_MAX_M) consecutive tokens at positions pos..pos+M-1 in one pass (each GEMV reads its weights once
// for all rows; K/V stored at every position).  logits: [M, n_vocab] when all_logits, else [n_vocab] (last row).
// Caller checked the tokens and pos + M <= min(max_seq, max_pos).
// range: the layers and ends of the pass (DecodeRange); tokens unused where range.x_in is given.
void decode_steps_cpu(const DecodeModel& m, DecodeScratch& s, const int64_t* tokens, int M, int pos, float* logits,
                      bool all_logits, RowArgmax* argmax = nullptr, const DecodeRange& range = {});

// B (1..GEMV_MAX_M) rows of one or more sequences in one pass: seqs[b] supplies row b's KV cache (k_cache,
// v_cache; every other field is read from seqs[0], whose weights and config all share), tokens[b] goes to
// position pos[b] of it.  logits: [B, n_vocab].  Caller checked the tokens, positions and that the seqs share
// weights, config and max_seq, and that a cache's rows are consecutive rows at consecutive positions (each row
// attends up to its own position, as in decode_steps_cpu).
void decode_batch_cpu(const DecodeModel* const* seqs, DecodeScratch& s, const int64_t* tokens, const int* pos, int B,
                      float* logits, RowArgmax* argmax = nullptr, const DecodeRange& range = {});

// ---- CUDA ------------------------------------------------------------------------------------------------
// The CUDA launchers live in csrc/cuda/cuda_kernels.h (they need cuda_runtime.h for cudaStream_t); their
// bindings register themselves through pyllm::register_cuda (bindings.cpp, under PYLLM_CUDA).

}  // namespace pyllm
