// Host-run decoding of stored KV-cache rows with the CUDA attention's own reader (csrc/cuda/kv_rows.cuh), for
// machines with nvcc but no GPU: tests/test_cuda_host.py builds this, writes rows with pyllm/runtime/kv_cache.py's
// quantizers, and compares what this prints back with kv_cache.py's dequantizers.
//   kv_rows_host_check TYPE HD N IN OUT: TYPE the KVRow id, IN N rows of kv_row_size(TYPE, HD) bytes,
//   OUT N * HD float32 values.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/kv_rows.cuh"

using namespace pyllm;

int main(int argc, char** argv) {
    if (argc != 6) {
        std::fprintf(stderr, "usage: %s TYPE HD N IN OUT\n", argv[0]);
        return 2;
    }
    const KVRow t = static_cast<KVRow>(std::atoi(argv[1]));
    const int hd = std::atoi(argv[2]), n = std::atoi(argv[3]);
    const size_t rb = kv_row_size(t, hd);
    std::vector<uint8_t> rows(rb * n);
    std::vector<float> out(static_cast<size_t>(hd) * n);
    FILE* f = std::fopen(argv[4], "rb");
    if (!f || std::fread(rows.data(), 1, rows.size(), f) != rows.size()) return 3;
    std::fclose(f);
    for (int r = 0; r < n; ++r)
        for (int i = 0; i < hd; i += 2) {
            const float2 p = cuda::kv_row_pair(t, rows.data() + r * rb, i);
            out[static_cast<size_t>(r) * hd + i] = p.x;
            out[static_cast<size_t>(r) * hd + i + 1] = p.y;
        }
    f = std::fopen(argv[5], "wb");
    if (!f || std::fwrite(out.data(), sizeof(float), out.size(), f) != out.size()) return 4;
    std::fclose(f);
    return 0;
}
