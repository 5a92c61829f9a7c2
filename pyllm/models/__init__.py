"""Architecture name -> decoder class. The llama family shares one decoder; others get a small file each."""

from __future__ import annotations

from ..errors import ModelError
from .config import ModelConfig
from .gemma3 import Gemma3Model
from .llama import LlamaModel
from .phi3 import Phi3Model

ARCHITECTURES = {
    "llama": LlamaModel,
    "mistral": LlamaModel,
    "qwen2": LlamaModel,
    "qwen3": LlamaModel,
    "gemma3": Gemma3Model,
    "phi3": Phi3Model,
}


def model_class(cfg: ModelConfig):
    cls = ARCHITECTURES.get(cfg.arch)
    if cls is None:
        raise ModelError(f"unsupported architecture {cfg.arch!r} (general.architecture); "
                         f"supported: {', '.join(sorted(ARCHITECTURES))}")
    return cls


def build_model(cfg: ModelConfig, weights: dict, backend, max_pos: int, progress: bool = False):
    """The decoder for ``cfg`` over ``weights`` (GGUF names -> QTensors), run by ``backend`` (pyllm/backends),
    which prepares the weights once here (CUDA: uploads them)."""
    cls = model_class(cfg)
    weights = backend.prepare_weights(cls.arrange_weights(cfg, weights), progress=progress)
    return cls(cfg, weights, backend, max_pos)
