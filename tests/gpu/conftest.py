"""tests/gpu: CUDA kernel and backend tests. Every test here is skipped (at collection, without building
anything) when torch sees no CUDA device -- that alone, never a kernel that failed to build (that fails) -- so
the CPU suite collects them in well under a second."""

from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def K():
    """The extension with its CUDA kernels.  On a machine with a GPU, kernels that did not build FAIL every test
    that needs them (never a skip): the point of this suite is to prove they run."""
    from pyllm import _ext

    problem = _ext.cuda_build_problem()
    assert problem is None, f"the CUDA kernels are not built here: {problem}"
    mod = _ext.load()
    assert hasattr(mod, "cuda_gemv"), "pyllm._C was built without its CUDA kernels"
    return mod
