// What the decode binding files share: DecodeContext, built and checked by bindings_decode_context.cpp and run by
// the steps in bindings_decode.cpp.  Only the binding files include this header.
#pragma once

#include <vector>

#include "bindings_checks.h"

namespace pyllm {
namespace bind {

// A model (or a run of its layers), its KV cache and the step's scratch, for the C++ decode step
// (csrc/cpu/decode_step.cpp).  It holds the raw pointers plus references to every tensor they point into (so the
// storage lives as long as the context); everything is checked once, when it is built.
struct DecodeContext {
    pyllm::DecodeModel model;
    pyllm::DecodeScratch scratch;
    std::vector<Tensor> keep;
    int64_t vocab_rows = 0;
};

}  // namespace bind
}  // namespace pyllm
