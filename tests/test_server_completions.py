"""`pyllm serve`'s POST /v1/completions and /v1/embeddings driven by the official openai client over 127.0.0.1.

References: the library's own greedy generation and logits (the server must return the same text and scores),
OpenAI's documented legacy completion shapes. Server fixtures: conftest.py.
"""

import json

import openai
import pytest

from server_harness import _ok, check_echoed_prompt_logprobs


def test_completion_matches_library_with_stop_and_logprobs(smol, smol_llm):
    prompt = "The capital of France is"
    want = smol_llm.generate(prompt, max_tokens=12, temperature=0, stop=["\n"])
    c = smol.client()
    r = c.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0, stop=["\n"], logprobs=3)
    ch = r.choices[0]
    assert ch.text == want and "\n" not in ch.text
    lp = ch.logprobs
    assert "".join(lp.tokens).startswith(ch.text)
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert v <= 0 and len(top) == 3
        assert max(top.values()) == pytest.approx(v, abs=1e-6)  # greedy: the chosen token is the most likely
    streamed = "".join(x.choices[0].text for x in c.completions.create(
        model="smollm2", prompt=prompt, max_tokens=12, temperature=0, stop=["\n"], stream=True))
    assert streamed == want


def test_a_batch_of_one_token_prompt_is_that_prompt(smol, smol_llm):
    """OpenAI's prompt may be a batch: a list of strings or of token-id lists. A batch of one string was served as
    that string, a batch of one token-id list was a 400; both are the one prompt they hold. A batch of several
    gets a choice per prompt (tests/test_batch_calls.py)."""
    c = smol.client()
    ids = smol_llm.tokenize("The capital of France is")
    want = c.completions.create(model="smollm2", prompt=ids, max_tokens=3, temperature=0)
    got = c.completions.create(model="smollm2", prompt=[ids], max_tokens=3, temperature=0)
    assert got.choices[0].text == want.choices[0].text and got.usage.prompt_tokens == len(ids)
    two = c.completions.create(model="smollm2", prompt=[ids, ids], max_tokens=3, temperature=0)
    assert [x.text for x in two.choices] == [want.choices[0].text] * 2


def test_several_choices_with_an_echoed_prompt_are_refused_before_any_work(smol):
    """OpenAI's legacy completions give each of n choices its own text, so with echo each would repeat the prompt
    (and with logprobs its scores). pyllm generates one choice per request (as llama.cpp's server, which answers
    "Only one completion choice is allowed"), so n > 1 is a 400 naming n whatever echo, logprobs and stream say,
    before the prompt is scored or anything generated (the token counters do not move)."""
    before = smol.metrics()
    for extra in ({}, {"logprobs": 1}, {"logprobs": 1, "stream": True}, {"stream": True}, {"max_tokens": 0}):
        req = {"prompt": "Hello there", "echo": True, "n": 2, "max_tokens": 2, **extra}
        status, r = smol.raw("/v1/completions", json.dumps(req).encode())
        assert status == 400 and r["error"]["param"] == "n" and r["error"]["message"].startswith("n=2: "), (req, r)
    after = smol.metrics()
    for name in ("pyllm_prompt_tokens_total", "pyllm_generated_tokens_total"):
        assert after[name] == before[name], name
    _ok(smol)


def test_echo_with_logprobs_scores_the_prompt(smol, smol_llm):
    check_echoed_prompt_logprobs(smol, smol_llm)


def test_echo_with_logprobs_reports_no_cache_reuse_of_its_own_scoring(smol):
    """The prompt-scoring pass evaluates the whole prompt from position 0 and leaves it in the cache, and the
    generation then reused it: cached_tokens read prompt_tokens - 1 and pyllm_prompt_cache_tokens_total grew by
    that, though the request computed every token itself. Reference: OpenAI's cached_tokens, the prompt tokens
    reused from earlier requests; exact counts."""
    prompt, kw = "A long prompt about caching, to be echoed with its scores.", dict(max_tokens=2, temperature=0)
    c = smol.client()
    c.completions.create(model="smollm2", prompt=prompt, **kw)  # the cache now holds the prompt
    before = smol.metrics()["pyllm_prompt_cache_tokens_total"]
    r = c.completions.create(model="smollm2", prompt=prompt, echo=True, logprobs=1, **kw)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert smol.metrics()["pyllm_prompt_cache_tokens_total"] == before
    r = c.completions.create(model="smollm2", prompt=prompt, **kw)  # an earlier request's rows: reuse
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert cached >= r.usage.prompt_tokens - 1 and smol.metrics()["pyllm_prompt_cache_tokens_total"] == before + cached


def test_embeddings_rank_paraphrases_first(smol):
    texts = ["The cat sat on the mat.", "A cat was sitting on the rug.", "Quarterly revenue rose by eight percent."]
    r = smol.client().embeddings.create(model="smollm2", input=texts)
    v = [d.embedding for d in r.data]
    assert [d.index for d in r.data] == [0, 1, 2] and r.usage.prompt_tokens > 0

    def cos(a, b):
        return sum(x * y for x, y in zip(a, b))

    assert all(abs(cos(x, x) - 1) < 1e-4 for x in v)  # L2-normalised
    assert cos(v[0], v[1]) > cos(v[0], v[2]) + 0.1 and cos(v[0], v[1]) > cos(v[1], v[2]) + 0.1
    status, body = smol.raw("/v1/embeddings", json.dumps({"model": "smollm2", "input": []}).encode())
    assert status == 400 and body["error"]["param"] == "input"


def test_legacy_top_logprobs_hold_the_chosen_token(smol):
    """OpenAI's legacy completions return "the logprob of the sampled token" in each top_logprobs entry too ("up to
    logprobs+1 elements"), as llama-cpp-python and vLLM do; a token sampled outside the N most likely was missing
    from its entry, and logprobs=0 gave empty entries. Reference: the response's own token_logprobs (the same
    value, exactly), streamed or not, for generated and echoed tokens."""
    c = smol.client()
    kw = dict(model="smollm2", prompt="Once upon a time", max_tokens=8, temperature=1.5, seed=5)
    for n, extra in ((0, {}), (1, {}), (1, {"echo": True})):
        r = c.completions.create(logprobs=n, **kw, **extra)
        streamed = [ch.choices[0].logprobs for ch in c.completions.create(logprobs=n, stream=True, **kw, **extra)
                    if ch.choices and ch.choices[0].logprobs]
        for lp in [r.choices[0].logprobs, *streamed]:
            for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
                if top is None:  # an echoed prompt's first token: nothing precedes it
                    assert v is None and extra
                    continue
                assert top[tok] == v and 1 <= len(top) <= n + 1, (n, extra, tok, v, top)
