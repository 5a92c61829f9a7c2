"""The llama-cpp-python-style library API (pyllm/api.py) and embeddings (pyllm/embed.py).

References: the library's own greedy generate()/chat() for text, a float64 numpy log-softmax for logprobs,
hand-written replies for the tool-call parser, cosine ranking of paraphrases for embeddings.
"""

import json

import numpy as np
import pytest
import torch

from conftest import pyllm_model
from pyllm import PyllmError, ops
from pyllm.chat_messages import normalize_messages, parse_tool_calls
from pyllm.errors import BadRequest, ContextFullError
from pyllm.runtime.sampler import token_logprobs


@pytest.fixture(scope="module")
def llm():
    return pyllm_model("smollm2", n_ctx=512, n_threads=1)


def test_completion_matches_generate(llm):
    prompt = "The capital of France is"
    want = llm.generate(prompt, max_tokens=10, temperature=0)
    r = llm.create_completion(prompt, max_tokens=10, temperature=0)
    assert r["object"] == "text_completion" and r["choices"][0]["text"] == want
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["usage"] == {"prompt_tokens": len(llm.tokenize(prompt)), "completion_tokens": 10,
                          "total_tokens": len(llm.tokenize(prompt)) + 10,
                          "prompt_tokens_details": r["usage"]["prompt_tokens_details"]}
    cut = want.find(".")
    assert cut > 0
    r = llm.create_completion(prompt, max_tokens=10, temperature=0, stop=".")
    assert r["choices"][0]["text"] == want[:cut] and r["choices"][0]["finish_reason"] == "stop"
    echo = llm.create_completion(prompt, max_tokens=3, temperature=0, echo=True)["choices"][0]["text"]
    assert echo.startswith(prompt)


def test_chat_stream_matches_chat(llm):
    msgs = [{"role": "user", "content": "Name a fruit."}]
    want = llm.chat(msgs, max_tokens=16, temperature=0)
    r = llm.create_chat_completion(msgs, max_tokens=16, temperature=0)
    assert r["choices"][0]["message"] == {"role": "assistant", "content": want}
    chunks = list(llm.create_chat_completion(msgs, max_tokens=16, temperature=0, stream=True,
                                             stream_options={"include_usage": True}))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == want
    assert chunks[-2]["choices"][0]["finish_reason"] == r["choices"][0]["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == \
        r["usage"]["completion_tokens"]
    # max_completion_tokens wins over max_tokens, as in OpenAI's API
    r = llm.create_chat_completion(msgs, max_tokens=16, max_completion_tokens=2, temperature=0)
    assert r["usage"]["completion_tokens"] == 2 and r["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("kw, needle", [
    (dict(model=None), "model"), (dict(model=123), "model"), (dict(model=""), "model"),
    (dict(n_ctx="512"), "n_ctx"), (dict(n_ctx=1500.7), "n_ctx"), (dict(n_ctx=True), "n_ctx"),
    (dict(n_threads=0), "n_threads"), (dict(n_threads="2"), "n_threads"), (dict(n_threads=10**6), "n_threads"),
])
def test_load_refuses_bad_arguments_naming_them(kw, needle):
    """Reference: the documented types (a path or name; integers). A PyllmError naming the argument, not a
    TypeError from os.fspath or torch, and not a silently truncated or misread value."""
    import pyllm

    with pytest.raises(PyllmError, match=needle):
        pyllm.load(**{"model": "smollm2-135m", **kw})


@pytest.mark.parametrize("kw", [dict(spec_k=0), dict(spec_k=8), dict(spec_ngram=0), dict(spec_k="2")])
def test_speculation_settings_are_checked_when_not_speculating(llm, kw):
    """Reference: SpecSettings' ranges. Sampling at temperature 0.8 does not speculate by default; a bad setting
    is still an error, not silently unused."""
    with pytest.raises(PyllmError, match="spec"):
        llm.generate("Hi", max_tokens=2, temperature=0.8, **kw)


@pytest.mark.parametrize("prompt", [None, 12, ["a", "b"], [1.5, 2], [True]])
def test_generate_refuses_a_prompt_that_is_neither_text_nor_token_ids(llm, prompt):
    """Reference: generate's documented prompt, text or token ids. Anything else is a PyllmError naming the
    prompt, not a TypeError or ValueError from inside the tokenizer's bookkeeping."""
    with pytest.raises(PyllmError, match="prompt"):
        llm.generate(prompt, max_tokens=2, temperature=0)
    assert llm.generate("Hi", max_tokens=2, temperature=0)  # the LLM is still usable


def test_prompts_that_cannot_fit_are_refused_before_they_are_tokenized(llm, monkeypatch):
    """A prompt of megabytes was tokenized whole (seconds at 0.2-1 MB/s, holding a server's worker) only to be
    refused for its length. Reference: the context of 512 tokens, and the tokenizer, which none of these calls
    may reach."""
    def encode(*a, **kw):
        raise AssertionError("the prompt was tokenized")

    big = "word " * 200_000
    monkeypatch.setattr(llm.tokenizer, "encode", encode)
    chat = [{"role": "user", "content": big}]
    for call in (lambda: llm.generate(big, max_tokens=1), lambda: llm.chat(chat, max_tokens=1),
                 lambda: llm.create_completion(big, max_tokens=1),
                 lambda: llm.create_chat_completion(chat, max_tokens=1)):
        with pytest.raises(ContextFullError, match="at least [0-9]+ tokens but the context holds 512"):
            call()
    with pytest.raises(PyllmError, match="at least [0-9]+ tokens exceeds the context of 512"):
        llm.embed(big)


def test_token_logprobs_match_a_float64_log_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1000, generator=g) * 4
    ref = logits.double().numpy()
    ref = ref - ref.max() - np.log(np.exp(ref - ref.max()).sum())
    lp, top = token_logprobs(logits, 17, 5)
    assert lp == pytest.approx(ref[17], abs=1e-5)
    order = np.argsort(-ref)[:5]
    assert [i for i, _ in top] == order.tolist()
    assert [v for _, v in top] == pytest.approx(ref[order].tolist(), abs=1e-5)


def test_logprobs_in_responses(llm):
    r = llm.create_chat_completion([{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0, logprobs=True,
                                   top_logprobs=3)
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == 5
    text = b"".join(bytes(t["bytes"]) for t in content).decode("utf-8", errors="replace")
    assert text == r["choices"][0]["message"]["content"]
    for t in content:
        assert len(t["top_logprobs"]) == 3
        assert t["top_logprobs"][0]["logprob"] == pytest.approx(t["logprob"], abs=1e-6)  # greedy: the top token


def test_logprobs_end_where_a_stop_string_ends_the_output(llm):
    """Logprobs were reported for the tokens of the stop string itself: stop=" cat" gave text "" with logprobs for
    " cat", stop="." gave the reply without its "." but with the "." token. Reference: llama.cpp's server, which
    drops the stop string's tokens; exact checks: a token that starts at or after the cut is not reported, one the
    cut falls inside is; streamed and whole responses report the same tokens and text offsets."""
    prompt = "The dog and the"
    whole = llm.create_completion(prompt, max_tokens=20, temperature=0, logprobs=1)["choices"][0]
    tokens, text = whole["logprobs"]["tokens"], whole["text"]
    assert "".join(tokens) == text
    starts = [sum(map(len, tokens[:i])) for i in range(len(tokens))]
    # stops at a token boundary (the whole first token, a later token) and inside a token
    inside = next(i for i, t in enumerate(tokens) if len(t.strip()) >= 3 and i > 0)
    for stop in (tokens[0], tokens[inside], tokens[inside][-2:]):
        cut = text.find(stop)
        want = [t for t, start in zip(tokens, starts) if start < cut]
        for echo in (False, True):
            kw = dict(max_tokens=20, temperature=0, logprobs=1, stop=stop, echo=echo)
            r = llm.create_completion(prompt, **kw)["choices"][0]
            lp = r["logprobs"]
            assert r["finish_reason"] == "stop" and r["text"] == (prompt if echo else "") + text[:cut]
            shown = len(llm.tokenize(prompt)) if echo else 0  # echo lists the prompt's tokens first
            assert lp["tokens"][shown:] == want, (stop, lp["tokens"])
            chunks = [c["choices"][0] for c in llm.create_completion(prompt, stream=True, **kw) if c["choices"]]
            assert [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]][shown:] == want
            assert [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]] == lp["text_offset"]
    msgs = [{"role": "user", "content": "Write one sentence about cats."}]
    full = llm.create_chat_completion(msgs, max_tokens=20, temperature=0, logprobs=True)["choices"][0]
    toks = [t["token"] for t in full["logprobs"]["content"]]
    stop = toks[3]
    cut = full["message"]["content"].find(stop)
    assert cut == len("".join(toks[:3]))
    for stream in (False, True):
        r = llm.create_chat_completion(msgs, max_tokens=20, temperature=0, logprobs=True, stop=stop, stream=stream)
        if stream:
            got = [t["token"] for c in r if c["choices"] and c["choices"][0]["logprobs"]
                   for t in c["choices"][0]["logprobs"]["content"]]
        else:
            got = [t["token"] for t in r["choices"][0]["logprobs"]["content"]]
            assert r["choices"][0]["message"]["content"] == "".join(toks[:3])
        assert got == toks[:3]


def test_echo_with_logprobs_reports_no_cache_reuse_of_its_own_scoring(llm):
    """The scoring pass of echo with logprobs evaluates the prompt from position 0; its generation then reused
    those rows and usage said cached_tokens = prompt_tokens - 1. Reference: OpenAI's cached_tokens, the prompt
    tokens reused from earlier requests; exact counts, streamed usage too."""
    prompt, kw = "The capital of France is", dict(max_tokens=2, temperature=0)
    llm.create_completion(prompt, **kw)
    r = llm.create_completion(prompt, echo=True, logprobs=1, **kw)
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    last = list(llm.create_completion(prompt, echo=True, logprobs=1, stream=True,
                                      stream_options={"include_usage": True}, **kw))[-1]
    assert last["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    r = llm.create_completion(prompt, **kw)  # rows an earlier call left: reuse
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= r["usage"]["prompt_tokens"] - 1


@pytest.mark.parametrize("key", ["smollm2", "gemma3"])
def test_echo_with_logprobs_scores_the_prompt(key):
    """echo with logprobs returned the completion's logprobs only. Reference: OpenAI's legacy completions and
    llama-cpp-python: the prompt's tokens come first, the first with null logprob and top_logprobs, every other one
    with a float64 log-softmax of the model's logits at the position before it (LLM.logits); a BOS the tokenizer
    added is not listed (the echoed text does not show it); text_offset indexes the echoed text; the completion's
    entries follow as without echo, and a stream carries the same entries."""
    llm = pyllm_model(key, n_ctx=512, n_threads=1)
    prompt = "The capital of France is Paris, and the capital of Italy is"
    ids = llm.tokenize(prompt)
    shown = ids[1:] if ids[0] == llm.tokenizer.bos_id else ids
    skipped, n = len(ids) - len(shown), len(shown)
    ref = torch.log_softmax(llm.logits(ids).double(), dim=-1)
    shown_bytes = [llm.tokenizer.token_bytes(i) for i in shown]
    for max_tokens in (0, 4):
        llm.reset()
        plain = llm.create_completion(prompt, logprobs=2, max_tokens=max_tokens, temperature=0)["choices"][0]
        llm.reset()
        r = llm.create_completion(prompt, echo=True, logprobs=2, max_tokens=max_tokens, temperature=0)["choices"][0]
        lp = r["logprobs"]
        assert r["text"] == prompt + plain["text"]
        assert lp["tokens"][:n] == [b.decode("utf-8", errors="replace") for b in shown_bytes]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for k in range(1, n):
            p = k + skipped
            assert lp["token_logprobs"][k] == pytest.approx(float(ref[p - 1, ids[p]]), abs=1e-4)
            # the two most likely, and the prompt's own token when it is not one of them
            assert len(lp["top_logprobs"][k]) in (2, 3) and lp["top_logprobs"][k][lp["tokens"][k]] == \
                lp["token_logprobs"][k]
            assert max(lp["top_logprobs"][k].values()) == pytest.approx(float(ref[p - 1].max()), abs=1e-4)
        assert lp["text_offset"][:n] == _offsets_of(shown_bytes)
        assert all(r["text"][o:].startswith(t) for o, t in zip(lp["text_offset"][:n], lp["tokens"][:n]))
        want = plain["logprobs"]
        assert lp["tokens"][n:] == want["tokens"] and len(want["tokens"]) == max_tokens
        assert lp["text_offset"][n:] == [len(prompt) + o for o in want["text_offset"]]
        llm.reset()
        chunks = [c["choices"][0] for c in llm.create_completion(prompt, echo=True, logprobs=2, stream=True,
                                                                 max_tokens=max_tokens, temperature=0)]
        assert "".join(c["text"] for c in chunks) == r["text"]
        got = {k: [x for c in chunks if c["logprobs"] for x in c["logprobs"][k]] for k in lp}
        assert got["tokens"] == lp["tokens"] and got["text_offset"] == lp["text_offset"]
        assert got["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:], abs=1e-4)


def _offsets_of(token_bytes: list[bytes], start: int = 0) -> list[int]:
    """Where each token starts in the text, in characters: the characters that the tokens before it decode to
    (a character still incomplete counts once it is complete), as llama-cpp-python computes text_offset."""
    return [start + len(b"".join(token_bytes[:i]).decode("utf-8", errors="ignore")) for i in range(len(token_bytes))]


@pytest.mark.parametrize("key", ["smollm2", "qwen2", "gemma3"])
def test_a_scored_prompt_goes_on_as_a_plain_one(key):
    """Reference: the same prompt read by a plain prefill.  A prompt scored with every row's logits (echo with
    logprobs: prompt_logprobs) leaves the cache holding it; the generation that follows starts from the logits of
    its last row bit for bit as after the plain prefill (the head of an all-rows forward gives its last row the
    one-row head's sums), and its greedy tokens are the plain ones."""
    llm = pyllm_model(key, n_ctx=512, n_threads=1)
    ids = llm.tokenize("The old lighthouse keeper counted the ships that passed each night, and wrote " * 6)
    llm.reset()
    plain = llm.generator.prefill(ids).clone()
    llm.reset()
    want = list(llm.generate_tokens(ids, max_tokens=12, temperature=0))
    llm.reset()
    llm.prompt_logprobs(ids, 2)
    assert torch.equal(llm.generator.prefill(ids), plain), key
    llm.reset()
    llm.prompt_logprobs(ids, 2)
    assert list(llm.generate_tokens(ids, max_tokens=12, temperature=0)) == want, key


@pytest.mark.parametrize("key", ["smollm2", "qwen2"])
def test_text_offsets_index_the_text_where_tokens_split_characters(key):
    """text_offset counted each token's own text, in which a token holding part of a UTF-8 character is U+FFFD:
    after "\U0001F409" split over three tokens the offsets ran two characters past the text. Reference:
    llama-cpp-python's text_offset (the characters the tokens before it decode to; a character split over tokens
    counts once complete), with the token bytes of the same greedy generation (each call starts from an empty
    cache, so all three generate the same tokens); whole, streamed and echoed responses agree."""
    llm = pyllm_model(key, n_ctx=512, n_threads=1)
    prompt = "Say hello in three languages with an emoji:"
    grammar = 'root ::= " h\u00e9llo \U0001F409 \u4f60\u597d, \u00bfqu\u00e9 tal?" [a-z ]{0,4}'
    kw = dict(max_tokens=40, temperature=0, grammar=grammar)
    llm.reset()
    ids = [i for i in llm.generate_tokens(llm.tokenize(prompt), **kw) if not llm.tokenizer.is_eog(i)]
    tb = [llm.tokenizer.token_bytes(i) for i in ids]
    assert not all(map(_whole_characters, tb))  # the test needs tokens that split a character
    for echo in (False, True):
        llm.reset()
        r = llm.create_completion(prompt, echo=echo, logprobs=2, **kw)["choices"][0]
        start = len(prompt) if echo else 0
        assert r["text"][start:] == b"".join(tb).decode()
        assert r["logprobs"]["text_offset"][-len(tb):] == _offsets_of(tb, start)
        for off, t in zip(r["logprobs"]["text_offset"][-len(tb):], tb):
            if _whole_characters(t):
                assert r["text"][off:].encode().startswith(t)
        llm.reset()
        chunks = [c["choices"][0] for c in llm.create_completion(prompt, echo=echo, logprobs=2, stream=True, **kw)]
        assert "".join(c["text"] for c in chunks) == r["text"]
        assert [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]] == \
            r["logprobs"]["text_offset"]
    # chat's per-token bytes are the tokens' own, and spell the reply
    r = llm.create_chat_completion([{"role": "user", "content": prompt}], logprobs=True, **kw)["choices"][0]
    assert b"".join(bytes(t["bytes"]) for t in r["logprobs"]["content"]).decode() == r["message"]["content"]


def _offsets_of(token_bytes: list[bytes], start: int = 0) -> list[int]:
    return [start + len(b"".join(token_bytes[:i]).decode("utf-8", errors="ignore")) for i in range(len(token_bytes))]


def _whole_characters(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_streamed_logprobs_with_tools_match_the_whole_response(llm):
    """With tools, streamed text that may be a call is held back, and the logprobs of held pieces were dropped: a
    forced call streamed no logprobs at all (the response had one per token), nor did a held reply that turned out
    to be content. Reference: the whole (non-streamed) response to the same greedy request, token for token."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    for extra in (dict(tool_choice="required"), dict(tool_choice="auto", response_format={"type": "json_object"}),
                  dict(tool_choice="auto")):
        kw = dict(max_tokens=24, temperature=0, logprobs=True, top_logprobs=2, tools=tools, **extra)
        whole = llm.create_chat_completion(msgs, **kw)["choices"][0]["logprobs"]["content"]
        streamed = [t for c in llm.create_chat_completion(msgs, stream=True, **kw) if c["choices"]
                    and c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["content"]]
        assert len(whole) > 0 and streamed == whole, extra


def test_embedding_dimensions_other_than_the_models_are_refused(llm):
    """dimensions was ignored: asking for 256 answered with vectors of n_embd (576) floats, which a vector store
    sized for 256 refuses later, far from the cause. Reference: OpenAI's API, which refuses dimensions for a
    model that cannot shorten its embeddings; the model's own width (or none) is still served."""
    n = llm.config.n_embd
    for dims in (None, n):
        r = llm.create_embedding("hello", dimensions=dims)
        assert len(r["data"][0]["embedding"]) == n
    for bad in (8, n + 1):
        with pytest.raises(BadRequest, match=f"dimensions={bad}: this model's embeddings have {n}") as e:
            llm.create_embedding("hello", dimensions=bad)
        assert e.value.param == "dimensions"
    for bad in (0, -1, 1.5, "8", True):
        with pytest.raises(BadRequest) as e:
            llm.create_embedding("hello", dimensions=bad)
        assert e.value.param == "dimensions"


def test_top_p_zero_is_greedy(llm):
    """top_p=0 keeps only the most likely token at any temperature.  Both calls start from an empty cache: a call
    that reuses the previous one's prompt re-evaluates the last prompt token through the decode step instead of
    the prefill, whose logits differ in the last bits, and this prompt has a near-tie at its 5th token."""
    prompt = "The capital of France is"
    llm.reset()
    want = llm.create_completion(prompt, max_tokens=6, temperature=0)["choices"][0]["text"]
    llm.reset()
    assert llm.create_completion(prompt, max_tokens=6, temperature=1.5, top_p=0, seed=3)["choices"][0]["text"] == want


def test_seed_minus_one_is_random(llm):
    """seed=-1 draws a random seed, as README says for every entry point and as llama-cpp-python does; it was
    folded into the fixed seed 2**63-1, so every "random" completion was the same text. Reference: at temperature
    2 over the whole vocabulary, three 8-token samples from random seeds are never all equal (the chance is far
    below 1e-12), while one seed given twice replays its text."""
    kw = dict(max_tokens=8, temperature=2.0, top_k=0, top_p=1.0, min_p=0.0)
    texts = {llm.create_completion("Once upon a time", seed=-1, **kw)["choices"][0]["text"] for _ in range(3)}
    assert len(texts) > 1, texts
    msgs = [{"role": "user", "content": "Say a word."}]
    replies = {llm.create_chat_completion(msgs, seed=-1, **kw)["choices"][0]["message"]["content"] for _ in range(3)}
    assert len(replies) > 1, replies
    seeded = [llm.create_completion("Once upon a time", seed=5, **kw)["choices"][0]["text"] for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_bad_arguments_raise_before_generating(llm):
    msgs = [{"role": "user", "content": "Hi"}]
    for kw, param in [({"top_p": 2}, "top_p"), ({"n": 0}, "n"), ({"stop": 3}, "stop"),
                      ({"logit_bias": {"999999": 1}}, "logit_bias"), ({"max_tokens": -1.5}, "max_tokens"),
                      ({"temperature": "hot"}, "temperature"), ({"tool_choice": "required"}, "tool_choice")]:
        with pytest.raises(BadRequest) as e:
            llm.create_chat_completion(msgs, stream=True, **kw)
        assert e.value.param == param, kw
    with pytest.raises(BadRequest):
        llm.create_chat_completion([], max_tokens=1)


def test_options_pyllm_cannot_honour_are_refused_not_ignored(llm):
    """top_logprobs without logprobs and best_of were dropped silently: the client got no logprobs, or one
    ordinary sample presented as the best of several. Reference: OpenAI's API, which answers 400 for top_logprobs
    without logprobs: true; best_of is accepted where it asks for what is generated anyway (1)."""
    msgs = [{"role": "user", "content": "Hi"}]
    for stream in (False, True):
        with pytest.raises(BadRequest, match="top_logprobs needs logprobs: true") as e:
            llm.create_chat_completion(msgs, max_tokens=1, top_logprobs=2, stream=stream)
        assert e.value.param == "top_logprobs"
        with pytest.raises(BadRequest, match="top_logprobs needs logprobs: true"):
            llm.create_chat_completion(msgs, max_tokens=1, top_logprobs=0, logprobs=False, stream=stream)
        for bad in (2, 5, 0, 1.5, "1", True):
            with pytest.raises(BadRequest, match="best_of") as e:
                llm.create_completion("Hi", max_tokens=1, best_of=bad, stream=stream)
            assert e.value.param == "best_of", bad
    r = llm.create_chat_completion(msgs, max_tokens=1, top_logprobs=2, logprobs=True, temperature=0)
    assert len(r["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    for ok in (None, 1):
        assert llm.create_completion("Hi", max_tokens=1, best_of=ok, n=1)["usage"]["completion_tokens"] == 1


def test_unknown_keywords_are_refused_not_ignored(llm):
    """A typo (temprature=0) or a llama-cpp-python setting pyllm lacks (mirostat_mode=2) was dropped silently and
    the reply sampled as if it had not been given. Reference: llama-cpp-python's Llama, whose create_* refuse an
    unknown keyword (a TypeError there; pyllm's BadRequest names it and the nearest known one), at the call,
    before anything is generated; OpenAI's parameters that change nothing (user, metadata, ...) are still taken."""
    msgs = [{"role": "user", "content": "Hi"}]
    calls = [(lambda **kw: llm.create_completion("Hi", max_tokens=1, **kw), "create_completion"),
             (lambda **kw: llm.create_chat_completion(msgs, max_tokens=1, **kw), "create_chat_completion"),
             (lambda **kw: llm.create_embedding("Hi", **kw), "create_embedding")]
    for call, name in calls:
        for stream in ((False, True) if name != "create_embedding" else (None,)):
            extra = {} if stream is None else {"stream": stream}
            hint = "it takes input, model" if name == "create_embedding" else "did you mean 'temperature'"
            with pytest.raises(BadRequest, match=f"{name}\\(\\) got an unknown argument 'temprature'; {hint}") as e:
                call(temprature=0, **extra)
            assert e.value.param == "temprature"
            with pytest.raises(BadRequest, match="unknown argument 'mirostat_mode'"):
                call(mirostat_mode=2, **extra)
        assert call(user="someone", metadata={"k": "v"}, store=False) is not None


def test_llm_is_callable_as_create_completion(llm):
    """llama-cpp-python's Llama.__call__ is create_completion: llm("Q: ... A:", max_tokens=...) was a TypeError."""
    kw = dict(max_tokens=6, temperature=0)
    assert llm("The capital of France is", **kw)["choices"][0]["text"] == \
        llm.create_completion("The capital of France is", **kw)["choices"][0]["text"]


def test_tokenize_takes_utf8_bytes_as_llama_cpp_python_does(llm):
    """llama-cpp-python's Llama.tokenize takes bytes (llm.tokenize(b"Hello")); pyllm's said "encode() needs a str,
    got bytes", naming a function the caller never called. Reference: the same text as a str; bytes that are not
    UTF-8 and other types are PyllmErrors naming tokenize."""
    text = "The café is open."
    assert llm.tokenize(text.encode()) == llm.tokenize(text)
    assert llm.tokenize(bytearray(text.encode()), add_bos=False) == llm.tokenize(text, add_bos=False)
    with pytest.raises(PyllmError, match="tokenize: the bytes are not UTF-8 \\(byte 0xff at offset 1\\)"):
        llm.tokenize(b"a\xffb")
    for bad in (None, 5, ["a"]):
        with pytest.raises(PyllmError, match="tokenize: text must be a str"):
            llm.tokenize(bad)


def test_embed_refuses_what_is_not_text(llm):
    """embed(5) was a TypeError from list(5), and embed(b"hi") embedded the texts of the byte values; each is a
    PyllmError naming what embed takes (reference: create_embedding, which refuses them so)."""
    for bad in (5, b"hi", None, {"a": 1}):
        with pytest.raises(PyllmError, match="embed: give a string or a non-empty list of strings"):
            llm.embed(bad)
    assert len(llm.embed(("a", "b"))) == 2


def test_empty_message_list_is_refused_by_every_chat_entry_point(llm, monkeypatch):
    """Reference: create_chat_completion([]), which refuses an empty conversation as a BadRequest naming
    messages. chat() (plain and streaming) and chat_ids() generated a reply to the bare generation prompt instead;
    each must raise the same error, at the call (not on the first piece of a stream), before any evaluation."""
    def evaluate(*a, **kw):
        raise AssertionError("the model was run")

    monkeypatch.setattr(llm.generator, "_forward", evaluate)
    calls = {"create_chat_completion": lambda: llm.create_chat_completion([], max_tokens=1),
             "create_chat_completion stream": lambda: llm.create_chat_completion([], max_tokens=1, stream=True),
             "chat": lambda: llm.chat([], max_tokens=1), "chat stream": lambda: llm.chat([], max_tokens=1, stream=True),
             "chat tuple": lambda: llm.chat((), max_tokens=1), "chat_ids": lambda: llm.chat_ids([]),
             "fit_chat": lambda: llm.fit_chat([]), "format_chat": lambda: llm.format_chat([])}
    for what, call in calls.items():
        with pytest.raises(BadRequest, match="^messages must be a non-empty list$") as e:
            call()
        assert e.value.param == "messages", what


def test_response_format_constrains_the_reply(llm):
    """response_format goes through the grammar constraint: the reply parses (json_object) and validates against
    the schema (json_schema, checked with jsonschema); an unknown type is a 400-style BadRequest."""
    jsonschema = pytest.importorskip("jsonschema")
    msgs = [{"role": "user", "content": "Give me a JSON object with a key a."}]
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 12}}, "required": ["a"],
              "additionalProperties": False}
    r = llm.create_chat_completion(msgs, max_tokens=64, temperature=0,
                                   response_format={"type": "json_schema",
                                                    "json_schema": {"name": "a", "schema": schema}})
    assert r["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(r["choices"][0]["message"]["content"]), schema)
    r = llm.create_chat_completion(msgs, max_tokens=200, temperature=0, response_format={"type": "json_object"})
    if r["choices"][0]["finish_reason"] == "stop":  # a free-form object may outgrow any token budget
        assert isinstance(json.loads(r["choices"][0]["message"]["content"]), dict)
    else:
        assert r["choices"][0]["message"]["content"].lstrip().startswith("{")
    with pytest.raises(BadRequest):
        llm.create_chat_completion(msgs, response_format={"type": "yaml"})


def test_parse_tool_calls():
    names = ["get_weather"]
    content, calls = parse_tool_calls('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                                      '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
                                      '"Rome"}}\n</tool_call>', names)
    assert content == "Sure."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Rome"})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    # a bare or fenced call object naming a known tool
    for text in ('{"name": "get_weather", "arguments": {"city": "Oslo"}}',
                 '```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```'):
        assert parse_tool_calls(text, names)[1][0]["function"]["arguments"] == '{"city": "Oslo"}'
    # arguments are JSON text: an encoded object passes as written, any other string is a value to encode
    for args, want in (('"{\\"city\\": \\"Oslo\\"}"', '{"city": "Oslo"}'), ('"Oslo"', '"Oslo"'),
                       ('"[1]"', '"[1]"')):
        text = '{"name": "get_weather", "arguments": ' + args + '}'
        assert parse_tool_calls(text, names)[1][0]["function"]["arguments"] == want, args
    # constrained to the schema, the arguments are the value itself, even a string that holds an object
    text = '<tool_call>\n{"name": "get_weather", "arguments": "{}"}'
    assert parse_tool_calls(text, names, values=True)[1][0]["function"]["arguments"] == '"{}"'
    # not calls: unknown name (bare), broken JSON, plain text
    for text in ('{"name": "rm_rf", "arguments": {}}', '<tool_call>\n{"name": "get_weather", "arg', "Hello"):
        assert parse_tool_calls(text, names) == (text, [])


def test_normalize_messages_for_templates():
    msgs = normalize_messages([
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "2"}])
    assert msgs[0]["content"] == "ab"
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}  # templates write it with tojson
    assert msgs[2]["name"] == "f"
    with pytest.raises(BadRequest):
        normalize_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_tool_calls_and_results_without_ids_are_served():
    # ids are optional on both sides: a call without one and a result without one matched as the same (missing)
    # id, and reading the result's id was a KeyError, a 500 from the server
    msgs = normalize_messages([
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f",
                                                                                               "arguments": "{}"}}]},
        {"role": "tool", "content": "r"}])
    assert msgs[2] == {"role": "tool", "content": "r"}


@pytest.mark.parametrize("key", ["smollm2", "qwen2"])
def test_embeddings_rank_paraphrases_above_unrelated(key):
    llm = pyllm_model(key, n_ctx=512, n_threads=1)
    before = llm.generate("The capital of France is", max_tokens=6, temperature=0)
    texts = ["The cat sat on the mat.", "A cat was sitting on the rug.",
             "Quarterly revenue rose by eight percent.", "The stock market fell sharply today."]
    e = torch.tensor(llm.embed(texts))
    assert e.shape == (4, llm.config.n_embd)
    assert torch.allclose(e.norm(dim=1), torch.ones(4), atol=1e-5)
    sim = e @ e.T
    # each text's nearest other text is its paraphrase, by a margin
    for i, j in ((0, 1), (1, 0), (2, 3), (3, 2)):
        others = [k for k in range(4) if k not in (i, j)]
        assert sim[i, j] > max(sim[i, k] for k in others) + 0.05, (i, j, sim)
    assert llm.embed("one text") == llm.embed(["one text"])[0]
    # embedding leaves the model as it was: generation gives the same text
    assert llm.generate("The capital of France is", max_tokens=6, temperature=0) == before
    with pytest.raises(PyllmError):
        llm.embed([])


def test_each_llm_runs_on_the_threads_it_was_loaded_with(llm, monkeypatch):
    """torch's and the kernels' thread counts are settings of the process, so loading a second LLM with
    n_threads=2 set them for the first one too.  Each LLM loaded with n_threads computes on them (as
    llama-cpp-python's Llama applies its n_threads on each evaluation): whole calls one after the other, and two
    streams read in turn.  Reference: both counts read inside the model's step on every forward, tolerance 0."""
    two = pyllm_model("smollm2", n_ctx=256, n_threads=2)
    seen = []
    for model, n in ((llm.model, 1), (two.model, 2)):
        for name in ("step", "fused_logits"):
            def spy(*a, _f=getattr(model, name), _n=n, **kw):
                seen.append((_n, torch.get_num_threads(), ops.get_num_threads()))
                return _f(*a, **kw)
            monkeypatch.setattr(model, name, spy)
    for m in (llm, two, llm):
        m.reset()
        m.generate("Count: one, two,", max_tokens=4, temperature=0)
    streams = [m.create_completion("List three colors:", max_tokens=5, temperature=0, stream=True) for m in (llm, two)]
    for _ in zip(*streams):  # each next() resumes one LLM's stream after the other's
        pass
    assert {n for n, _, _ in seen} == {1, 2} and len(seen) > 20
    assert all(torch_n == n and ops_n == n for n, torch_n, ops_n in seen), sorted(set(seen))
