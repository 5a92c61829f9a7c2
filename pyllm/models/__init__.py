"""Architecture name -> model: every decoder architecture is the one Transformer (transformer.py) over its ArchSpec
(spec.py); a family is a spec entry plus, where its files store tensors differently, a weight adapter.  Embedding
encoders (the BERT family) are the one Encoder (encoder.py) over its EncoderSpec."""

from __future__ import annotations

from ..errors import ModelError
from .config import ModelConfig
from .encoder import ENCODERS, Encoder, EncoderSpec
from .spec import ARCHITECTURES as _NAMES
from .spec import ArchSpec
from .transformer import Transformer

ARCHITECTURES = {name: Transformer for name in _NAMES}
ARCHITECTURES.update({name: Encoder for name in ENCODERS})


def model_class(cfg: ModelConfig):
    cls = ARCHITECTURES.get(cfg.arch)
    if cls is None:
        raise ModelError(f"unsupported architecture {cfg.arch!r} (general.architecture); "
                         f"supported: {', '.join(sorted(ARCHITECTURES))}")
    # a value no body runs (e.g. attention soft-capping) fails here, before the weights
    (EncoderSpec if cls is Encoder else ArchSpec).from_config(cfg)
    return cls


def build_model(cfg: ModelConfig, weights: dict, backend, max_pos: int, progress: bool = False):
    """The decoder for ``cfg`` over ``weights`` (GGUF names -> QTensors), run by ``backend`` (pyllm/backends),
    which prepares the weights once here (CUDA: uploads them)."""
    cls = model_class(cfg)
    weights = backend.prepare_weights(cls.arrange_weights(cfg, weights), progress=progress)
    return cls(cfg, weights, backend, max_pos)
