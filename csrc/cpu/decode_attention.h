// What the decode step's two files share (decode_step.cpp: the layer loop; decode_attention.cpp: its attention
// stage).  No torch here.
#pragma once

#include <cstddef>

#include "kernels.h"

namespace pyllm {

// sum a[i] b[i] in 8 float partial sums (one running sum is a chain of dependent adds; these vectorize).
inline float dot8(const float* a, const float* b, int n) {
    float part[8] = {};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; ++l) part[l] += a[i + l] * b[i + l];
    for (; i < n; ++i) part[i & 7] += a[i] * b[i];
    return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

// The attention stage of a decode pass's layer: every row r of the pass (M of them, at position pos_of[r], its
// cache's K and V parts caches[2r], caches[2r + 1], their rows of this layer from (layer, head) index lrow on, the
// row's K/V already stored) attends over its cache's keys: s.q -> s.att, on up to nt threads.
void attend_rows(const DecodeConfig& c, const DecodeLayer& L, DecodeScratch& s, int M, const int* pos_of,
                 const KVPart* const* caches, size_t lrow, int nt);

}  // namespace pyllm
