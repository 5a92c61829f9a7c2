// GGML tensor type ids (the numbers stored in GGUF files) and their block traits.
//
// One enum mirrors pyllm.gguf.GGMLType so C++ never switches on magic integers; qtype_traits() is the one
// table every size check and every error message reads.  Types the kernels do not handle still have a row
// here (name, sizes) so that errors can say "IQ2_XXS is not supported" instead of "type 16".
//
// Ids 56..59 are pyllm's own (no GGUF file holds them; GGML's ids stay far below): AWQ int4 weights repacked at
// load into a row layout for the CPU kernels (AWQ_G32 ... AWQ_G256, one id per group size G; the layout is in
// blocks.h, the repacker in csrc/cpu/awq_repack.cpp, the Python side in pyllm/awq.py).  In the traits a "block" is one
// group: G elements in G/2 + 3 bytes (nibbles, an fp16 scale, a u8 zero), so row bytes, shape checks and the
// gemv / mul_mat / dequantize / decode_step dispatch work for them unchanged.
//
// Ids 60..63 are pyllm's too: Q4_0, Q4_1, Q5_0 and Q5_1 rows interleaved by 8 (Q4_0_R8 ... Q5_1_R8), a copy the
// CPU decode step makes at load so that its GEMVs read 8 rows' blocks as one (layout in blocks.h, repacker in
// csrc/cpu/rows8.cpp).  Same bytes per row as the GGUF type, but a row is only addressable within its group of
// 8: the tensor's row count must be a multiple of 8, and kernels take them in whole groups.  Ids 64..66 are the
// same for Q4_K, Q5_K and Q6_K (Q4_K_R8 ... Q6_K_R8), 256-element super-blocks of 8 rows; id 67 (Q8_0_R8) is
// Q8_0's: the layer matrices' and the output projection's copy, same rules.
//
// Ids 68..71 (Q4_0_TILED, Q8_0_TILED, Q4_K_TILED, Q6_K_TILED) are the CUDA decode GEMV's layout of those types, made
// at upload in place of the GGUF rows (csrc/common/gemv_tiled.h): tiles of 8 rows, same bytes per row, the row
// count a multiple of 8; only the CUDA kernels read them.  Ids 72..75 (AWQ_G32_TILED ... AWQ_G256_TILED) are the
// same layout made from AWQ rows, one id per group size, with the AWQ type's traits.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pyllm {

enum class QType : int {
    F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9,
    Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_K = 15,
    IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22, IQ4_XS = 23,
    I8 = 24, I16 = 25, I32 = 26, I64 = 27, F64 = 28, IQ1_M = 29, BF16 = 30, MXFP4 = 39,
    AWQ_G32 = 56, AWQ_G64 = 57, AWQ_G128 = 58, AWQ_G256 = 59,  // pyllm-internal (see above)
    Q4_0_R8 = 60, Q4_1_R8 = 61, Q5_0_R8 = 62, Q5_1_R8 = 63,    // pyllm-internal (see above)
    Q4_K_R8 = 64, Q5_K_R8 = 65, Q6_K_R8 = 66, Q8_0_R8 = 67,    // reserved for the same layout of these types
    Q4_0_TILED = 68, Q8_0_TILED = 69, Q4_K_TILED = 70, Q6_K_TILED = 71,  // pyllm-internal, CUDA only (see above)
    AWQ_G32_TILED = 72, AWQ_G64_TILED = 73, AWQ_G128_TILED = 74, AWQ_G256_TILED = 75,  // likewise
};

// Every type id (GGML's and pyllm's) is below this: the size of the tables indexed by id.
constexpr int QTYPE_ID_LIMIT = 76;

// The AWQ type id for group size G, or -1 when G has no CPU layout.
inline int awq_qtype_id(int G) {
    switch (G) {
        case 32: return static_cast<int>(QType::AWQ_G32);
        case 64: return static_cast<int>(QType::AWQ_G64);
        case 128: return static_cast<int>(QType::AWQ_G128);
        case 256: return static_cast<int>(QType::AWQ_G256);
        default: return -1;
    }
}

// Rows-by-8 layouts: the interleaved id of a GGUF type, and back (-1 / the id itself where there is none).
inline int rows8_qtype_id(int base) {
    switch (static_cast<QType>(base)) {
        case QType::Q4_0: return static_cast<int>(QType::Q4_0_R8);
        case QType::Q4_1: return static_cast<int>(QType::Q4_1_R8);
        case QType::Q5_0: return static_cast<int>(QType::Q5_0_R8);
        case QType::Q5_1: return static_cast<int>(QType::Q5_1_R8);
        case QType::Q8_0: return static_cast<int>(QType::Q8_0_R8);
        case QType::Q4_K: return static_cast<int>(QType::Q4_K_R8);
        case QType::Q5_K: return static_cast<int>(QType::Q5_K_R8);
        case QType::Q6_K: return static_cast<int>(QType::Q6_K_R8);
        default: return -1;
    }
}
inline bool is_rows8(QType t) { return t >= QType::Q4_0_R8 && t <= QType::Q8_0_R8; }
inline QType rows8_base(QType t) {
    switch (t) {
        case QType::Q4_0_R8: return QType::Q4_0;
        case QType::Q4_1_R8: return QType::Q4_1;
        case QType::Q5_0_R8: return QType::Q5_0;
        case QType::Q5_1_R8: return QType::Q5_1;
        case QType::Q8_0_R8: return QType::Q8_0;
        case QType::Q4_K_R8: return QType::Q4_K;
        case QType::Q5_K_R8: return QType::Q5_K;
        case QType::Q6_K_R8: return QType::Q6_K;
        default: return t;
    }
}

constexpr int QK = 32;     // elements per block of the "legacy" types (Q4_0 ... Q8_0)
constexpr int QK_K = 256;  // elements per super-block of the K-quants

struct QTypeTraits {
    const char* name;
    int block_size;  // elements per block (1 for plain float types)
    int type_size;   // bytes per block
    bool cpu;        // handled by the CPU kernels (gemv, dequantize)
};

// nullptr for ids that are not GGML types at all.
inline const QTypeTraits* qtype_traits(int id) {
    static const QTypeTraits F32_{"F32", 1, 4, true}, F16_{"F16", 1, 2, true}, BF16_{"BF16", 1, 2, true},
        Q4_0_{"Q4_0", QK, 18, true}, Q4_1_{"Q4_1", QK, 20, true}, Q5_0_{"Q5_0", QK, 22, true},
        Q5_1_{"Q5_1", QK, 24, true}, Q8_0_{"Q8_0", QK, 34, true}, Q8_1_{"Q8_1", QK, 36, false},
        Q2_K_{"Q2_K", QK_K, 84, true}, Q3_K_{"Q3_K", QK_K, 110, true}, Q4_K_{"Q4_K", QK_K, 144, true},
        Q5_K_{"Q5_K", QK_K, 176, true}, Q6_K_{"Q6_K", QK_K, 210, true}, Q8_K_{"Q8_K", QK_K, 292, false},
        IQ2_XXS_{"IQ2_XXS", QK_K, 66, false}, IQ2_XS_{"IQ2_XS", QK_K, 74, false},
        IQ3_XXS_{"IQ3_XXS", QK_K, 98, false}, IQ1_S_{"IQ1_S", QK_K, 50, false},
        IQ4_NL_{"IQ4_NL", QK, 18, false}, IQ3_S_{"IQ3_S", QK_K, 110, false}, IQ2_S_{"IQ2_S", QK_K, 82, false},
        IQ4_XS_{"IQ4_XS", QK_K, 136, false}, I8_{"I8", 1, 1, false}, I16_{"I16", 1, 2, false},
        I32_{"I32", 1, 4, false}, I64_{"I64", 1, 8, false}, F64_{"F64", 1, 8, false},
        IQ1_M_{"IQ1_M", QK_K, 56, false}, AWQ_G32_{"AWQ_G32", 32, 19, true}, AWQ_G64_{"AWQ_G64", 64, 35, true},
        AWQ_G128_{"AWQ_G128", 128, 67, true}, AWQ_G256_{"AWQ_G256", 256, 131, true},
        Q4_0_R8_{"Q4_0_R8", QK, 18, true}, Q4_1_R8_{"Q4_1_R8", QK, 20, true}, Q5_0_R8_{"Q5_0_R8", QK, 22, true},
        Q5_1_R8_{"Q5_1_R8", QK, 24, true}, Q4_K_R8_{"Q4_K_R8", QK_K, 144, true},
        Q5_K_R8_{"Q5_K_R8", QK_K, 176, true}, Q6_K_R8_{"Q6_K_R8", QK_K, 210, true};
    static const QTypeTraits Q8_0_R8_{"Q8_0_R8", QK, 34, true}, MXFP4_{"MXFP4", QK, 17, true};
    static const QTypeTraits Q4_0_TILED_{"Q4_0_TILED", QK, 18, false}, Q8_0_TILED_{"Q8_0_TILED", QK, 34, false},
        Q4_K_TILED_{"Q4_K_TILED", QK_K, 144, false}, Q6_K_TILED_{"Q6_K_TILED", QK_K, 210, false};
    static const QTypeTraits AWQ_G32_TILED_{"AWQ_G32_TILED", 32, 19, false},
        AWQ_G64_TILED_{"AWQ_G64_TILED", 64, 35, false}, AWQ_G128_TILED_{"AWQ_G128_TILED", 128, 67, false},
        AWQ_G256_TILED_{"AWQ_G256_TILED", 256, 131, false};
    switch (static_cast<QType>(id)) {
        case QType::F32: return &F32_;
        case QType::F16: return &F16_;
        case QType::BF16: return &BF16_;
        case QType::Q4_0: return &Q4_0_;
        case QType::Q4_1: return &Q4_1_;
        case QType::Q5_0: return &Q5_0_;
        case QType::Q5_1: return &Q5_1_;
        case QType::Q8_0: return &Q8_0_;
        case QType::Q8_1: return &Q8_1_;
        case QType::Q2_K: return &Q2_K_;
        case QType::Q3_K: return &Q3_K_;
        case QType::Q4_K: return &Q4_K_;
        case QType::Q5_K: return &Q5_K_;
        case QType::Q6_K: return &Q6_K_;
        case QType::Q8_K: return &Q8_K_;
        case QType::IQ2_XXS: return &IQ2_XXS_;
        case QType::IQ2_XS: return &IQ2_XS_;
        case QType::IQ3_XXS: return &IQ3_XXS_;
        case QType::IQ1_S: return &IQ1_S_;
        case QType::IQ4_NL: return &IQ4_NL_;
        case QType::IQ3_S: return &IQ3_S_;
        case QType::IQ2_S: return &IQ2_S_;
        case QType::IQ4_XS: return &IQ4_XS_;
        case QType::I8: return &I8_;
        case QType::I16: return &I16_;
        case QType::I32: return &I32_;
        case QType::I64: return &I64_;
        case QType::F64: return &F64_;
        case QType::IQ1_M: return &IQ1_M_;
        case QType::MXFP4: return &MXFP4_;
        case QType::AWQ_G32: return &AWQ_G32_;
        case QType::AWQ_G64: return &AWQ_G64_;
        case QType::AWQ_G128: return &AWQ_G128_;
        case QType::AWQ_G256: return &AWQ_G256_;
        case QType::Q4_0_R8: return &Q4_0_R8_;
        case QType::Q4_1_R8: return &Q4_1_R8_;
        case QType::Q5_0_R8: return &Q5_0_R8_;
        case QType::Q5_1_R8: return &Q5_1_R8_;
        case QType::Q8_0_R8: return &Q8_0_R8_;
        case QType::Q4_K_R8: return &Q4_K_R8_;
        case QType::Q5_K_R8: return &Q5_K_R8_;
        case QType::Q6_K_R8: return &Q6_K_R8_;
        case QType::Q4_0_TILED: return &Q4_0_TILED_;
        case QType::Q8_0_TILED: return &Q8_0_TILED_;
        case QType::Q4_K_TILED: return &Q4_K_TILED_;
        case QType::Q6_K_TILED: return &Q6_K_TILED_;
        case QType::AWQ_G32_TILED: return &AWQ_G32_TILED_;
        case QType::AWQ_G64_TILED: return &AWQ_G64_TILED_;
        case QType::AWQ_G128_TILED: return &AWQ_G128_TILED_;
        case QType::AWQ_G256_TILED: return &AWQ_G256_TILED_;
    }
    return nullptr;
}

inline const char* qtype_name(QType t) {
    const QTypeTraits* tr = qtype_traits(static_cast<int>(t));
    return tr ? tr->name : "unknown";
}

// Bytes one row of K elements occupies; K must be a multiple of the block size.
inline size_t qtype_row_bytes(QType t, int64_t K) {
    const QTypeTraits* tr = qtype_traits(static_cast<int>(t));
    return static_cast<size_t>(K / tr->block_size) * static_cast<size_t>(tr->type_size);
}

}  // namespace pyllm
