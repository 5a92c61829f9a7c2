"""Command lines and REPL habits from llama.cpp and Ollama, as pyllm reads them.

References: llama.cpp's own flag meanings (-m model, -p prompt, -c context, -t threads, -n tokens, -np parallel
sequences, -ngl layers on the GPU, -fa flash attention, -j inline JSON schema, --chat-template-file), llama-server's
LLAMA_ARG_* environment defaults (the command line wins), and Ollama's `/set parameter NAME VALUE` and `/show`
words. The namespace argparse produces, and the keyword arguments pyllm.load receives (recorded by a stand-in), are
compared with what each command line means.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from conftest import cli_in_process
from pyllm.cli.common import Settings, drop_flash_attn_values
from pyllm.cli.main import constraint_kwargs, parse_command_line
from pyllm.errors import PyllmError, TemplateError
from test_chat_repl import FakeLLM, make_chat


def parsed(*argv):
    return parse_command_line(list(argv))[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from pyllm.synthetic import write_tiny_llama

    return str(write_tiny_llama(tmp_path_factory.mktemp("habits") / "tiny.gguf", n_layer=2, n_embd=32, n_ff=64,
                                n_head=2, n_kv_head=1, n_vocab=320, n_ctx=64))


# ---- argv as llama.cpp users type it -------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, want", [
    (["run", "-m", "m.gguf", "-p", "hi", "-c", "2048", "-t", "2", "-n", "5"],
     dict(model="m.gguf", prompt="hi", ctx=2048, threads=2, max_tokens=5)),
    (["run", "m.gguf", "hi", "-n", "7"], dict(model="m.gguf", prompt="hi", max_tokens=7)),
    (["run", "-m", "m.gguf", "hello there"], dict(model="m.gguf", prompt="hello there")),
    (["run", "-p", "hi", "-m", "m.gguf"], dict(model="m.gguf", prompt="hi")),
    (["run", "m.gguf", "-p", "hi"], dict(model="m.gguf", prompt="hi")),
    (["run", "-ngl", "99", "m.gguf", "hi"], dict(gpu_layers=99, max_tokens=256, prompt="hi")),  # not -n gl
    (["run", "m.gguf", "hi", "--n-gpu-layers", "all"], dict(gpu_layers=-1)),
    (["run", "m.gguf", "hi", "--gpu-layers", "-1"], dict(gpu_layers=-1)),
    (["run", "m.gguf", "hi", "-ngl", "0"], dict(gpu_layers=0)),
    (["run", "m.gguf", "-fa", "hi"], dict(flash_attn=True, prompt="hi")),
    (["run", "m.gguf", "-fa", "on", "hi"], dict(flash_attn=True, prompt="hi")),
    (["run", "m.gguf", "--flash-attn=auto", "hi"], dict(flash_attn=True, prompt="hi")),
    (["run", "m.gguf", "hi", "-j", '{"type": "object"}'], dict(json_schema='{"type": "object"}')),
    (["run", "m.gguf", "hi", "-n5", "-t1", "-c64"], dict(max_tokens=5, threads=1, ctx=64)),
    (["chat", "-m", "m.gguf", "-c", "512"], dict(model="m.gguf", ctx=512)),
    (["chat"], dict(model="smollm2-135m")),
    (["serve", "-m", "m.gguf", "-np", "4", "-c", "512", "-ngl", "99", "-fa", "--chat-template-file", "t.jinja"],
     dict(model="m.gguf", parallel=4, ctx=512, gpu_layers=99, chat_template_file="t.jinja")),
    (["serve", "m.gguf", "--parallel", "2"], dict(model="m.gguf", parallel=2)),
    (["info", "-m", "m.gguf", "-c", "128"], dict(model="m.gguf", ctx=128)),
    (["perplexity", "-m", "m.gguf", "-f", "t.txt", "-c", "64"], dict(model="m.gguf", ctx=64)),
    (["bench", "-m", "a.gguf", "-m", "b.gguf", "-p", "8", "-n", "4", "-ngl", "0"],
     dict(model_flags=["a.gguf", "b.gguf"], n_prompt=8, n_gen=4, gpu_layers=0)),
])
def test_llama_cpp_command_lines_mean_what_they_mean_there(argv, want):
    a = parsed(*argv)
    got = {k: getattr(a, k) for k in want}
    assert got == want


@pytest.mark.parametrize("argv, needle", [
    (["run", "--max", "5", "m.gguf", "hi"], "unrecognized arguments: --max"),  # no prefix of --max-tokens
    (["run", "--n-gpu", "99", "m.gguf", "hi"], "unrecognized arguments: --n-gpu"),
    (["serve", "m.gguf", "--par", "2"], "unrecognized arguments: --par"),
    (["run", "m.gguf", "hi", "-ngl", "gl"], "argument --n-gpu-layers/-ngl/--gpu-layers: must be a number of layers"),
    (["run", "m.gguf", "hi", "-ngl", "-3"], "must be a number of layers >= 0, or 'all'"),
    (["run", "-m", "a.gguf", "b.gguf", "hi"], "argument -m/--model: the model is given twice"),
    (["chat", "a.gguf", "-m", "b.gguf"], "argument -m/--model: the model is given twice"),
    (["run", "m.gguf", "hi", "-p", "ho"], "argument -p/--prompt: the prompt is given twice"),
    (["run", "-p", "hi"], "the following arguments are required: model (or -m MODEL)"),
    (["info"], "the following arguments are required: model"),
])
def test_misspelled_or_doubled_flags_are_one_line_usage_errors(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        parsed(*argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err, err
    assert "Traceback" not in err


def test_flash_attention_values_are_dropped_only_after_the_flag():
    assert drop_flash_attn_values(["run", "m", "-fa", "on", "off"]) == ["run", "m", "-fa", "off"]
    assert drop_flash_attn_values(["run", "m", "on", "-fa"]) == ["run", "m", "on", "-fa"]
    assert drop_flash_attn_values(["run", "m", "--", "-fa", "on"]) == ["run", "m", "--", "-fa", "on"]


@pytest.fixture
def recorded_load(monkeypatch):
    """pyllm.load replaced by a recorder that stops the command right after the load was asked for."""
    calls = []

    def load(model, **kw):
        calls.append(dict(kw, model=model))
        raise PyllmError("stand-in load: stopped here")

    monkeypatch.setattr("pyllm.llm.load", load)
    return calls


@pytest.mark.parametrize("flags, device, gpu_layers", [
    (["-ngl", "0"], "cpu", 0), (["-ngl", "99"], "auto", 99), (["-ngl", "all"], "auto", -1),
    (["--n-gpu-layers", "-1"], "auto", -1), (["-ngl", "1"], "auto", 1),  # pyllm.load places them
    (["-ngl", "99", "--device", "cuda:1"], "cuda:1", 99), (["-ngl", "0", "--device", "cpu"], "cpu", 0),
    ([], "auto", None)])
def test_gpu_layers_reach_pyllm_load(tiny, recorded_load, monkeypatch, capsys, flags, device, gpu_layers):
    monkeypatch.setenv("PYLLM_GPU_STANDIN", "fast")  # a GPU stands in: the flag's check passes on any host
    for argv in (["run", tiny, "hi", *flags], ["chat", tiny, *flags], ["serve", tiny, "--port", "0", *flags]):
        res = cli_in_process(monkeypatch, capsys, b"hi")(*argv)
        assert res.returncode == 1 and "stand-in load" in res.stderr, res.stderr
        assert (recorded_load[-1]["device"], recorded_load[-1]["gpu_layers"]) == (device, gpu_layers), argv


@pytest.mark.parametrize("flags, needle", [
    (["-ngl", "99", "--device", "cpu"], "-ngl 99 puts layers on the GPU but --device is cpu"),
    (["-ngl", "all", "--device", "cpu"], "-ngl all puts layers on the GPU but --device is cpu"),
    (["-ngl", "0", "--device", "cuda"], "-ngl 0 puts no layer on the GPU but --device is cuda"),
])
def test_a_gpu_layer_count_that_contradicts_the_device_is_refused_before_loading(tiny, recorded_load, monkeypatch,
                                                                                capsys, flags, needle):
    res = cli_in_process(monkeypatch, capsys)("run", tiny, "hi", *flags)
    assert res.returncode == 1 and res.stderr.startswith(f"pyllm: error: {needle}"), res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert recorded_load == []


def test_bench_takes_models_from_m_and_gpu_layers_to_pyllm_load(tiny, recorded_load, monkeypatch, capsys):
    res = cli_in_process(monkeypatch, capsys)("bench", "-m", tiny, "-p", "4", "-n", "2", "-r", "1", "-ngl", "0",
                                              "--device", "cuda")
    assert res.returncode == 1 and "-ngl 0 puts no layer on the GPU" in res.stderr and recorded_load == []
    res = cli_in_process(monkeypatch, capsys)("bench", "-m", tiny, "-p", "4", "-n", "2", "-r", "1", "-ngl", "0")
    assert res.returncode == 1 and recorded_load[-1]["model"] == tiny and recorded_load[-1]["device"] == "cpu"
    assert recorded_load[-1]["gpu_layers"] == 0


def test_json_schema_is_a_file_or_inline_as_llama_cpp_takes_it(tmp_path):
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}}'
    f = tmp_path / "s.json"
    f.write_text(schema)
    assert constraint_kwargs(SimpleNamespace(json_schema=str(f), grammar=None)) == {"json_schema": schema}
    assert constraint_kwargs(SimpleNamespace(json_schema="  " + schema, grammar=None)) == {"json_schema": "  " + schema}


# ---- --chat-template-file -----------------------------------------------------------------------------------------

class _Tok:
    bos_id, eos_id = 1, 2

    @staticmethod
    def token_text(i):
        return {1: "<s>", 2: "</s>"}[i]


def test_chat_template_file_formats_the_chat(tmp_path, monkeypatch, capsys):
    from pyllm.llm import LLM

    llm = SimpleNamespace(tokenizer=_Tok(), template=None)
    LLM.use_template(llm, "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    assert llm.template.render([{"role": "user", "content": "hi"}]) == "<s><user>hi"
    with pytest.raises(TemplateError, match=r"^--chat-template-file t\.jinja: chat template has a syntax error"):
        LLM.use_template(llm, "{% for %}", "--chat-template-file t.jinja")

    # through the CLI: the file read (bounded, named on error) and handed to the loaded model
    seen = []
    fake = SimpleNamespace(use_template=lambda src, where: seen.append((src, where)), spec_options=None,
                           template=SimpleNamespace(is_fallback=False))

    def load(model, **kw):
        return fake

    monkeypatch.setattr("pyllm.llm.load", load)
    from pyllm.cli.common import load_from_args

    t = tmp_path / "t.jinja"
    t.write_text("{{ messages[0].content }}")
    a = parsed("run", "m.gguf", "hi", "--chat-template-file", str(t))
    assert load_from_args(a) is fake and seen == [("{{ messages[0].content }}", f"--chat-template-file {t}")]
    res = cli_in_process(monkeypatch, capsys)("run", "m.gguf", "hi", "--chat-template-file", str(tmp_path / "no"))
    assert res.returncode == 1 and "--chat-template-file" in res.stderr and "cannot read" in res.stderr
    res = cli_in_process(monkeypatch, capsys)("run", "m.gguf", "hi", "--chat-template-file", str(t),
                                              "--plain-template")
    assert res.returncode == 1 and "give one" in res.stderr


# ---- PYLLM_ARG_* defaults for serve ------------------------------------------------------------------------------

def test_serve_reads_pyllm_arg_variables_and_the_command_line_wins(monkeypatch):
    for k, v in {"PYLLM_ARG_PORT": "9001", "PYLLM_ARG_CTX": "1024", "PYLLM_ARG_MODEL": "env.gguf",
                 "PYLLM_ARG_N_GPU_LAYERS": "0", "PYLLM_ARG_PLAIN_TEMPLATE": "yes",
                 "PYLLM_ARG_CORS_ORIGIN": "http://a.test,http://b.test", "PYLLM_ARG_PARALLEL": "3"}.items():
        monkeypatch.setenv(k, v)
    a = parsed("serve")
    assert (a.port, a.ctx, a.model, a.gpu_layers, a.plain_template, a.cors_origin, a.parallel) == \
        (9001, 1024, "env.gguf", 0, True, ["http://a.test", "http://b.test"], 3)
    a = parsed("serve", "cli.gguf", "--port", "9002", "-c", "64", "-np", "1")
    assert (a.port, a.ctx, a.model, a.parallel) == (9002, 64, "cli.gguf", 1)
    a = parsed("serve", "-m", "flag.gguf", "--ctx=32")
    assert (a.model, a.ctx) == ("flag.gguf", 32)
    assert parsed("run", "m.gguf", "hi").ctx == 4096  # serve's variables only


@pytest.mark.parametrize("env, needle", [
    ({"PYLLM_ARG_PORT": "eighty"}, "PYLLM_ARG_PORT='eighty' (for --port): not a valid int"),
    ({"PYLLM_ARG_PLAIN_TEMPLATE": "maybe"}, "PYLLM_ARG_PLAIN_TEMPLATE='maybe' (for --plain-template): must be"),
    ({"PYLLM_ARG_BACKEND": "fastest"}, "PYLLM_ARG_BACKEND='fastest' (for --backend): choose from fast, reference"),
    ({"PYLLM_ARG_CTX_SIZE": "4096"}, "PYLLM_ARG_CTX_SIZE names no flag of pyllm serve; these variables are read: "),
])
def test_a_bad_pyllm_arg_variable_is_a_usage_error_naming_it(monkeypatch, capsys, env, needle):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as e:
        parsed("serve", "m.gguf")
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


# ---- Ollama's REPL words ----------------------------------------------------------------------------------------

def test_set_parameter_takes_ollamas_names():
    chat, llm, out, ui = make_chat([["ok"]])
    for line in ("/set parameter temperature 0.2", "/set parameter num_predict 5", "/set parameter top_k 7",
                 "/set parameter top_p 0.5", "/set parameter seed 42", "/set parameter repeat_penalty 1.1",
                 "/set parameter min_p 0.1", '/set parameter stop "User:" ###'):
        chat.handle(line)
    s = chat.settings
    assert (s.temperature, s.max_tokens, s.top_k, s.top_p, s.seed, s.repeat_penalty, s.min_p, s.stop) == \
        (0.2, 5, 7, 0.5, 42, 1.1, 0.1, ("User:", "###"))
    assert "error" not in ui.getvalue(), ui.getvalue()
    chat.handle("hello")
    assert llm.calls[-1][1]["stop"] == ["User:", "###"] and llm.calls[-1][1]["temperature"] == 0.2
    chat.handle("/set stop none")
    assert chat.settings.stop == ()
    chat.handle("/set stop")
    assert "/set stop needs a value" in ui.getvalue()
    chat.handle("/set parameter")
    assert "stop" not in ui.getvalue().splitlines()[-1] and "num_ctx 64" in ui.getvalue().splitlines()[-1]


def test_set_num_ctx_reloads_the_model_and_keeps_the_conversation():
    chat, llm, out, ui = make_chat([["first"]])
    chat.handle("hello")
    turns = list(chat.turns)
    chat.handle("/set num_ctx 128")
    assert "the context cannot change in this chat; restart it with --ctx 128" in ui.getvalue()
    closed, asked = [], []
    llm.close = lambda: closed.append(llm)

    def reload(n):
        asked.append(n)
        return FakeLLM([["second"]], n_ctx=n)

    chat.reload = reload
    chat.handle("/set parameter num_ctx 128")
    assert asked == [128] and closed == [llm] and chat.llm.n_ctx == 128 and chat.turns == turns
    assert "(num_ctx = 128;" in ui.getvalue()
    chat.handle("again")
    assert chat.turns[-1]["content"] == "second"
    for bad in ("/set num_ctx big", "/set num_ctx -1", "/set num_ctx"):
        chat.handle(bad)
        assert "num_ctx must be an integer in [0, 16777216]" in ui.getvalue().splitlines()[-1]
    assert asked == [128]

    def failing(n):
        raise PyllmError("out of memory for the cache")

    chat.reload = failing
    before = chat.llm
    chat.handle("/set num_ctx 256")
    assert chat.llm is before and "out of memory for the cache" in ui.getvalue()


def test_show_takes_ollamas_words():
    chat, llm, out, ui = make_chat([])
    llm.template = SimpleNamespace(source="{{ messages }}")
    chat.handle("/show info")
    assert "context    0 / 64 tokens used" in ui.getvalue()
    chat.handle("/show parameters")
    assert ui.getvalue().splitlines()[-1].startswith("temp ")
    chat.handle("/show template")
    assert ui.getvalue().splitlines()[-1] == "{{ messages }}"
    chat.handle("/set system Be brief.")
    chat.handle("/show system")
    assert ui.getvalue().splitlines()[-1] == "system prompt: 'Be brief.'"
    chat.handle("/show license")
    assert "/show license: one of info, parameters, system, template" in ui.getvalue()


def test_load_restores_the_settings_save_wrote_and_counts_alike(tmp_path):
    chat, llm, out, ui = make_chat([["a reply"]], system="sys")
    chat.handle("hello")
    chat.handle("/set temp 0.3")
    chat.handle('/set stop "END"')
    chat.handle("/set seed 7")
    f = tmp_path / "c.json"
    chat.handle(f"/save {f}")
    saved = json.loads(f.read_text())
    assert saved["settings"]["stop"] == ["END"]
    other, _, _, ui2 = make_chat([])
    other.handle(f"/load {f}")
    s = other.settings
    assert (s.temperature, s.stop, s.seed, s.max_tokens) == (0.3, ("END",), 7, 8)
    assert "saved 3 messages" in ui.getvalue() and "loaded 3 messages" in ui2.getvalue(), ui2.getvalue()
    assert "and its settings" in ui2.getvalue()

    saved["settings"]["temperature"] = -1
    saved["settings"]["from_a_newer_pyllm"] = 1
    f.write_text(json.dumps(saved))
    third, _, _, ui3 = make_chat([])
    third.handle(f"/load {f}")
    assert "settings: temp must be a number >= 0" in ui3.getvalue() and "the conversation is unchanged" in \
        ui3.getvalue()
    assert third.settings == Settings(max_tokens=8) and third.turns == []


def test_run_stop_flag_and_chat_stop_flag_follow_set_rules(monkeypatch, capsys):
    res = cli_in_process(monkeypatch, capsys)("run", "m.gguf", "hi", *sum((["--stop", "x"] for _ in range(17)), []))
    assert res.returncode == 2 and "argument --stop: stop must be up to 16 non-empty strings" in res.stderr


# ---- the README's example -------------------------------------------------------------------------------------

def test_readme_llama_cpp_example_runs_as_written(smollm2_path, monkeypatch, capsys):
    """The README's block under "Coming from llama.cpp or Ollama", as written: the run line completes with the
    registry model from the cache (greedy: the same text as the plain spelling of the same command), the serve
    line's variables become its port and context."""
    import re
    import shlex
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text[text.index("**Coming from llama.cpp or Ollama.**"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1).strip().splitlines()
    run_line, serve_line = block
    argv = shlex.split(run_line)
    assert argv[0] == "pyllm"
    cli = cli_in_process(monkeypatch, capsys)
    res = cli(*argv[1:])
    assert res.returncode == 0 and res.stdout.strip(), res.stderr
    plain = cli("run", "smollm2-135m", "Once upon a time", "--max-tokens", "16", "--ctx", "2048", "--threads", "2",
                "--device", "cpu", "--temp", "0")
    assert plain.stdout == res.stdout
    words = shlex.split(serve_line)
    env = dict(w.split("=", 1) for w in words if "=" in w and w.startswith("PYLLM_ARG_"))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    a = parsed(*words[len(env) + 1:])
    assert (a.command, a.model, a.port, a.ctx) == ("serve", "smollm2-135m", 8081, 2048)
