// ArchSpec (pyllm/models/spec.py) as the fused steps read it: the C++ step (csrc/cpu/decode_step.cpp, through
// csrc/bindings_decode_context.cpp) and the CUDA step's row kernels (csrc/cuda/step.cu).  Defined once, here;
// filled once, by the binding's checked constructor (make_decode_arch in csrc/bindings_decode_context.cpp,
// pyllm's ``C.DecodeArch``), which checks every field with an error naming it, so neither side re-reads a loose
// argument or a string.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace pyllm {

// The scalar fields, as ArchSpec names them.  Plain data: a CUDA kernel takes it by value.
struct ArchDims {
    int64_t n_layer = 0, n_embd = 0, n_ff = 0, n_head = 0, n_kv_head = 0, head_dim = 0, rope_dim = 0;
    bool neox = false, qkv_bias = false, qk_norm = false, post_norms = false, gelu_tanh = false;
    double rms_eps = 0, attn_scale = 0, embd_scale = 0, final_softcap = 0;
    int64_t n_rope = 1;  // rope tables: 1 + the largest layer_rope entry
    // mixture of experts (n_expert 0: a dense MLP; then n_ff is each expert's hidden size)
    int64_t n_expert = 0, n_expert_used = 0, n_ff_shexp = 0;
    bool shexp_gate = false, norm_top_k = false;
    // gpt-oss: a learned sink logit per head in each attention softmax; a bias after the attention output and on
    // the router and every expert matrix; the routed experts' clamped SwiGLU (swiglu_oai, with its alpha and
    // limit); the router's softmax over its top k logits (ArchSpec expert_gating "softmax_weight").  Read by the
    // C++ step; the CUDA step refuses such models (ArchSpec.fused_step_gaps("cuda")).
    bool attn_sinks = false, attn_out_bias = false, expert_bias = false, swiglu_oai = false, softmax_weight = false;
    double swiglu_alpha = 0, swiglu_limit = 0;
};

// Host and device code see one layout (kernel arguments are copied as bytes): a field added, removed or moved
// fails here first, where both compilers read it.
static_assert(std::is_trivially_copyable<ArchDims>::value && std::is_standard_layout<ArchDims>::value,
              "ArchDims must stay plain data: CUDA kernels take it by value");
static_assert(offsetof(ArchDims, rope_dim) == 48 && offsetof(ArchDims, neox) == 56 &&
                  offsetof(ArchDims, rms_eps) == 64 && offsetof(ArchDims, final_softcap) == 88 &&
                  offsetof(ArchDims, n_rope) == 96 && offsetof(ArchDims, n_ff_shexp) == 120 &&
                  offsetof(ArchDims, norm_top_k) == 129 && offsetof(ArchDims, softmax_weight) == 134 &&
                  offsetof(ArchDims, swiglu_alpha) == 136 && sizeof(ArchDims) == 152,
              "ArchDims layout changed: update the offsets here and every reader of the struct");

// The whole spec: the scalars plus what varies per layer.
struct DecodeArch : ArchDims {
    std::vector<int64_t> layer_rope;    // per layer: its rope table (index into the model's; -1: none, a NoPE layer)
    std::vector<int64_t> layer_window;  // per layer: its sliding window (0: none)
};

}  // namespace pyllm
