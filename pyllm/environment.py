"""Every environment variable pyllm reads, with its default and meaning: the one list.

The readers stay where the values are used (the C++ kernels read theirs with getenv), but each name they read is
listed here. tests/test_environment.py checks that every ``PYLLM_*`` name read in pyllm/ or csrc/ is listed, and that
the README's table shows each listed variable. `pyllm --help` prints the user-facing ones.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Variable:
    name: str
    default: str
    meaning: str
    user: bool = True  # shown by `pyllm --help`; False: switches for measuring and debugging the kernels


VARIABLES = (
    Variable("PYLLM_CACHE_DIR", "$XDG_CACHE_HOME/pyllm, else ~/.cache/pyllm",
             "where models and the compiled extension are cached"),
    Variable("PYLLM_HF_ENDPOINT", "$HF_ENDPOINT, else https://huggingface.co",
             "the Hugging Face endpoint (or mirror) for hf.co/... pulls"),
    Variable("PYLLM_API_KEY", "none", "serve's API key when --api-key is not given"),
    Variable("PYLLM_ARG_<FLAG>", "none",
             "serve's default for --<flag> (PYLLM_ARG_PORT, PYLLM_ARG_CTX, PYLLM_ARG_MODEL, ...), as llama-server's "
             "LLAMA_ARG_*; the command line wins"),
    Variable("PYLLM_ISA", "the best this CPU runs",
             "force the CPU kernels' instruction set: scalar, avx2, avx512 or amx (an error where it cannot run)"),
    Variable("PYLLM_REPACK", "1", "0: no rows-by-8 copy of the weights for decoding (saves their size in RAM)"),
    Variable("PYLLM_VERBOSE_BUILD", "0", "1: show the compiler's own output while the extension builds"),
    Variable("PYLLM_NO_EXT", "0", "1: never build or load the extension (torch reference kernels only)", user=False),
    Variable("PYLLM_ROWS8_PAIRS", "1, 0 on AMD CPUs",
             "0 or 1: the AVX-512 decode GEMVs on one 8-row group per register or two (the same bits; two are "
             "faster on Intel's cores, slower on AMD Zen 4)", user=False),
    Variable("PYLLM_CUDA_GRAPH", "1", "0: run the CUDA decode step eagerly, without CUDA graphs", user=False),
    Variable("PYLLM_CUDA_ROW_KERNELS", "1", "0: the CUDA decode step in torch ops instead of its row kernels",
             user=False),
    Variable("PYLLM_CUDA_GEMV_ROWS", "4", "1 or 2: fewer weight rows per CTA in the CUDA decode GEMV", user=False),
    Variable("PYLLM_CUDA_TILED", "1",
             "0: weights stay in GGUF order (AWQ: its rows) on the GPU and decode through the row-per-CTA GEMV, not "
             "the tiled one (A/B)", user=False),
    Variable("PYLLM_CUDA_MMQ", "1",
             "0: CUDA prompt chunks dequantize the weights to fp16 for cuBLAS instead of the int8 tensor-core kernel "
             "(A/B)", user=False),
    Variable("PYLLM_CUDA_PDL", "0", "1: programmatic dependent launches in the CUDA step (not yet measured)",
             user=False),
    Variable("PYLLM_GPU_STANDIN", "none",
             "reference or fast: that CPU backend runs the GPU's layers of --gpu-layers / gpu_layers=, to test the "
             "placement on a host without a GPU", user=False),
    Variable("PYLLM_GPU_STANDIN_FREE", "the host's available memory",
             "the free memory --device auto sees on PYLLM_GPU_STANDIN's stand-in GPU (512M, 2G, bytes), to test "
             "how it places a model larger than the GPU", user=False),
)

# Read by the test suite and its tools only.
TEST_VARIABLES = (
    Variable("PYLLM_TEST_SEED", "from the clock",
             "the seed of the kernel tests' random inputs (each failure prints it)", user=False),
    Variable("PYLLM_SLOW", "0", "1: also run the slowest end-to-end checks", user=False),
    Variable("PYLLM_FUZZ_SELFTEST", "none", "tools/fuzz_gguf.py's self-test: the faults it plants, as the test sets "
             "them", user=False),
    Variable("PYLLM_TEST_CHAT_BACKEND", "fast", "the CPU backend of the chat REPL tests", user=False),
    Variable("PYLLM_TEST_ARTIFACTS", "tests/artifacts", "where the browser tests keep their screenshots", user=False),
)


def help_text(width: int = 110) -> str:
    """The user-facing variables as `pyllm --help` lists them: name, then the meaning and default, wrapped."""
    import textwrap

    name_col = 2 + max(len(v.name) for v in VARIABLES if v.user) + 1
    lines = []
    for v in VARIABLES:
        if v.user:
            lines += textwrap.wrap(f"{v.meaning} (default: {v.default})", width,
                                   initial_indent=f"  {v.name}".ljust(name_col), subsequent_indent=" " * name_col)
    return "\n".join(lines)
