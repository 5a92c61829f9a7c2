"""AWQ checkpoints (a Hugging Face folder, AutoAWQ "gemm" layout) -> the same ModelConfig / weights / tokenizer /
chat template the GGUF path produces, so the one Transformer runs them unchanged.

Format (AutoAWQ "gemm" checkpoints). For a linear layer with K = in_features, N = out_features, G = group size:
``qweight`` int32 [K, N/8] (eight nibbles per word packed along N; nibble i of word c is column 8c + ORDER[i],
ORDER = [0,2,4,6,1,3,5,7]), ``qzeros`` int32 [K/G, N/8] packed the same way, ``scales`` fp16 [K/G, N];
W^T = (q - z) * s. Only "gemm" with zero points is supported; gemv / gemv_fast / marlin / exllama / ipex and
symmetric (zero_point=false) checkpoints are rejected with a message saying so.

Safetensors shards are memory-mapped privately (a header parse + zero-copy views, like gguf.py): nothing is read
until a weight is used. Non-quantized tensors (embeddings, norms, lm_head, ``modules_to_not_convert``) become
float QTensors (F16/BF16/F32), so the GGUF kernels handle them.

HF llama checkpoints are not row-permuted the way llama-arch GGUFs are, so every HF architecture here uses the
"neox" (half-split) rotation.

The modules, one job each (their errors are pyllm.errors.AWQError):
  folder.py     the folder as a Checkpoint (open_awq, read_awq) and as `pyllm info` describes it (folder_info)
  config.py     config.json's checks: the quantization_config pyllm reads, the architecture's ModelConfig
  shards.py     the safetensors shards, mapped privately, every header entry checked
  weights.py    Hugging Face module names -> GGUF tensor names; the folder's tensors, quantized ones packed
  unpack.py     AWQTensor: one linear's packed int4 weight, unpacked and dequantized
  repack.py     AWQRows: that weight repacked into the extension's CPU row layout
  tokenizer.py  the folder's tokenizer.json / tokenizer_config.json and chat template
"""
