"""tests/gpu: CUDA kernel and backend tests. Every test here is skipped (at collection, without building
anything) when torch sees no CUDA device, so the CPU suite collects them in well under a second."""

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
    """The CUDA kernel module (pyllm._C with CUDA, or the standalone pyllm_cuda build)."""
    from pyllm import cuda_backend

    return cuda_backend.kernels()
