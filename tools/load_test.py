"""Load generator for `pyllm serve`: C concurrent streaming chat clients over loopback, for each C in --streams.

Per level it prints aggregate generated tok/s (all streams' tokens / wall time, prefill included), aggregate decode
tok/s (tokens after each stream's first / from the first stream's first token to the last stream's end), per-stream
decode tok/s (a stream's tokens after its first / the time after its first), time to first token (p50, max), and
each aggregate's ratio to the first level's. Standard library only.

    python tools/load_test.py --spawn smollm2-135m --serve-args "--parallel 8 --threads 1" --streams 1,2,4,8
    python tools/load_test.py --url http://127.0.0.1:8080 --model smollm2-135m     # a server already running
"""

from __future__ import annotations

import argparse
import json
import os
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


def one_stream(url: str, model: str, prompt: str, max_tokens: int, key: str | None, out: dict) -> None:
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
    first = None
    usage = None
    for line in r:
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            usage = chunk["usage"]
        elif first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
            first = time.perf_counter()
    end = time.perf_counter()
    conn.close()
    n = usage["completion_tokens"] if usage else 0
    out.update(start=t0, first=first or end, end=end, tokens=n, prompt_tokens=usage["prompt_tokens"] if usage else 0)


def level(url: str, model: str, streams: int, n_words: int, max_tokens: int, key: str | None, run: int) -> dict:
    results = [{} for _ in range(streams)]
    threads = [threading.Thread(target=one_stream, args=(url, model, prompt_of(run * 100 + i, n_words), max_tokens,
                                                         key, results[i])) for i in range(streams)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=1200)
    wall = time.perf_counter() - t0
    if any(not r for r in results):
        raise RuntimeError("a stream did not finish")
    ttft = [r["first"] - r["start"] for r in results]
    per = [(r["tokens"] - 1) / (r["end"] - r["first"]) for r in results if r["tokens"] > 1 and r["end"] > r["first"]]
    span = max(r["end"] for r in results) - min(r["first"] for r in results)
    return dict(streams=streams, prompt_tokens=statistics.mean(r["prompt_tokens"] for r in results),
                aggregate_tps=sum(r["tokens"] for r in results) / wall,
                aggregate_tg_tps=sum(max(r["tokens"] - 1, 0) for r in results) / span if span > 0 else 0.0,
                per_stream_tps=statistics.median(per) if per else 0.0,
                ttft_p50=statistics.median(ttft), ttft_max=max(ttft), wall=wall)


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
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--json", action="store_true", help="one JSON object per level")
    a = ap.parse_args(argv)
    proc = None
    if a.spawn:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = spawn(a.spawn, port, a.serve_args.split())
        a.url, a.model = f"http://127.0.0.1:{port}", a.spawn
    try:
        n_words = max(1, int(a.prompt_tokens / 1.3) - 20)  # about 1.3 tokens per word, ~20 for the template
        level(a.url, a.model, 1, n_words, 4, a.api_key, 99)  # warm-up: extension, caches
        if not a.json:
            print(f"{'streams':>7} {'prompt':>7} {'agg tok/s':>10} {'ratio':>6} {'agg tg':>8} {'ratio':>6} "
                  f"{'per-stream':>11} {'TTFT p50':>9} {'TTFT max':>9}")
        base = None
        for i, c in enumerate(int(x) for x in a.streams.split(",")):
            r = level(a.url, a.model, c, n_words, a.max_tokens, a.api_key, i)
            base = base or r
            r["ratio"] = r["aggregate_tps"] / base["aggregate_tps"] if base["aggregate_tps"] else 0.0
            r["tg_ratio"] = r["aggregate_tg_tps"] / base["aggregate_tg_tps"] if base["aggregate_tg_tps"] else 0.0
            if a.json:
                print(json.dumps(r))
            else:
                print(f"{c:>7} {r['prompt_tokens']:>7.0f} {r['aggregate_tps']:>10.1f} {r['ratio']:>5.2f}x "
                      f"{r['aggregate_tg_tps']:>8.1f} {r['tg_ratio']:>5.2f}x {r['per_stream_tps']:>11.1f} "
                      f"{r['ttft_p50']:>8.2f}s {r['ttft_max']:>8.2f}s", flush=True)
    finally:
        if proc:
            proc.terminate()
            proc.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
