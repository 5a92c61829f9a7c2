"""`pyllm serve --replicas N`: the OpenAI routes on N Ray Serve replicas, driven by the official openai client.

The reference: the library's own greedy completion of the same prompt (every replica must return it). Each
response names the replica process that made it (the x-pyllm-replica header); requests are sent until both
replicas have answered (rounds of 8 concurrent requests, for at most 600 s). The Ray test needs the ray extra, which the
test extra installs; the argument checks run without Ray.
"""

import concurrent.futures
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from conftest import cli_in_process, fixture_path, pyllm_model

PROMPT = "The capital of France is"


@pytest.fixture
def cli(monkeypatch, capsys):
    return cli_in_process(monkeypatch, capsys)


def test_replicas_out_of_range_is_one_error(cli):
    r = cli("serve", fixture_path("smollm2"), "--replicas", "0", "--port", "0")
    assert r.returncode == 2
    assert "argument --replicas: must be in [1, 64], got 0" in r.stderr and "Traceback" not in r.stderr


def test_replicas_refuse_a_shared_prompt_cache(cli, tmp_path):
    r = cli("serve", fixture_path("smollm2"), "--replicas", "2", "--prompt-cache", str(tmp_path), "--port", "0")
    assert r.returncode == 1
    assert "--prompt-cache cannot be shared by --replicas" in r.stderr and "Traceback" not in r.stderr


def test_replicas_without_ray_name_the_extra(cli, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now raises ImportError, as where it is absent
    r = cli("serve", fixture_path("smollm2"), "--replicas", "2", "--port", "0")
    assert r.returncode == 1
    assert 'needs Ray Serve (ray is missing): pip install "pyllm[ray]"' in r.stderr
    assert "Traceback" not in r.stderr


def test_two_ray_replicas_both_answer_with_the_librarys_text():
    pytest.importorskip("ray.serve", reason="the ray extra is not installed: pip install -e '.[ray]'")
    from server_harness import Server

    # The README's command, run on the fixture's file with a small context.
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    model, replicas = re.search(r"^pyllm serve (\S+) --replicas (\d+) --port 8080$", readme, re.M).groups()
    assert model == "smollm2-135m" and replicas == "2"
    llm = pyllm_model("smollm2", n_ctx=512, n_threads=1)
    llm.reset()  # from an empty cache, as the fresh replicas start: a reused prefix can change the greedy text
    want = llm.create_completion(PROMPT, max_tokens=6, temperature=0)["choices"][0]["text"]
    s = Server(fixture_path("smollm2"), "--replicas", replicas, "--alias", "smollm2", "--ctx", "512")
    try:
        client = s.client(key="none")

        def ask(_):
            raw = client.completions.with_raw_response.create(model="smollm2", prompt=PROMPT, max_tokens=6,
                                                              temperature=0)
            return raw.headers["x-pyllm-replica"], raw.parse().choices[0].text

        # The proxy answers as soon as one replica runs; the other may still be loading (or compiling the
        # extension on a first run), so ask in rounds until both have answered or 600 s have passed.
        answers, deadline = [], time.monotonic() + 600
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            while time.monotonic() < deadline:
                answers += pool.map(ask, range(8))
                if len({r for r, _ in answers}) == 2:
                    break
                time.sleep(1)
        assert len({r for r, _ in answers}) == 2, f"one replica answered every request: {answers[0][0]}"
        assert {t for _, t in answers} == {want}

        stream = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=4, temperature=0, stream=True)
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")

        # the replicas build the same app: a local page's preflight passes Ray's proxy and is answered, another's not
        from server_harness import _cors

        status, h = _cors(s, "/v1/chat/completions", "http://localhost:3000")
        assert status == 200 and h["access-control-allow-origin"] == "http://localhost:3000", h
        assert _cors(s, "/v1/chat/completions", "https://evil.example")[1] == {}
    finally:
        s.close()
    assert s.proc.returncode == 0, s.output()


def test_sigterm_while_the_replicas_start_stops_ray_cleanly(monkeypatch):
    """The proxy answers /health as soon as one replica runs, while serve.run still waits for the others: a SIGTERM
    then (a service manager, a test's teardown) must shut Ray down and exit 0, not hit the handler Ray's core
    worker installs, which aborts (exit -6) and leaves Ray's processes running. Ctrl-C takes the same handler
    (default_int_handler for both signals); measured once by hand rather than a second 45 s Ray start in CI.  The server starts a Ray
    instance of its own even with RAY_ADDRESS naming another (here one that does not exist): ray.init connected
    there and refused num_cpus."""
    pytest.importorskip("ray.serve", reason="the ray extra is not installed: pip install -e '.[ray]'")
    from server_harness import Server

    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # the server's environment is a copy of this one
    s = Server(fixture_path("smollm2"), "--replicas", "3", "--ctx", "256")  # returns at the first healthy answer
    s.proc.send_signal(signal.SIGTERM)
    try:
        s.proc.wait(timeout=s.grace)
    finally:
        s.close()
    out = s.output()
    assert s.proc.returncode == 0, out
    assert "stopping the replicas" in out and "Traceback" not in out
