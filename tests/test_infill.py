"""Fill-in-the-middle: ``suffix`` on create_completion and /v1/completions, and llama-server's /infill.

References: the token sequences llama.cpp's server builds (``format_infill`` in tools/server, prefix-suffix-middle
order) and llama-cpp-python's create_completion builds for ``suffix``, written out here from their source with
Qwen2.5-Coder's FIM token ids as its GGUF vocabulary lists them; the library's own greedy output for the server
routes; the middle of a small Python function for what qwen2.5-coder-0.5b fills in greedily.
"""

import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from conftest import pyllm_model
from pyllm.errors import BadRequest
from pyllm.infill import INFILL_BATCH, infill_ids, suffix_ids
from pyllm.vocabulary import fim_ids as _fim_ids
from server_harness import served_in_thread

# Qwen2.5-Coder's vocabulary: <|fim_prefix|> <|fim_middle|> <|fim_suffix|> <|repo_name|> <|file_sep|>
PRE, MID, SUF, REPO, SEP = 151659, 151660, 151661, 151663, 151664
PREFIX = "def add(a, b):\n    return "
SUFFIX = "\n\n\nprint(add(2, 3))\n"


def qwen():
    return pyllm_model("qwen2", n_ctx=512)


def smollm2():
    return pyllm_model("smollm2", n_ctx=512)


def plain(llm, text):
    return llm.tokenize(text, add_bos=False, special=False)


def test_fim_tokens_come_from_the_file_or_the_vocabulary():
    llm = qwen()
    assert [llm.tokenizer.token_id(t) for t in ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
                                                 "<|repo_name|>", "<|file_sep|>")] == [PRE, MID, SUF, REPO, SEP]
    # Qwen2.5-Coder's GGUF names no FIM key: found by their texts, as llama.cpp finds them
    assert llm.tokenizer.fim_ids == {"prefix": PRE, "suffix": SUF, "middle": MID, "repo": REPO, "file_sep": SEP}
    smol = smollm2().tokenizer.fim_ids
    assert smol["prefix"] is smol["suffix"] is smol["middle"] is None
    # the GGUF keys first (llama.cpp's names, then the older ones), an id out of range passed over
    index = {"<|fim_prefix|>": 7, "<PRE>": 8}
    md = {"tokenizer.ggml.fim_pre_token_id": 3, "tokenizer.ggml.suffix_token_id": 4,
          "tokenizer.ggml.fim_mid_token_id": 99, "tokenizer.ggml.middle_token_id": 5}
    assert _fim_ids(md, 10, index) == {"prefix": 3, "suffix": 4, "middle": 5, "repo": None, "file_sep": None}
    assert _fim_ids({}, 10, index)["prefix"] == 7


def test_suffix_prompt_is_llama_cpp_pythons():
    """llama-cpp-python: bos (when the vocabulary adds one; Qwen's does not) + <PRE> prompt <SUF> suffix <MID>,
    prompt and suffix as plain text."""
    llm = qwen()
    assert suffix_ids(llm.tokenizer, PREFIX, SUFFIX) == [PRE] + plain(llm, PREFIX) + [SUF] + plain(llm, SUFFIX) + [MID]
    assert suffix_ids(llm.tokenizer, [1, 2], "x") == [PRE, 1, 2, SUF] + plain(llm, "x") + [MID]


def test_infill_prompt_is_llama_servers():
    """format_infill: <REP>myproject\\n, each extra chunk after <SEP> and its file name ("tmp" by default),
    <SEP>filename\\n, then <PRE> prefix prompt <SUF> suffix <MID>; the extra context only where n_ctx leaves
    room past one batch and twice n_predict; the prefix cut to its last 3/4 batch, the suffix to 1/4 batch less
    the prompt and two tokens."""
    llm = qwen()
    tok = llm.tokenizer
    extra = [{"filename": "util.py", "text": "import math\n"}, {"text": "X = 1\n"}]
    want = ([REPO] + plain(llm, "myproject\n") + [SEP] + plain(llm, "util.py\n") + plain(llm, "import math\n")
            + [SEP] + plain(llm, "tmp\n") + plain(llm, "X = 1\n") + [SEP] + plain(llm, "filename\n")
            + [PRE] + plain(llm, PREFIX) + llm.tokenize("a", add_bos=False) + [SUF] + plain(llm, SUFFIX) + [MID])
    assert infill_ids(tok, PREFIX, SUFFIX, "a", extra, n_ctx=4096, n_predict=16) == want
    # no room for the extra context: n_ctx - 2048 - 2 * n_predict <= 0
    assert infill_ids(tok, PREFIX, SUFFIX, "", extra, n_ctx=2048, n_predict=16) == \
        [PRE] + plain(llm, PREFIX) + [SUF] + plain(llm, SUFFIX) + [MID]
    # only the last n_ctx - 2048 - 2 * n_predict tokens of it
    tail = [SEP] + plain(llm, "filename\n")
    ids = infill_ids(tok, PREFIX, SUFFIX, "", extra, n_ctx=2048 + 2 * 16 + len(tail), n_predict=16)
    assert ids[:len(tail) + 1] == tail + [PRE]
    long_prefix, long_suffix = "x = 1\n" * 1000, "y = 2\n" * 1000
    ids = infill_ids(tok, long_prefix, long_suffix, "", None, n_ctx=512)
    cut_prefix, cut_suffix = plain(llm, long_prefix)[-(3 * INFILL_BATCH // 4):], plain(llm, long_suffix)
    assert ids == [PRE] + cut_prefix + [SUF] + cut_suffix[:INFILL_BATCH // 4 - 2] + [MID]


def test_greedy_infill_fills_the_function_body():
    """qwen2.5-coder-0.5b (the instruct model) fills ``return ...`` of add(a, b) with a + b first."""
    llm = qwen()
    text = llm.create_completion(PREFIX, suffix=SUFFIX, max_tokens=6, temperature=0)["choices"][0]["text"]
    assert text.startswith("a + b"), text


def test_a_model_without_fim_tokens_is_a_bad_request():
    llm = smollm2()
    with pytest.raises(BadRequest) as e:
        llm.create_completion(PREFIX, suffix=SUFFIX, max_tokens=4)
    assert e.value.param == "suffix" and "no fill-in-the-middle tokens" in str(e.value)
    with pytest.raises(BadRequest) as e:
        qwen().create_completion(PREFIX, suffix=SUFFIX, echo=True, max_tokens=4)
    assert e.value.param == "echo"
    # an empty suffix is a plain completion, as before
    assert llm.create_completion("Hi", suffix="", max_tokens=1, temperature=0)["choices"][0]["text"] is not None


def post(base, path, body):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_infill_route_and_completions_suffix_over_http():
    """/infill (llama-server's shape, streamed as unnamed data events without [DONE]) and /v1/completions with
    suffix (the openai client) give the library's greedy middle."""
    from pyllm.server.app import create_app

    llm = qwen()
    want = llm.create_completion(PREFIX, suffix=SUFFIX, max_tokens=8, temperature=0)["choices"][0]["text"]
    ids = infill_ids(llm.tokenizer, PREFIX, SUFFIX, n_ctx=llm.n_ctx, n_predict=8)
    lib = llm.create_completion(ids, max_tokens=8, temperature=0)["choices"][0]["text"]
    with served_in_thread(create_app(llm, "qwen")) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
        r = client.completions.create(model="qwen", prompt=PREFIX, suffix=SUFFIX, max_tokens=8, temperature=0)
        assert r.choices[0].text == want
        body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 8, "temperature": 0,
                "cache_prompt": True, "t_max_predict_ms": 500}
        status, text = post(base, "/infill", body)
        assert status == 200, text
        r = json.loads(text)
        assert r["content"] == lib and r["stop"] is True and r["tokens_evaluated"] == len(ids)
        status, text = post(base, "/infill", {**body, "stream": True})
        events = [line[len("data: "):] for line in text.splitlines() if line]
        assert status == 200 and all(line.startswith("data: ") for line in text.splitlines() if line)
        chunks = [json.loads(e) for e in events]  # no "[DONE]": every event is JSON
        assert "".join(c["content"] for c in chunks) == lib
        assert [c["stop"] for c in chunks] == [False] * (len(chunks) - 1) + [True]
        status, text = post(base, "/infill", {"input_suffix": SUFFIX})
        assert status == 400 and json.loads(text)["error"]["param"] == "input_prefix"


def test_infill_route_on_a_model_without_fim_tokens_is_a_400():
    from pyllm.server.app import create_app

    with served_in_thread(create_app(smollm2(), "smollm2", api_key="k")) as base:
        status, text = post(base, "/infill", {"input_prefix": "a", "input_suffix": "b"})
        assert status == 401, text  # the API key guards /infill as it guards /v1
        req = urllib.request.Request(base + "/infill", method="POST",
                                     data=json.dumps({"input_prefix": "a", "input_suffix": "b"}).encode(),
                                     headers={"Authorization": "Bearer k", "Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
        err = json.loads(e.value.read().decode())["error"]
        assert e.value.code == 400 and err["param"] == "input_prefix"
        assert "no fill-in-the-middle tokens" in err["message"] and "\n" not in err["message"]


def test_readme_fill_in_the_middle_example(tmp_path):
    """Runs the README's example as written (the registry name resolves from the cache)."""
    text = (Path(__file__).parents[1] / "README.md").read_text()
    start = text.index("### Fill in the middle")
    code = re.search(r"```python\n(.*?)```", text[start:text.index("\n## ", start)], re.S).group(1)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("a + b"), res.stdout
