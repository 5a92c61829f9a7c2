"""Backends: where and how a model's kernels run (see base.py for the protocol).

    get("fast")       the CPU extension's kernels (backends/cpu.py)
    get("reference")  float32 torch over weights dequantized by the reference code (backends/reference.py)
    get("cuda")       imports pyllm.backends.cuda on first use and calls its ``create(device=...)``
    split.py          a model's layers split between two of them (--gpu-layers N, as llama.cpp's -ngl)

``select(device, kernels)`` is what ``pyllm.load`` calls: device "cpu" | "cuda" | "cuda:N" | "auto" (CUDA when
torch sees a GPU and the CUDA backend can be created, else the CPU), kernels "fast" | "reference" (the CPU kernel
choice; "reference" always runs on the CPU).  A backend is the object; its ``name`` is the kernels' name.
"""

from __future__ import annotations

import importlib

from ..errors import PyllmError
from .base import Backend, BackendUnavailable, DecodeStep

__all__ = ["Backend", "BackendUnavailable", "DecodeStep", "get", "select", "DEVICES", "CPU_KERNELS"]

DEVICES = ("auto", "cpu", "cuda")
CPU_KERNELS = ("fast", "reference")


def get(name: str, **options) -> Backend:
    """A new backend ``name`` ("fast", "reference", "cuda"). BackendUnavailable says why one cannot run here."""
    if name == "fast":
        from .cpu import CpuBackend

        return CpuBackend(**options)
    if name == "reference":
        from .reference import ReferenceBackend

        return ReferenceBackend(**options)
    if name == "cuda":
        try:
            mod = importlib.import_module(f"{__name__}.cuda")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.cuda":
                raise BackendUnavailable(f"the CUDA backend cannot be imported: {e}") from None
            raise BackendUnavailable("the CUDA backend is not part of this build (pyllm/backends/cuda.py is "
                                     "missing)") from None
        try:
            return mod.create(**options)
        except PyllmError:
            raise
        except Exception as e:  # a torch or driver error while probing the GPU: say it in one line
            raise BackendUnavailable(f"the CUDA backend cannot start: {type(e).__name__}: {e}") from None
    raise PyllmError(f"unknown backend {name!r}; choose one of: fast, reference, cuda")


def check_device(device: str) -> str:
    """``device`` if it names one pyllm knows ("auto", "cpu", "cuda", "cuda:N"), else PyllmError."""
    base, _, index = device.partition(":") if isinstance(device, str) else ("", "", "")
    if base not in DEVICES or (index and (base != "cuda" or not index.isdigit())):
        raise PyllmError(f"device must be one of {', '.join(DEVICES)} (or cuda:N), got {device!r}")
    return device


def check_kernels(kernels: str) -> str:
    if kernels not in CPU_KERNELS:
        raise PyllmError(f"kernels must be 'fast' or 'reference', got {kernels!r}")
    return kernels


def select(device: str = "cpu", kernels: str = "fast", n_threads: int | None = None,
           gpu_layers: int | None = None) -> Backend:
    """The backend ``pyllm.load(device=, kernels=)`` runs on; see the module docstring. A device that cannot run
    raises BackendUnavailable naming why ("auto" never raises: it falls back to the CPU).  ``gpu_layers`` other than
    None and 0 (checked by split.check_gpu_layers): the backend of the GPU's layers, which split.place combines with
    the CPU's once the model's layer count is known."""
    check_device(device)
    check_kernels(kernels)
    if gpu_layers:
        return gpu_side(device, gpu_layers)
    if device.startswith("cuda"):
        if kernels == "reference":
            raise PyllmError("kernels 'reference' run on the CPU (float32 torch); use device='cpu' with them, or "
                             "kernels='fast' on CUDA")
        import torch

        if not torch.cuda.is_available():
            why = ("this torch has no CUDA support" if torch.version.cuda is None
                   else "torch sees no GPU (torch.cuda.is_available() is False)")
            raise BackendUnavailable(f"device {device!r} is not available: {why}")
        return get("cuda", device=device)
    if device == "auto" and kernels == "fast":
        import torch

        from .split import standin

        if standin():  # the GPU's stand-in (split.py), which split.place fills as it would a GPU
            return gpu_side(device, -1)
        if torch.cuda.is_available():
            try:
                return get("cuda", device="cuda")
            except BackendUnavailable:
                pass
    return get(kernels, n_threads=n_threads) if kernels == "fast" else get(kernels)


def gpu_side(device: str, gpu_layers: int) -> Backend:
    """The backend that runs a placement's GPU layers: CUDA on ``device`` ("auto" is "cuda"), or the CPU backend
    PYLLM_GPU_STANDIN names standing in for it (split.py).  BackendUnavailable names gpu_layers and why there is no
    GPU."""
    from .split import gpu_problem, standin, standin_backend

    name = standin()
    if name:
        return standin_backend(name)
    why = gpu_problem(device)
    if why is None:
        try:
            return get("cuda", device="cuda" if device == "auto" else device)
        except BackendUnavailable as e:
            why = str(e)
    raise BackendUnavailable(f"gpu_layers={gpu_layers} puts layers on a GPU, but {why}; use gpu_layers=0 (the CPU)")
