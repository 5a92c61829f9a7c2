"""Architecture name -> model: every decoder architecture is the one Transformer (transformer.py) over its ArchSpec
(spec.py); a family is a spec entry plus, where its files store tensors differently, a weight adapter.  Embedding
encoders (the BERT family) are the one Encoder (encoder.py) over its EncoderSpec (encoder_spec.py).  The names and
specs are plain data; the bodies (torch) are imported when a model is built, so a header is described without them."""

from __future__ import annotations

from ..errors import ModelError
from .config import ModelConfig
from .encoder_spec import ENCODERS, EncoderSpec
from .spec import ARCHITECTURES as DECODERS
from .spec import ArchSpec

ARCHITECTURES = tuple(sorted(DECODERS + ENCODERS))  # every general.architecture a model can be built for


def body_class(arch: str):
    """The body that runs architecture ``arch``: Encoder or Transformer; ModelError for one pyllm has no body for."""
    if arch in ENCODERS:
        from .encoder import Encoder
        return Encoder
    if arch in DECODERS:
        from .transformer import Transformer
        return Transformer
    raise ModelError(f"unsupported architecture {arch!r} (general.architecture); "
                     f"supported: {', '.join(ARCHITECTURES)}")


def model_class(cfg: ModelConfig):
    """body_class(cfg.arch), once its spec accepts ``cfg``: a value no body runs (e.g. attention soft-capping) is a
    ModelError here, before any weight is read."""
    cls = body_class(cfg.arch)
    (EncoderSpec if cfg.arch in ENCODERS else ArchSpec).from_config(cfg)
    return cls


def build_model(cfg: ModelConfig, weights: dict, backend, max_pos: int, progress: bool = False):
    """The decoder for ``cfg`` over ``weights`` (GGUF names -> QTensors), run by ``backend`` (pyllm/backends),
    which prepares the weights once here (CUDA: uploads them)."""
    cls = model_class(cfg)
    weights = backend.prepare_weights(cls.arrange_weights(cfg, weights), progress=progress)
    return cls(cfg, weights, backend, max_pos)
