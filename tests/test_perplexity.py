"""Perplexity (llama.cpp protocol) and KL divergence against a base KV cache."""

import json
import math

import pytest
import torch

from conftest import fixture_path, pyllm_model
from pyllm.errors import PyllmError
from pyllm.perplexity import Stats, chunk_tokens, evaluate

TEXT_FILE = "/usr/share/common-licenses/GPL-3"


def _text():
    try:
        with open(TEXT_FILE) as f:
            return f.read()[:6000]
    except OSError:
        pytest.skip(f"{TEXT_FILE} is not on this machine")


def ref_llm():
    return pyllm_model("smollm2", kernels="reference", n_ctx=512)


def test_stats_formulas_match_llama_cpp():
    nll = [0.5, 1.5, 2.0, 3.0]
    st = Stats("f16", nll=sum(nll), nll2=sum(x * x for x in nll), count=len(nll))
    m = sum(nll) / 4
    assert st.ppl == pytest.approx(math.exp(m))
    var = sum(x * x for x in nll) / 4 - m * m
    assert st.ppl_err == pytest.approx(math.exp(m) * math.sqrt(var / 3))


def test_f16_perplexity_equals_single_pass_logits():
    """The two-pass chunk evaluation (second half read back from the cache) scores what llm.logits scores."""
    llm, n_ctx = ref_llm(), 64
    text = _text()
    stats = evaluate(llm, text, n_ctx=n_ctx, kinds=["f32"], n_chunks=2)
    ids, bos = chunk_tokens(llm, text, n_ctx)
    nll, first = [], n_ctx // 2
    for i in range(2):
        chunk = ids[i * n_ctx:(i + 1) * n_ctx]
        if bos is not None:
            chunk[0] = bos
        lp = torch.log_softmax(llm.logits(chunk).double(), -1)
        nll += [-lp[j, chunk[j + 1]].item() for j in range(first, n_ctx - 1)]
    assert stats["f32"].count == len(nll) == 2 * (n_ctx - 1 - first)
    assert stats["f32"].ppl == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-4)


def test_kl_against_f16_orders_cache_kinds():
    llm = ref_llm()
    stats = evaluate(llm, _text(), n_ctx=128, kinds=["q8_0", "q4_0", "q4_rot"], kl_base="f16", n_chunks=1)
    assert list(stats) == ["f16", "q8_0", "q4_0", "q4_rot"]
    assert stats["q8_0"].kld_mean < 0.01
    assert stats["q8_0"].kld_mean < stats["q4_rot"].kld_mean < stats["q4_0"].kld_mean
    assert abs(stats["q8_0"].ppl / stats["f16"].ppl - 1) < 0.02


def test_too_short_text_is_a_clear_error():
    with pytest.raises(PyllmError, match="needs at least"):
        evaluate(ref_llm(), "just a few words", n_ctx=64)


def test_cli_perplexity_json(capsys, tmp_path):
    from pyllm.cli.main import main

    f = tmp_path / "t.txt"
    f.write_text(_text())
    rc = main(["perplexity", fixture_path("smollm2"), "-f", str(f), "-c", "64", "--chunks", "1", "--kv", "q8_0",
               "--kl-base", "f16", "--backend", "reference", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and [r["kv"] for r in out["results"]] == ["f16", "q8_0"]
    assert out["results"][1]["kld"] >= 0 and out["results"][0]["tokens"] == 31
