"""ArchSpec (pyllm/models/spec.py): each family's entries, and the validation at load that names the field.

Reference: the families' published definitions (llama: one rope table, head_dim ** -0.5; Gemma 3: a global layer
every 6th with rope.freq_base and its scaling, local layers with a 512 window and base 10000, sqrt(n_embd) in
float32, query_pre_attn_scalar ** -0.5), stated here as numbers.
"""

import dataclasses
import math

import pytest
import torch

from pyllm import ops
from pyllm.errors import ModelError
from pyllm.models.config import ModelConfig
from pyllm.models.spec import ArchSpec, LayerSpec


def _cfg(arch="llama", **kw):
    base = dict(arch=arch, n_layer=12, n_embd=640, n_ff=2048, n_head=4, n_kv_head=1, head_dim=256, n_vocab=1000,
                n_ctx_train=4096, rope_base=1e6, rope_dim=256, rope_style="neox", sliding_window=0)
    base.update(kw)
    return ModelConfig(**base)


def test_llama_family_is_one_layer_kind():
    spec = ArchSpec.from_config(_cfg("qwen2", qkv_bias=True, sliding_window=64))
    assert spec.layers == (LayerSpec(1e6, 1.0, 64),) * 12
    assert spec.attn_scale == 1.0 / math.sqrt(256) and spec.act == "silu" and not spec.post_norms
    assert spec.qkv_bias and spec.embd_scale == 0 and spec.final_softcap == 0 and not spec.fused_qkv
    assert spec.rope_keys() == (((1e6, 1.0),), (0,) * 12)
    assert ArchSpec.from_config(_cfg("phi3")).fused_qkv
    assert ArchSpec.from_config(_cfg(), {"rope_freqs.weight"}).rope_freq_factors


def test_gemma3_entries():
    cfg = _cfg("gemma3", sliding_window=512)
    cfg.extra.update(rope_local_base=10000.0, swa_pattern=6, query_pre_attn_scalar=256, rope_scale=8.0,
                     final_logit_softcapping=30.0)
    spec = ArchSpec.from_config(cfg)
    glob, local = LayerSpec(1e6, 8.0, 0), LayerSpec(10000.0, 1.0, 512)
    assert spec.layers == tuple(glob if (i + 1) % 6 == 0 else local for i in range(12))
    assert spec.rope_keys() == (((10000.0, 1.0), (1e6, 8.0)), tuple(1 if (i + 1) % 6 == 0 else 0 for i in range(12)))
    assert spec.embd_scale == float(torch.tensor(math.sqrt(640), dtype=torch.float32)) != math.sqrt(640)
    assert spec.attn_scale == 256 ** -0.5 and spec.final_softcap == 30.0
    assert spec.qk_norm and spec.post_norms and spec.act == "gelu_tanh"
    assert "post_ffw_norm.weight" in spec.layer_tensors() and "attn_q_norm.weight" in spec.layer_tensors()
    cfg.extra["attn_logit_softcapping"] = 50.0
    with pytest.raises(ModelError, match="attn_logit_softcapping"):
        ArchSpec.from_config(cfg)


def test_layers_without_rope_read_no_table():
    """A layer without rope (LayerSpec.rope False) reads no table (-1); a spec whose every layer is so still has
    one table: the steps read the positions from its length."""
    spec = ArchSpec.from_config(_cfg())
    some = dataclasses.replace(spec, layers=tuple(LayerSpec(1e6, 1.0, 0, rope=i % 4 != 3) for i in range(12)))
    assert some.rope_keys() == (((1e6, 1.0),), tuple(-1 if i % 4 == 3 else 0 for i in range(12)))
    nope = dataclasses.replace(spec, layers=(LayerSpec(5e5, 1.0, 0, rope=False),) * 12)
    assert nope.rope_keys() == (((5e5, 1.0),), (-1,) * 12)


def test_smollm3_entries():
    """SmolLM3: llama's layers with every 4th ((i + 1) % 4 == 0) without rope (llama.cpp's n_no_rope_layer_step 4);
    those layers read no table (-1), the others the one table."""
    spec = ArchSpec.from_config(_cfg("smollm3", rope_style="norm"))
    assert spec.layers == tuple(LayerSpec(1e6, 1.0, 0, rope=(i + 1) % 4 != 0) for i in range(12))
    assert spec.rope_keys() == (((1e6, 1.0),), tuple(-1 if (i + 1) % 4 == 0 else 0 for i in range(12)))
    assert spec.rope_style == "norm" and spec.act == "silu" and not spec.post_norms and not spec.qk_norm
    assert spec.layer_tensors() == ArchSpec.from_config(_cfg("llama")).layer_tensors()


def test_spec_is_frozen():
    spec = ArchSpec.from_config(_cfg())
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.rms_eps = 1.0
    assert spec.with_windows(5).layers[0].window == 5 and spec.layers[0].window == 0


@pytest.mark.parametrize("field,value,match", [
    ("rope_style", "yarn", "rope_style"),
    ("act", "relu", "act"),
    ("act", "swiglu_oai", "act = 'swiglu_oai' needs a mixture of experts"),
    ("rms_eps", 0.0, "rms_eps"),
    ("final_softcap", float("nan"), "final_softcap"),
    ("embd_scale", -1.0, "embd_scale"),
    ("n_kv_head", 3, "n_kv_head"),
    ("rope_dim", 255, "rope_dim"),
    ("head_dim", 0, "head_dim"),
    ("layers", (LayerSpec(),) * 3, "layers"),
    ("layers", (LayerSpec(window=-1),) * 12, r"layers\[0\].window"),
    ("layers", (LayerSpec(rope_base=0.0),) * 12, r"layers\[0\].rope_base"),
    ("layers", (LayerSpec(rope_scale=float("inf")),) * 12, r"layers\[0\].rope_scale"),
    ("layers", (LayerSpec(rope=0),) * 12, r"layers\[0\].rope"),
])
def test_bad_values_name_the_field(field, value, match):
    spec = ArchSpec.from_config(_cfg())
    with pytest.raises(ModelError, match=match):
        dataclasses.replace(spec, **{field: value})


def test_unsupported_architecture_is_named():
    with pytest.raises(ModelError, match="'mamba'"):
        ArchSpec.from_config(_cfg("mamba"))


def test_gemv_row_limit_is_stated_once():
    """ops.GEMV_MAX_M is read from csrc/common/limits.h, which the kernels compile; the runtime's row limits are
    it."""
    from pyllm.runtime import batch, speculative

    C = ops._ext.load()
    assert ops.GEMV_MAX_M == C.GEMV_MAX_M == speculative.MAX_ROWS == batch.MAX_BATCH
