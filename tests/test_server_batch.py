"""`pyllm serve --parallel N` and `--prompt-cache DIR`, driven by the official openai client over 127.0.0.1.

References: the same server's answer to a request alone (batched decoding and prompt reuse must not change a
greedy result: the batched step's rows are bit-identical to the one-sequence step, tests/test_decode_batch.py),
OpenAI's documented shapes. Every wait is bounded.
"""

import concurrent.futures
import json
import time

import pytest

from conftest import fixture_path, pyllm_model
from server_harness import KEY, Server, _chat, check_echoed_prompt_logprobs

LONG = ("You are a careful assistant. Answer in one short paragraph, plainly, without lists. "
        "The user asks about rivers, stones, lanterns, orchards, copper, meadows and harbors. ") * 3


@pytest.fixture(scope="module")
def par():
    s = Server(fixture_path("smollm2"), "--alias", "smollm2", "--ctx", "512", "--api-key", KEY, "--parallel", "4")
    yield s
    s.close()


def _ask(server, text, n=12, **kw):
    r = server.client().chat.completions.create(model="smollm2", messages=_chat(text), max_tokens=n, temperature=0,
                                                **kw)
    return r.choices[0].message.content


def _stream(server, text, n=12):
    st = server.client().chat.completions.create(model="smollm2", messages=_chat(text), max_tokens=n, temperature=0,
                                                 stream=True)
    return "".join(ch.choices[0].delta.content or "" for ch in st if ch.choices)


def test_greedy_alone_equals_beside_three_others(par):
    prompts = [f"Count from {i} to {i + 5}." for i in range(4)] + [LONG + "What is a river?"]
    solo = [_ask(par, p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        # one request streams, three do not: the streaming path and whole responses share the batch
        futs = [ex.submit(_stream, par, prompts[0])] + [ex.submit(_ask, par, p) for p in prompts[1:4]]
        together = [f.result(timeout=600) for f in futs]
    assert together == solo[:4]
    with concurrent.futures.ThreadPoolExecutor(8) as ex:  # more requests than slots: the rest wait their turn
        again = list(ex.map(lambda p: _ask(par, p), prompts * 2, timeout=600))
    assert again == solo * 2
    m = par.metrics()
    assert m["pyllm_slots_busy"] == 0 and m["pyllm_queue_depth"] == 0


def test_each_request_keeps_its_own_limits(par):
    """max_tokens, stop strings and a JSON schema apply per request while others decode beside them."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    c = par.client()

    def short():
        return c.chat.completions.create(model="smollm2", messages=_chat("Tell a long story."), max_tokens=3,
                                         temperature=0)

    def stopped():
        return c.chat.completions.create(model="smollm2", messages=_chat("Count from 1 to 9, one per line."),
                                         max_tokens=40, temperature=0, stop=["4"])

    def structured():
        return c.chat.completions.create(model="smollm2", messages=_chat("Give a number as JSON."), max_tokens=60,
                                         temperature=0,
                                         response_format={"type": "json_schema",
                                                          "json_schema": {"name": "n", "schema": schema}})

    with concurrent.futures.ThreadPoolExecutor(3) as ex:
        a, b, j = (f.result(timeout=600) for f in [ex.submit(short), ex.submit(stopped), ex.submit(structured)])
    assert a.usage.completion_tokens == 3 and a.choices[0].finish_reason == "length"
    assert "4" not in b.choices[0].message.content and b.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(j.choices[0].message.content)["n"], int)


def test_disconnect_frees_the_slot(par):
    c = par.client()
    streams = [c.chat.completions.create(model="smollm2", messages=_chat(f"Tell a very long story about {w}."),
                                         max_tokens=400, temperature=0, stream=True) for w in ("dragons", "ships")]
    for st in streams:
        for i, _ in enumerate(st):
            if i == 3:
                break
        st.close()
    deadline = time.monotonic() + 60
    while par.metrics()["pyllm_slots_busy"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert par.metrics()["pyllm_slots_busy"] == 0
    assert _ask(par, "Say hi.", n=4)


def test_shared_prefix_is_reused_and_counted(par):
    before = par.metrics()
    first = _ask(par, LONG + "What is copper?")
    again = _ask(par, LONG + "What is copper?")
    other = _ask(par, LONG + "What is a meadow?")
    m = par.metrics()
    assert m["pyllm_prompt_cache_hits_total"] - before["pyllm_prompt_cache_hits_total"] >= 2
    assert m["pyllm_prompt_cache_tokens_total"] - before["pyllm_prompt_cache_tokens_total"] >= 128
    assert again == first and other


def test_prompt_cache_survives_a_restart_and_ignores_bad_files(tmp_path):
    d = tmp_path / "pc"
    args = ("--alias", "smollm2", "--ctx", "512", "--prompt-cache", str(d))
    s = Server(fixture_path("smollm2"), *args)
    try:
        fresh = _ask(s, LONG + "What is a harbor?")
    finally:
        s.close()
    files = sorted(d.glob("*.safetensors"))
    assert len(files) == 1
    (d / "broken.safetensors").write_bytes(files[0].read_bytes()[:1000])  # truncated
    (d / "foreign.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": 1}        ")
    s = Server(fixture_path("smollm2"), *args)
    try:
        cached = _ask(s, LONG + "What is a harbor?")
        m = s.metrics()
        assert m["pyllm_prompt_cache_disk_hits_total"] == 1 and m["pyllm_prompt_cache_tokens_total"] >= 128
        assert cached == fresh  # reused rows are the ones a fresh prefill computes
    finally:
        s.close()
    log = s.output()
    for name in ("broken.safetensors", "foreign.safetensors"):
        lines = [ln for ln in log.splitlines() if name in ln]
        assert len(lines) == 1 and lines[0].startswith("pyllm serve: prompt cache: ignoring"), log
    assert "Traceback" not in log


def test_echo_with_logprobs_scores_the_prompt_on_the_engine_thread(par):
    """The prompt is scored on the engine's thread, between its steps (the model has one thread)."""
    check_echoed_prompt_logprobs(par, pyllm_model("smollm2", n_ctx=512, n_threads=1))


def test_ollama_routes_run_in_the_batch(par):
    """Ollama's /api routes go through the same engine: a greedy chat beside another request equals the OpenAI
    route's reply alone, its counts and durations are its own slot's, and embeddings run between the steps."""
    import ollama

    c = ollama.Client(host=par.base, headers={"Authorization": f"Bearer {KEY}"}, timeout=300)
    solo = _ask(par, "Count from 3 to 8.")
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        other = ex.submit(_ask, par, "Count from 0 to 5.")
        parts = list(c.chat(model="smollm2", messages=_chat("Count from 3 to 8."), stream=True,
                            options={"temperature": 0, "num_predict": 12}))
        other.result(timeout=600)
    assert "".join(p.message.content for p in parts) == solo
    last = parts[-1]
    assert last.done and last.eval_count == 12 and last.eval_duration > 0 and last.prompt_eval_duration > 0
    r = c.generate(model="smollm2", prompt="Count from 3 to 8.", options={"temperature": 0, "num_predict": 12})
    assert r.response == solo and len(r.context) > r.prompt_eval_count  # the prompt's ids, then the reply's
    assert len(c.embed(model="smollm2", input="a river").embeddings[0]) == 576
