"""The GGUF fuzz harness (tools/fuzz_gguf.py) in CI: a deterministic few thousand cases through the reader, a
shorter deep run through the layers above it, and a check that the harness itself notices crashes, hangs and
foreign exceptions. The long run's numbers are in docs/SECURITY.md."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "fuzz_gguf.py"


@pytest.fixture(scope="module")
def fz():
    spec = importlib.util.spec_from_file_location("fuzz_gguf", TOOL)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_gguf"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_cases_are_deterministic(fz):
    seeds = {"all_types": fz.seed_all_types()}
    a, b = fz.CaseMaker(seeds, 7), fz.CaseMaker(seeds, 7)
    assert [a.case(i) for i in range(50)] == [b.case(i) for i in range(50)]
    assert fz.CaseMaker(seeds, 8).case(3) != a.case(3)


def test_semantic_lies_stay_inside_their_fields(fz):
    # seed 11, case 585 lies twice about one key: 2**63 in a u64, then twice that, which no u64 holds; the
    # generator raised struct.error and the whole run died there
    case = fz.CaseMaker({"tiny_llama": fz.seed_tiny_llama()}, 11, semantic=True).case(585)
    assert case[0][:4] == b"GGUF"


def test_seeds_are_valid_files(fz, tmp_path, smollm2_path):
    seeds = fz.make_seeds(smollm2_path)
    assert {"smollm2_head", "smollm2_mini", "all_types"} <= set(seeds)
    for name, data in seeds.items():
        if name == "smollm2_head":
            continue  # a real header cut short: must be rejected, not opened
        assert fz.run_one(data, str(tmp_path / "s.gguf"), False)[0] == "opened", name
    assert fz.run_one(seeds["smollm2_head"], str(tmp_path / "s.gguf"), False)[0] == "rejected"


def test_fuzz_ci_run(fz, smollm2_path):
    """3000 deterministic cases through open_gguf + raw() on every tensor: only PyllmError may escape."""
    rep = fz.fuzz(3000, seed=0, smollm2=smollm2_path, case_timeout=30.0)
    print(rep.summary())
    assert rep.cases == 3000
    assert not rep.failures, rep.summary()
    # the mutations reach deep into the format: plenty of files open, and the rejections are of many kinds
    assert rep.opened > 200 and rep.rejected > 1500
    assert len(rep.reasons) >= 30, sorted(rep.reasons)
    assert rep.max_rss_growth_mb < 256


def test_harness_catches_crash_hang_and_foreign_exceptions(fz, monkeypatch):
    # the hang is the last case, so only the crash needs a fresh worker (each start imports torch)
    monkeypatch.setenv("PYLLM_FUZZ_SELFTEST", "raise:1,crash:3,hang:6")
    rep = fz.fuzz(7, seed=0, seeds={"all_types": fz.seed_all_types()}, case_timeout=3.0)
    kinds = {f["i"]: f["kind"] for f in rep.failures}
    assert kinds == {1: "error", 3: "crash", 6: "hang"}, rep.summary()
    assert rep.cases == 7 and rep.restarts == 1


def test_fuzz_deep_ci_run(fz, smollm2_path):
    """1000 deterministic cases (another seed than the run above) with --deep: files that open also go through
    ModelConfig, dequantization, the tokenizer (encode, decode, streaming), the chat template and pyllm.load plus
    two greedy tokens. Only PyllmError may escape any of them; the stage counts show each layer was reached."""
    rep = fz.fuzz(1000, seed=2, deep=True, smollm2=smollm2_path, case_timeout=30.0)
    print(rep.summary())
    assert rep.cases == 1000
    assert not rep.failures, rep.summary()
    for stage, least in {"config": 60, "dequantize": 90, "tokenizer": 60, "encode/decode": 60, "template": 60,
                         "load": 20, "generate": 20}.items():
        assert rep.stages.get(stage, 0) >= least, (stage, rep.stages)


def test_fuzz_semantic_ci_run(fz):
    """400 well-formed files whose values lie (tools/fuzz_gguf.py --semantic): hyper-parameters of the wrong type or
    range, missing keys, vocabularies that disagree with the embedding, NaN/Inf weights, template bombs, shapes that
    lie. Each goes through config, tokenizer, template, pyllm.load and two tokens; only PyllmError may escape, and
    some files must still load and generate (the lies are not all fatal, so the layers past load are reached)."""
    rep = fz.fuzz(400, seed=4, semantic=True, seeds={"tiny_llama": fz.seed_tiny_llama()}, case_timeout=60.0)
    print(rep.summary())
    assert rep.cases == 400
    assert not rep.failures, rep.summary()
    for stage, least in {"config": 100, "tokenizer": 100, "template": 80, "load": 30, "generate": 15}.items():
        assert rep.stages.get(stage, 0) >= least, (stage, rep.stages)
