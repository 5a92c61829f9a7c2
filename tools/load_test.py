"""Load generator for `pyllm serve`: C concurrent streaming chat clients over loopback, for each C in --streams.

Per level it prints aggregate generated tok/s (all streams' tokens / wall time, prefill included) and its ratio
to the first level's; the steady decode rate (content chunks that arrive while every stream is decoding, i.e.
between the last stream's first token and the first stream's end, per second: the batched step's throughput as a
client sees it) and its ratio; per-stream decode tok/s (median of a stream's tokens after its first / the time
after its first); time to first token p50 / p95 / max; and the CPU this load generator used (its share of one
core over the level's wall time: it shares the cores with the server on one machine, so it must stay small).

The default client reads the SSE stream with http.client and looks at each event's bytes without parsing its JSON
(only the last, the usage chunk, is parsed), and lowers its own priority (--nice) so the server's compute threads
win the cores. ``--client openai`` drives the same requests through the official openai client instead (heavier:
a correctness check of the stream, not a measurement of the server).

    python tools/load_test.py --spawn smollm2-135m --serve-args "--parallel 8 --threads 2" --streams 1,2,4,8
    python tools/load_test.py --url http://127.0.0.1:8080 --model smollm2-135m     # a server already running

``--in-process MODEL`` runs the same requests through the server's engine in this process (runtime/batch.py's
BatchEngine on its own thread, the chat template, greedy, no speculation: a server's ``--spec none``), each client a
thread that reads its request's tokens as they come: the figures without HTTP, to set beside a spawned server's
(its "client CPU" is then the engine's too).

    python tools/load_test.py --in-process smollm2-135m --threads 2 --streams 1,4 -n 256 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from http.client import HTTPConnection
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("river stone lantern orchard copper meadow harbor violet thunder canyon ember willow glacier "
         "falcon saffron prairie").split()


def prompt_of(i: int, n_words: int) -> str:
    body = " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(n_words))
    return f"Stream {i}. Here is a list of words: {body}. Write a long story that uses these words."


def has_content(event: bytes) -> bool:
    """Whether a chat.completion.chunk's bytes carry a non-empty delta content (compact or spaced JSON)."""
    at = event.find(b'"content":')
    if at < 0:
        return False
    rest = event[at + 10:].lstrip()
    return rest[:1] == b'"' and rest[1:2] != b'"'


def raw_stream(url: str, model: str, prompt: str, max_tokens: int, key: str | None) -> dict:
    u = urllib.parse.urlparse(url)
    conn = HTTPConnection(u.hostname, u.port, timeout=600)
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, headers)
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
    times, usage = [], None
    for line in r:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        if has_content(line):
            times.append(time.perf_counter())
        elif b'"usage":' in line and b'"usage": null' not in line and b'"usage":null' not in line:
            usage = json.loads(line[6:])["usage"]
    end = time.perf_counter()
    conn.close()
    return dict(start=t0, times=times, end=end, usage=usage)


def openai_stream(url: str, model: str, prompt: str, max_tokens: int, key: str | None) -> dict:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key=key or "none", max_retries=0, timeout=600)
    t0 = time.perf_counter()
    times, usage, text = [], None, []
    for ch in client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                             max_tokens=max_tokens, temperature=0, stream=True,
                                             stream_options={"include_usage": True}):
        if ch.usage is not None:
            usage = {"prompt_tokens": ch.usage.prompt_tokens, "completion_tokens": ch.usage.completion_tokens}
        if ch.choices and ch.choices[0].delta.content:
            times.append(time.perf_counter())
            text.append(ch.choices[0].delta.content)
    return dict(start=t0, times=times, end=time.perf_counter(), usage=usage, text="".join(text))


def level(client, url: str, model: str, streams: int, n_words: int, max_tokens: int, key: str | None,
          run: int) -> dict:
    results: list[dict | None] = [None] * streams
    errors: list[BaseException] = []

    def one(i):
        try:
            results[i] = client(url, model, prompt_of(run * 100 + i, n_words), max_tokens, key)
        except BaseException as e:  # reported below, in the main thread
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(streams)]
    cpu0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=1200)
    wall = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    if errors:
        raise RuntimeError(f"a stream failed: {errors[0]}")
    if any(r is None or r["usage"] is None or not r["times"] for r in results):
        raise RuntimeError("a stream did not finish (no usage chunk or no content)")
    ttft = sorted(r["times"][0] - r["start"] for r in results)
    tokens = [r["usage"]["completion_tokens"] for r in results]
    per = [(n - 1) / (r["end"] - r["times"][0]) for r, n in zip(results, tokens) if n > 1 and r["end"] > r["times"][0]]
    # the window in which every stream is decoding: content chunks that arrive in it, per second
    lo, hi = max(r["times"][0] for r in results), min(r["times"][-1] for r in results)
    in_window = sum(sum(1 for x in r["times"] if lo < x <= hi) for r in results)
    return dict(streams=streams, prompt_tokens=statistics.mean(r["usage"]["prompt_tokens"] for r in results),
                aggregate_tps=sum(tokens) / wall,
                steady_tps=in_window / (hi - lo) if hi > lo and in_window else 0.0,
                steady_window_s=max(hi - lo, 0.0),
                per_stream_tps=statistics.median(per) if per else 0.0,
                ttft_p50=statistics.median(ttft), ttft_p95=ttft[min(len(ttft) - 1, round(0.95 * (len(ttft) - 1)))],
                ttft_max=ttft[-1], wall=wall,
                client_cpu=(cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime) / wall,
                texts=[r.get("text") for r in results])


def engine_client(model: str, slots: int, threads: int, n_ctx: int):
    """A client (raw_stream's signature and result) whose requests run in this process through the server's engine:
    greedy, no speculation, the model's chat template.  The url and key are not used."""
    sys.path.insert(0, str(ROOT))
    import pyllm
    from pyllm.runtime import batch
    from pyllm.runtime.sampler import Sampler

    llm = pyllm.load(model, n_ctx=n_ctx, n_threads=threads, quiet=True)
    engine = batch.BatchEngine(llm.model, llm.kv.kind, n_ctx, slots, llm.tokenizer.is_eog)

    def run(url: str, model: str, prompt: str, max_tokens: int, key: str | None) -> dict:
        ids = llm.chat_ids([{"role": "user", "content": prompt}])
        t0 = time.perf_counter()
        req = engine.submit(batch.Request(ids=list(ids), max_tokens=max_tokens, sampler=Sampler(temperature=0)))
        times, toks = [], []
        for item in batch.queue_items(req):
            if item[0] == "error":
                raise item[1]
            if item[0] == "token":
                toks.append(item[1])
                if not llm.tokenizer.is_eog(item[1]):  # what a stream sends as content
                    times.append(time.perf_counter())
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(toks)}
        return dict(start=t0, times=times, end=time.perf_counter(), usage=usage, text=llm.detokenize(toks))

    return run, engine


def spawn(model: str, port: int, extra: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.Popen([sys.executable, "-m", "pyllm.cli.main", "serve", model, "--port", str(port), *extra],
                         cwd=ROOT, env=env)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if p.poll() is not None:
            raise SystemExit(f"pyllm serve exited with {p.returncode}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).close()
            return p
        except OSError:
            time.sleep(0.5)
    p.terminate()
    raise SystemExit("pyllm serve did not start within 600 s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--model", default="smollm2-135m", help="model id sent in requests (and served with --spawn)")
    ap.add_argument("--spawn", metavar="MODEL", default=None, help="start `pyllm serve MODEL` on a free port first")
    ap.add_argument("--serve-args", default="", help="extra arguments for the spawned server, e.g. '--ctx 4096'")
    ap.add_argument("--streams", default="1,2,4,8", help="concurrency levels (default 1,2,4,8)")
    ap.add_argument("--prompt-tokens", type=int, default=200, help="approximate prompt length (default 200)")
    ap.add_argument("-n", "--max-tokens", type=int, default=64, help="tokens per stream (default 64)")
    ap.add_argument("--client", choices=("raw", "openai"), default="raw",
                    help="raw: http.client, no JSON parsing per event (default); openai: the official client")
    ap.add_argument("--nice", type=int, default=10, help="lower this process's priority by N (default 10; the "
                                                         "spawned server keeps its own)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--repeat", type=int, default=1, help="runs per level, each with prompts of its own; every "
                                                           "figure is the median over them (default 1)")
    ap.add_argument("--json", action="store_true", help="one JSON object per level")
    ap.add_argument("--in-process", metavar="MODEL", default=None,
                    help="no server: the requests run through the server's engine in this process")
    ap.add_argument("--threads", type=int, default=2, help="kernel threads with --in-process (default 2)")
    a = ap.parse_args(argv)
    proc = engine = None
    levels = [int(x) for x in a.streams.split(",")]
    if a.in_process:
        client, engine = engine_client(a.in_process, max(levels), a.threads,
                                       a.prompt_tokens + a.max_tokens + 128)
        a.model, a.nice = a.in_process, 0  # the engine's threads are this process's: they keep their priority
    elif a.spawn:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = spawn(a.spawn, port, a.serve_args.split())
        a.url, a.model = f"http://127.0.0.1:{port}", a.spawn
    if a.nice:
        os.nice(a.nice)  # after the spawn: the server must not inherit it; threads started below do
    if engine is None:
        client = raw_stream if a.client == "raw" else openai_stream
    try:
        n_words = max(1, int(a.prompt_tokens / 1.3) - 20)  # about 1.3 tokens per word, ~20 for the template
        level(client, a.url, a.model, 1, n_words, 4, a.api_key, 99)  # warm-up: extension, caches
        if not a.json:
            print(f"{'streams':>7} {'prompt':>7} {'agg tok/s':>10} {'ratio':>6} {'steady':>8} {'ratio':>6} "
                  f"{'per-stream':>11} {'TTFT p50':>9} {'TTFT p95':>9} {'TTFT max':>9} {'client CPU':>10}")
        base = None
        for i, c in enumerate(levels):
            runs = [level(client, a.url, a.model, c, n_words, a.max_tokens, a.api_key, i + 10 * k)
                    for k in range(max(1, a.repeat))]
            r = {key: statistics.median(x[key] for x in runs) for key in runs[0] if key != "texts"}
            base = base or r
            r["ratio"] = r["aggregate_tps"] / base["aggregate_tps"] if base["aggregate_tps"] else 0.0
            r["steady_ratio"] = r["steady_tps"] / base["steady_tps"] if base["steady_tps"] else 0.0
            if a.json:
                print(json.dumps(r), flush=True)
            else:
                print(f"{c:>7} {r['prompt_tokens']:>7.0f} {r['aggregate_tps']:>10.1f} {r['ratio']:>5.2f}x "
                      f"{r['steady_tps']:>8.1f} {r['steady_ratio']:>5.2f}x {r['per_stream_tps']:>11.1f} "
                      f"{r['ttft_p50']:>8.2f}s {r['ttft_p95']:>8.2f}s {r['ttft_max']:>8.2f}s "
                      f"{r['client_cpu'] * 100:>9.0f}%", flush=True)
    finally:
        if proc:
            proc.terminate()
            proc.wait(timeout=30)
        if engine is not None:
            engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
