"""What a model file reader produces: one value that ``pyllm.llm.from_checkpoint`` turns into an LLM.

Readers (each a file format): ``read_gguf`` here, ``pyllm.formats.awq.folder.read_awq`` for AWQ folders. They know nothing of
backends, caches or generation, and nothing below them imports the LLM: data flows file -> Checkpoint -> LLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Checkpoint:
    path: Path          # the file or folder read
    source: object      # the open file: .metadata, .tensors (name -> info for `info`), .get(key), .close(), and
                        # optionally .check_unchanged() (GGUFFile: the mapping's file was not rewritten)
    config: object      # models.config.ModelConfig
    weights: dict       # GGUF tensor name -> QTensor (or AWQ tensor), still quantized, still in the file's memory
    tokenizer: object   # tokenizer.Tokenizer
    template: object    # chat_template.ChatTemplate

    def close(self) -> None:
        self.source.close()


def read_gguf(path: Path) -> Checkpoint:
    """A GGUF file as a Checkpoint; GGUFError / ModelError / TokenizerError (one line) for anything wrong with it.
    An unsupported architecture fails before the tensors are touched."""
    from ..chat_template import ChatTemplate
    from ..errors import ModelError, TokenizerError, in_file
    from .gguf import open_gguf
    from ..models import ARCHITECTURES, model_class
    from ..models.config import ModelConfig
    from .quant import qtensor_from_gguf
    from ..tokenizer import Tokenizer

    gf = open_gguf(path)
    try:
        cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors), source=path.name, supported=ARCHITECTURES)
        cls = model_class(cfg)
        weights = {name: qtensor_from_gguf(gf, name) for name in gf.tensors}
        # before the KV cache is sized from the metadata: a head size the tensors contradict is reported as that,
        # not as a cache too large for memory
        cfg.check_shapes(cls.arrange_weights(cfg, weights))
        check_small_float_tensors(gf, weights, path.name)
        tok = Tokenizer.from_gguf(gf.metadata)
        template = ChatTemplate.from_metadata(gf.metadata, tok)
    except (ModelError, TokenizerError) as e:
        gf.close()
        raise in_file(e, path.name) from None
    except BaseException:
        gf.close()
        raise
    return Checkpoint(path, gf, cfg, weights, tok, template)


def check_small_float_tensors(gf, weights: dict, source: str) -> None:
    """ModelError naming the first small float tensor (norms, biases, rope factors: up to 1M elements each, a
    fraction of a millisecond to check) that holds NaN or Inf. Why at load: the fast kernels quantize activations
    to int8, where a NaN from a norm turns into finite garbage that no check on the logits can see."""
    from ..errors import ModelError
    from .gguf import GGMLType

    for name, info in gf.tensors.items():
        if info.ggml_type in (GGMLType.F32, GGMLType.F16, GGMLType.BF16) and info.n_elements <= 1 << 20:
            t = weights[name].dequantize()
            if not bool(torch.isfinite(t).all()):
                bad = int((~torch.isfinite(t)).sum())
                raise ModelError(f"{source}: tensor {name!r} holds {bad} NaN or Inf value(s) of {t.numel()}")
