"""What batching makes possible: several prompts and several choices per call, in the library and the server.

References: each prompt's text when it runs alone (greedy tokens do not depend on what runs beside them: the
step's rows are bit for bit a single sequence's, tests/test_step.py), and for a seeded choice j of n, the
request with n=1 and seed + j.  Library: `llm.generate_batch`, `llm.create_completion` with a list of prompts and
`n`.  Server: the official openai client against `pyllm serve --parallel 4` on 127.0.0.1.  Every wait is bounded.
"""

import concurrent.futures

import pytest

from conftest import fixture_path, pyllm_model
from server_harness import KEY, Server

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village",
           "1, 2, 3, 4,", "Water boils at", "The quick brown fox", "import numpy as np\n", "Dear Sir or Madam,"]


@pytest.fixture(scope="module")
def llm():
    return pyllm_model("smollm2", n_ctx=256, n_threads=1)


def test_generate_batch_gives_each_prompt_its_own_greedy_text(llm):
    """Short prompts (one prefill chunk either way): the batch's texts are generate's, bit for bit."""
    alone = []
    for p in PROMPTS[:5]:
        llm.reset()  # a fresh prefill, as the batch's sequences have
        alone.append(llm.generate(p, max_tokens=12, temperature=0))
    assert llm.generate_batch(PROMPTS[:5], max_tokens=12, temperature=0) == alone
    # the same prompt twice: two sequences, one prefill, the same text
    assert llm.generate_batch([PROMPTS[0], PROMPTS[0]], max_tokens=12, temperature=0) == [alone[0]] * 2


def test_create_completion_takes_a_list_of_prompts_and_n(llm):
    kw = dict(max_tokens=10, temperature=0)
    solo = [llm.create_completion(p, **kw) for p in PROMPTS[:3]]
    alone = [x["choices"][0]["text"] for x in solo]
    r = llm.create_completion(PROMPTS[:3], n=2, **kw)
    assert [c["index"] for c in r["choices"]] == list(range(6))
    # choices of prompt i are at indices 2i and 2i+1
    assert [c["text"] for c in r["choices"]] == [t for t in alone for _ in range(2)]
    ids = [len(llm.tokenize(p)) for p in PROMPTS[:3]]
    u = r["usage"]
    assert u["prompt_tokens"] == sum(ids)  # each prompt counted once, whatever n
    assert u["completion_tokens"] == 2 * sum(x["usage"]["completion_tokens"] for x in solo)
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert llm.stats.prompt_evaluated == sum(ids)  # one prefill per prompt: the second choice is a fork


def test_seeded_choices_are_the_requests_with_seed_plus_j(llm):
    kw = dict(max_tokens=10, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    r = llm.create_completion(PROMPTS[2], n=3, seed=7, **kw)
    want = [llm.create_completion(PROMPTS[2], seed=7 + j, **kw)["choices"][0]["text"] for j in range(3)]
    assert [c["text"] for c in r["choices"]] == want
    assert len(set(want)) > 1  # different seeds, different draws (a 49k-token vocabulary at temperature 1)


def test_a_library_call_is_a_request_of_the_llms_engine(llm):
    """A single call runs as a batch of one in the LLM's own engine, on the LLM's sequence: a stream left
    unfinished is ended by the next call (which gets what it gets alone), a speculating stream stopped after k
    tokens leaves the cache holding the prompt and k - 1 of them (as plain decoding leaves it), and nothing stays
    in the engine after either.  Reference: the same call on a reset LLM, and the token counts."""
    ids = llm.tokenize(PROMPTS[3])
    llm.reset()
    alone = list(llm.generate_tokens(ids, max_tokens=12, temperature=0, speculative="none"))
    left = llm.generate_tokens(ids, max_tokens=12, temperature=0, speculative="none")
    next(left)  # started, then left unfinished
    assert list(llm.generate_tokens(ids, max_tokens=12, temperature=0, speculative="none")) == alone
    assert llm.engine.active == 0 and llm.engine.waiting == 0
    left.close()
    stream = llm.generate_tokens(ids, max_tokens=12, temperature=0, speculative="lookup", spec_k=4)
    got = [next(stream) for _ in range(5)]
    stream.close()
    assert llm.generator.tokens == ids + got[:4]
    assert llm.engine.active == 0


def test_chat_n_choices_are_the_requests_with_seed_plus_j(llm):
    """Chat's n, as completions': choice j is the request with n=1 and seed + j (one prefill for them all),
    greedy choices are the greedy reply, and a stream names each chunk's choice."""
    msgs = [{"role": "user", "content": "Name a fruit."}]
    kw = dict(max_tokens=10, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    r = llm.create_chat_completion(msgs, n=3, seed=11, **kw)
    solo = [llm.create_chat_completion(msgs, seed=11 + j, **kw) for j in range(3)]
    want = [x["choices"][0]["message"]["content"] for x in solo]
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in r["choices"]] == want
    assert len(set(want)) > 1  # different seeds, different draws
    assert r["usage"]["prompt_tokens"] == solo[0]["usage"]["prompt_tokens"]  # the prompt counted once
    assert r["usage"]["completion_tokens"] == sum(x["usage"]["completion_tokens"] for x in solo)
    greedy = llm.create_chat_completion(msgs, max_tokens=10, temperature=0)["choices"][0]["message"]["content"]
    texts, usage = {}, None
    for ch in llm.create_chat_completion(msgs, n=2, max_tokens=10, temperature=0, stream=True,
                                         stream_options={"include_usage": True}):
        for c in ch["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
        usage = ch.get("usage") or usage
    assert texts == {0: greedy, 1: greedy}
    assert usage["prompt_tokens"] == solo[0]["usage"]["prompt_tokens"]


def test_streamed_choices_carry_their_index(llm):
    r = llm.create_completion([PROMPTS[0], PROMPTS[3]], max_tokens=8, temperature=0)
    chunks = list(llm.create_completion([PROMPTS[0], PROMPTS[3]], max_tokens=8, temperature=0, stream=True))
    texts = ["", ""]
    finished = [None, None]
    for ch in chunks:
        for c in ch["choices"]:
            texts[c["index"]] += c["text"]
            finished[c["index"]] = c["finish_reason"] or finished[c["index"]]
    assert texts == [c["text"] for c in r["choices"]]
    assert finished == [c["finish_reason"] for c in r["choices"]]


def test_bad_batches_are_refused_naming_what(llm):
    from pyllm.errors import BadRequest, PyllmError

    for prompt in ([], [["a"]], [PROMPTS[0], 3], ["x"] * 65):
        with pytest.raises(BadRequest) as e:
            llm.create_completion(prompt, max_tokens=1)
        assert e.value.param == "prompt", prompt
    for n in (0, 65, 1.5, "2"):
        with pytest.raises(BadRequest) as e:
            llm.create_completion("Hi", n=n, max_tokens=1)
        assert e.value.param == "n", n
    with pytest.raises(PyllmError, match="list of prompts"):
        llm.generate_batch("one prompt")
    with pytest.raises(PyllmError, match="context holds"):
        llm.generate_batch(["Hi", [1] * 256], max_tokens=1)


def test_choices_of_a_cancelled_or_failed_prompt_end_with_it(llm):
    """A request's forks start from its prefill; one that never completes it ends them too, and frees every slot
    (else their readers would wait forever)."""
    from pyllm.runtime.batch import BatchEngine, make_requests
    from pyllm.runtime.sampler import Sampler, SamplerSettings

    ids = llm.tokenize(PROMPTS[0])
    engine = BatchEngine(llm.model, "f16", 64, 3, llm.tokenizer.is_eog, thread=False)
    calls = [(ids, 4, Sampler(SamplerSettings(temperature=0))) for _ in range(3)]
    reqs, top = make_requests(calls)
    assert len(top) == 1 and top[0].forks == reqs[1:]
    engine.submit(top[0])
    top[0].cancel.set()
    for r in reqs:
        assert [item[0] for item in engine.tokens(r)] == ["end"]
    assert not any(s.busy for s in engine.slots)
    # a prompt the slots' caches cannot hold fails in its prefill: its forks get the same error
    reqs, top = make_requests([(list(range(1, 70)), 4, Sampler(SamplerSettings(temperature=0)))] * 2)
    with pytest.raises(Exception, match="context holds"):
        engine.submit(top[0])
    engine.n_ctx = 128  # past the check at submit: the prefill itself runs out of cache rows
    engine.submit(top[0])
    for r in reqs:
        items = list(engine.tokens(r))
        assert [i[0] for i in items] == ["error"] and "KV cache holds 64" in str(items[0][1])
    assert not any(s.busy for s in engine.slots)
    # and a fork group larger than the engine's slots is refused when submitted, not left waiting
    reqs, top = make_requests(calls * 2, group=8)
    with pytest.raises(Exception, match="parallel sequences"):
        engine.submit(top[0])


def test_readme_example(llm):
    """README's "Several prompts at once", as written there."""
    both = ["The capital of France is", "Water boils at"]
    texts = llm.generate_batch(both, max_tokens=12, temperature=0)
    assert texts == [llm.generate_batch([p], max_tokens=12, temperature=0)[0] for p in both]
    r = llm.create_completion(both, n=2, max_tokens=12, temperature=0.8, seed=1)
    got = [c["text"] for c in r["choices"]]
    want = [llm.create_completion(p, max_tokens=12, temperature=0.8, seed=1 + j)["choices"][0]["text"]
            for p in both for j in range(2)]
    assert got == want


# ---- the server --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def par():
    s = Server(fixture_path("smollm2"), "--alias", "smollm2", "--ctx", "512", "--api-key", KEY, "--parallel", "4")
    yield s
    s.close()


def _complete(server, prompt, **kw):
    r = server.client().completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0, **kw)
    return [c.text for c in sorted(r.choices, key=lambda c: c.index)]


def test_eight_concurrent_greedy_clients_each_get_their_text_alone(par):
    alone = [_complete(par, p)[0] for p in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        together = list(ex.map(lambda p: _complete(par, p)[0], PROMPTS, timeout=600))
    assert together == alone
    m = par.metrics()
    assert m["pyllm_slots_busy"] == 0 and m["pyllm_queue_depth"] == 0


def test_server_chat_n(par):
    """/v1/chat/completions with n through the official client: greedy choices are the reply alone, seeded choice
    j is the request with seed + j, a stream names each chunk's choice."""
    msgs = [{"role": "user", "content": "Name a color."}]
    chat = par.client().chat.completions.create
    alone = chat(model="smollm2", messages=msgs, max_tokens=8, temperature=0).choices[0].message.content
    r = chat(model="smollm2", messages=msgs, max_tokens=8, temperature=0, n=2)
    assert [c.message.content for c in sorted(r.choices, key=lambda c: c.index)] == [alone] * 2
    kw = dict(model="smollm2", messages=msgs, max_tokens=8, temperature=1.0, top_p=1.0)
    r = chat(n=2, seed=3, **kw)
    want = [chat(seed=3 + j, **kw).choices[0].message.content for j in range(2)]
    assert [c.message.content for c in sorted(r.choices, key=lambda c: c.index)] == want
    texts = {}
    for ch in chat(model="smollm2", messages=msgs, max_tokens=8, temperature=0, n=2, stream=True):
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert texts == {0: alone, 1: alone}


def test_server_n_and_list_prompts(par):
    alone = [_complete(par, p)[0] for p in PROMPTS[:3]]
    assert _complete(par, PROMPTS[0], n=2) == [alone[0]] * 2
    assert _complete(par, PROMPTS[:3]) == alone
    r = par.client().completions.create(model="smollm2", prompt=PROMPTS[:2], n=2, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [alone[0]] * 2 + [alone[1]] * 2
    one = [par.client().completions.create(model="smollm2", prompt=p, max_tokens=1).usage.prompt_tokens
           for p in PROMPTS[:2]]
    assert r.usage.prompt_tokens == sum(one)
    # streamed: each chunk names its choice
    texts = {}
    for ch in par.client().completions.create(model="smollm2", prompt=PROMPTS[:2], max_tokens=12, temperature=0,
                                              stream=True):
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[0], texts[1]] == alone[:2]
    # more choices of one prompt than parallel sequences: forked in groups that fit, the rest wait their turn
    assert _complete(par, PROMPTS[0], n=5) == [alone[0]] * 5

