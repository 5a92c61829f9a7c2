"""`pyllm` command line: one argparse parser with subcommands, one error style.

Errors caused by input print one line on stderr (``pyllm: error: ...``) and exit 1; usage errors exit 2 (argparse);
Ctrl-C exits 130 without a traceback. ``--verbose`` shows tracebacks for debugging.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from .. import environment, registry
from ..errors import PyllmError, TemplateError, shorten
from .common import (SettingError, add_device_arg, add_kernels_arg, add_model_arg, add_runtime_args, add_sampling_args,
                     add_spec_args, apply_env_defaults, apply_gpu_layers, check_numeric_args, decode_utf8,
                     drop_flash_attn_values, kv_flag, kv_kind_from_args, load_from_args, lora_from_args,
                     merge_model_flag, read_stdin_text, read_text_arg, runtime_info, sampling_kwargs)
from .chat import HELP_EPILOG as CHAT_EPILOG
from .chat import run_chat

EXAMPLES = """examples:
  pyllm chat                              chat with the default model ({default}), fetched on first use
  pyllm run smollm2-135m "Once upon a time" -n 64 --temp 0
  pyllm run smollm2-135m "A user record:" --chat --json-schema user.schema.json
  pyllm info qwen2.5-coder-0.5b
  pyllm list                              registry models and the cached files, with sizes
  pyllm pull hf.co/OWNER/REPO:Q4_K_M      any GGUF from the Hugging Face hub (or an https:// URL)
  pyllm rm qwen2.5-coder-0.5b             delete a cached model
  pyllm bench model.gguf -p 512 -n 128

environment (README, "Environment variables"):
{environment}

llama.cpp's -m, -p, -c, -t, -n, -np, -ngl, -fa, -j and --chat-template-file are accepted (see the README)
"""


def constraint_kwargs(a) -> dict:
    """json_schema / grammar for generate() from --json-schema FILE (or the schema itself, as llama.cpp's -j takes
    it: a value starting with '{') / --grammar FILE."""
    if getattr(a, "json_schema", None):
        if a.json_schema.lstrip().startswith("{"):
            return {"json_schema": a.json_schema}
        return {"json_schema": read_text_arg(a.json_schema, "--json-schema")}
    if getattr(a, "grammar", None):
        return {"grammar": read_text_arg(a.grammar, "--grammar")}
    return {}


def cmd_run(a) -> int:
    if a.prompt in (None, "-") and "-" in (a.json_schema, a.grammar):
        raise PyllmError("standard input cannot hold both the prompt and the schema or grammar: give the prompt "
                         "as an argument")
    constrained = constraint_kwargs(a)
    prompt = a.prompt
    if prompt is None:
        if sys.stdin.isatty() and not sys.stdout.isatty():
            raise PyllmError("no prompt: give one as an argument or on standard input")
        if sys.stdin.isatty():  # no prompt on a terminal: a conversation, as `ollama run MODEL` opens one
            a.command = "chat"
            a.quiet, a.no_color, a.lines = False, False, False
            return run_chat(a)
        prompt = read_stdin_text()
    elif a.prompt == "-":
        prompt = read_stdin_text()
    elif any("\udc80" <= c <= "\udcff" for c in prompt):  # argv bytes that were not UTF-8 (surrogateescape)
        prompt = decode_utf8(os.fsencode(prompt), "the prompt")
    if not prompt:
        # With --chat an empty message still makes a prompt (the template's markup), so a pipeline whose first
        # command failed got a reply to nothing, and exit 0
        where = "standard input is empty" if a.prompt in (None, "-") else "the prompt argument is empty"
        raise PyllmError(f"nothing to complete: {where}")
    a.chat = a.chat or a.system is not None  # a system prompt only means something inside the chat template
    llm = load_from_args(a)
    kw = sampling_kwargs(a)
    if kw["seed"] is None:  # a random seed, chosen here so that -v and --json can say which: --seed N replays it
        import secrets

        kw["seed"] = secrets.randbelow(2**32)
    if constrained:
        # compiled before the prompt is evaluated, so a bad schema or grammar fails fast
        try:
            kw["constraint"] = llm.make_constraint(**constrained)
        except PyllmError as e:  # the file's content is at fault: say which file
            flag, path = ("--json-schema", a.json_schema) if "json_schema" in constrained else ("--grammar", a.grammar)
            if path.lstrip().startswith("{"):  # an inline schema: quoting it back would only repeat the flag's value
                path = "(inline)"
            raise PyllmError(f"{flag} {shorten(path)}: {e}") from None
    whole = llm.context_policy == "stop"  # else fit_prompt drops the prompt's oldest tokens to make it fit
    if a.chat:
        msgs = [{"role": "system", "content": a.system}] if a.system else []
        ids = llm.chat_ids(msgs + [{"role": "user", "content": prompt}], must_fit=whole)
    else:
        if whole:
            llm.check_prompt_fits(prompt)
        ids = llm.tokenize(prompt)
    ids = fit_prompt(llm, ids, a.max_tokens)
    pieces = []
    for piece in llm.generate(ids, max_tokens=a.max_tokens, stop=a.stop, stream=True, **kw):
        pieces.append(piece)
        if not a.json:
            sys.stdout.write(piece)
            sys.stdout.flush()
    st = llm.stats
    if a.json:
        print(json.dumps({"text": "".join(pieces), "prompt_tokens": st.prompt_tokens,
                          "generated_tokens": st.generated_tokens, "finish_reason": st.finish_reason,
                          "seed": kw["seed"],
                          "timings": st.as_dict(), "runtime": runtime_info(llm)}))
    else:
        sys.stdout.write("\n")
        if st.finish_reason == "context":
            print(f"pyllm: stopped: the context of {llm.n_ctx} tokens is full (use a larger --ctx)", file=sys.stderr)
        if a.verbose:
            spec = (f"; speculative: {st.spec.acceptance:.0%} of {st.spec.drafted} drafted accepted, "
                    f"{st.spec.mean_accepted:.2f} tokens per pass") if st.spec is not None else ""
            print(f"[{st.prompt_tokens} prompt tokens, {st.prompt_tps:.1f} t/s; {st.generated_tokens} generated, "
                  f"{st.decode_tps:.1f} t/s; {st.finish_reason}; seed {kw['seed']}{spec}]", file=sys.stderr)
    return 0


def confirm_download(model: str) -> None:
    """Describing a model should not start a download unasked: a registry name or URL that is not cached yet is
    fetched only after a yes on a terminal; elsewhere it is an error saying how to pull it."""
    from ..download import is_remote

    if model in registry.REGISTRY:
        missing, size = not registry.is_cached(model), f" ({registry.REGISTRY[model].size / 2**20:.0f} MiB)"
    elif is_remote(model):
        missing, size = registry.find_remote(model) is None, ""
    else:
        return
    if not missing:
        return
    how = f"`pyllm pull {shorten(model)}` downloads it"
    if not (sys.stdin.isatty() and sys.stderr.isatty()):
        raise PyllmError(f"{shorten(model)} is not downloaded yet; {how}, then `pyllm info` describes it")
    print(f"{shorten(model)} is not downloaded yet{size}. Download it now? [y/N] ", end="", file=sys.stderr,
          flush=True)
    try:
        answer = input()
    except EOFError:
        answer = ""
    if answer.strip().lower() not in ("y", "yes"):
        raise PyllmError(f"not downloaded; {how}")


def cmd_info(a) -> int:
    from ..formats.gguf import open_gguf
    from ..info import format_info, metadata_problems, model_info
    from ..models import ARCHITECTURES
    from ..models.config import ModelConfig

    kv_flag("--kv", a.kv)
    confirm_download(a.model)
    path = registry.resolve(a.model, quiet=False)
    problems = []
    if path.is_dir() and (path / "config.json").is_file():  # an AWQ folder (pyllm/formats/awq/)
        from ..formats.awq.folder import folder_info
        info = folder_info(path, n_ctx=a.ctx, kv_kind=a.kv)
    elif path.is_dir():
        raise PyllmError(f"{path}: is a directory, not a model file")
    else:
        with open_gguf(path) as gf:
            cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors), source=path.name,
                                            supported=ARCHITECTURES)
            info = model_info(gf, cfg, n_ctx=a.ctx, kv_kind=a.kv)
            problems = metadata_problems(gf.metadata)
        info["problems"] = problems
    if problems:  # described, then refused: the file cannot be used as it is
        print(json.dumps(info, indent=2) if a.json else format_info(info))
        raise PyllmError(f"{path.name}: " + "; ".join(problems))
    if a.device is not None:
        # the file is described from its header; where it runs takes loading it there
        import pyllm

        with pyllm.load(str(path), device=a.device, n_ctx=a.ctx, kv_cache=a.kv, n_threads=a.threads,
                        kernels=a.kernels, quiet=a.json) as llm:
            info["runtime"] = runtime_info(llm)
    print(json.dumps(info, indent=2) if a.json else format_info(info))
    return 0


def cmd_list(a) -> int:
    rows = registry.list_models()
    files = [f for f in registry.cached_files() if not f["registry"]]
    if a.json:
        print(json.dumps({"registry": rows, "other_cached": files, "cache": str(registry.models_dir())}, indent=2))
        return 0
    print(f"{'NAME':<22}{'SIZE':>10}  {'CACHED':<7}{'KIND':<6} DESCRIPTION")
    for r in rows:
        print(f"{r['name']:<22}{r['size'] / 2**20:>7.0f} MiB  {'yes' if r['cached'] else 'no':<7}"
              f"{r['kind']:<6} {r['description']}")
    for f in files:
        kind = {True: "chat", False: "base", None: "?"}[f["chat_template"]]
        print(f"{f['name']:<22}{f['size'] / 2**20:>7.0f} MiB  {'yes':<7}{kind:<6} {f['path']}")
    print(f"cache: {registry.models_dir()} (set {registry.CACHE_ENV} to move it); base = no chat template, "
          f"chat uses a plain fallback format; embed = an embedding model (embeddings only)")
    return 0


def cmd_pull(a) -> int:
    if a.sha256 and len(a.names) > 1:
        raise PyllmError("--sha256 applies to one model: pull them one at a time")
    for name in a.names:
        path = registry.pull(name, force=a.force, sha256=a.sha256)
        print(path)
    return 0


def cmd_rm(a) -> int:
    for target in a.targets:
        for p in registry.remove(target):
            print(f"removed {p}")
    return 0


def fit_prompt(llm, ids: list[int], max_tokens: int) -> list[int]:
    """The prompt under llm.context_policy: "stop" raises ContextFullError when it leaves no room to generate;
    "shift" drops its oldest tokens (after a leading BOS) so that min(max_tokens, n_ctx // 4) tokens fit after it
    (max_tokens -1: n_ctx // 4)."""
    from ..errors import ContextFullError

    n_ctx = llm.n_ctx
    if len(ids) < n_ctx:
        return ids
    if llm.context_policy == "stop":
        raise ContextFullError(f"the prompt takes {len(ids)} tokens but the context holds {n_ctx}: use a larger "
                               f"--ctx, a shorter prompt, or --context-policy shift to drop its oldest tokens")
    reserve = max(1, min(n_ctx if max_tokens < 0 else max_tokens, n_ctx // 4))  # -1: until the context is full
    head = ids[:1] if ids and ids[0] == llm.tokenizer.bos_id else []
    keep = n_ctx - reserve - len(head)
    dropped = len(ids) - len(head) - keep
    print(f"pyllm: the prompt takes {len(ids)} tokens; dropped its oldest {dropped} to fit the context of {n_ctx}",
          file=sys.stderr)
    return head + ids[len(ids) - keep:]


def api_key_from_args(a) -> str | None:
    """The key the /v1 routes require: --api-key, else $PYLLM_API_KEY (an empty variable counts as unset), else
    None (no key). An empty --api-key is refused: typed as --api-key "$KEY" with KEY unset, it would serve every
    client without a key, which is not what the flag asked for."""
    if a.api_key is not None:
        if not a.api_key.strip():
            raise PyllmError("--api-key is empty (an unset variable?): give the key, or leave the flag out to serve "
                             "without one")
        return a.api_key
    return os.environ.get("PYLLM_API_KEY") or None


def cors_origins_from_args(a) -> tuple[str, ...]:
    """--cors-origin values: ``*``, or scheme://host[:port] (``*`` a wildcard within it), a trailing slash dropped.
    One with a path is refused: a browser's Origin header never has one, so it would let no page in, silently."""
    out = []
    for origin in a.cors_origin or ():
        o = origin.strip().rstrip("/")
        if o != "*" and not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*://[^/\s]+", o):
            raise PyllmError(f"--cors-origin {origin!r} is not an origin: give scheme://host[:port] as the page's "
                             f"address bar shows it (no path), or '*' for every origin")
        out.append(o)
    return tuple(out)


def allow_hosts_from_args(a) -> tuple[str, ...]:
    """--allow-host values, lowercased: a host name, ``*.domain`` (its subdomains) or ``*`` (any Host)."""
    out = []
    for h in a.allow_host or ():
        name = h.strip().lower().rstrip(".")
        if name != "*" and not re.fullmatch(r"(\*\.)?[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?|[0-9a-f:.%]+", name):
            raise PyllmError(f"--allow-host {h!r} is not a host name: give a name as clients write it in the URL "
                             f"(example.com, *.example.com for its subdomains, * for any)")
        out.append(name)
    return tuple(out)


def cmd_serve(a) -> int:
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise PyllmError(f"pyllm serve needs the server extra ({e.name} is missing): pip install \"pyllm[serve]\"")
    api_key = api_key_from_args(a)
    cors_origins = cors_origins_from_args(a)
    from ..server.app import listen_socket, request_memory, serve

    memory = request_memory(a.max_body, None if a.max_request_memory is None else a.max_request_memory << 20)
    allow_hosts = allow_hosts_from_args(a)
    if a.kv_pool_tokens is not None and (a.parallel == 1 or a.replicas != 1):
        raise PyllmError("--kv-pool-tokens sizes the KV pool of --parallel slots: give --parallel > 1 (and no "
                         "--replicas)")

    try:  # fail before the model loads, in one line, rather than in uvicorn's log after it
        sock = listen_socket(a.host, a.port)
    except OSError as e:
        raise PyllmError(f"cannot listen on {a.host}:{a.port}: {e.strerror or e}") from None
    if a.replicas != 1:
        sock.close()  # Ray Serve's proxy binds the address itself
        return serve_replicas_from_args(a)
    with sock:  # kept bound while the model loads: the address cannot be taken meanwhile
        llm = load_from_args(a)
        name = a.model if a.model in registry.REGISTRY else llm.path.name
        serve(llm, a.alias or name, host=a.host, port=a.port, api_key=api_key,
              max_body=a.max_body, parallel=a.parallel, prompt_cache=a.prompt_cache, sock=sock,
              cors_origins=cors_origins, client_timeout=a.client_timeout, log_format=a.log_format,
              allow_hosts=allow_hosts, max_request_memory=memory, kv_pool_tokens=a.kv_pool_tokens)
    return 0


def serve_replicas_from_args(a) -> int:
    """serve --replicas N: the same routes on N Ray Serve replicas, each loading the model in its own process."""
    import threading

    from ..server.ray_serve import ReplicaSpec, require_ray, serve_replicas

    if a.prompt_cache:
        raise PyllmError("--prompt-cache cannot be shared by --replicas (each replica would write the same "
                         "directory); use one or the other")
    require_ray()
    apply_gpu_layers(a)  # -ngl against --device, as a single process checks it
    path = registry.resolve(a.model or registry.DEFAULT_MODEL)  # fetched once here, not by every replica
    threads = a.threads or max(1, (os.cpu_count() or 1) // a.replicas)
    name = a.model if a.model in registry.REGISTRY else path.name
    spec = ReplicaSpec(path=str(path), model_name=a.alias or name or path.name, device=a.device, n_ctx=a.ctx,
                       kv_cache=kv_kind_from_args(a), n_threads=threads, kernels=a.kernels,
                       api_key=api_key_from_args(a), max_body=a.max_body, client_timeout=a.client_timeout,
                       parallel=a.parallel, plain_template=a.plain_template, cors_origins=cors_origins_from_args(a),
                       host=a.host, allow_hosts=allow_hosts_from_args(a),
                       max_request_memory=None if a.max_request_memory is None else a.max_request_memory << 20,
                       lora=tuple(lora_from_args(a)), gpu_layers=a.gpu_layers)

    def wait_for_interrupt():  # serve_replicas turns Ctrl-C and SIGTERM into KeyboardInterrupt
        threading.Event().wait()

    serve_replicas(spec, a.replicas, a.host, a.port, wait_for_interrupt)
    return 0


# a value argparse quotes with repr(): in single quotes, or in double quotes when it holds a single quote
_QUOTED = re.compile(r"""(['"])((?:\\.|(?!\1).){81,})\1""")


class _Parser(argparse.ArgumentParser):
    """argparse quoting what the user typed in its errors ("invalid choice: '...'") at most 80 characters of it: a
    pasted 10 KB value must not bury the error it is in. An error about one argument's value (a bad type, choice
    or missing value) is one line naming the argument, as pyllm's range checks are: the usage block would push
    that line out of sight. Errors about the command line as a whole (a missing argument) keep the usage.

    No abbreviations (allow_abbrev=False): with llama.cpp's flags beside pyllm's, a prefix that happens to match
    one long flag today (--n-gpu for --n-gpu-layers) would silently mean another once a flag is added."""

    def __init__(self, *args, **kw):
        kw.setdefault("allow_abbrev", False)
        super().__init__(*args, **kw)

    def error(self, message: str):
        message = _QUOTED.sub(lambda m: m.group(1) + shorten(m.group(2)) + m.group(1), message)
        if message.startswith("argument "):
            self.exit(2, f"{self.prog}: error: {message}\n")
        super().error(message)


class _SubcommandParser(_Parser):
    """A subcommand's parser that takes its positionals anywhere among its flags (`run MODEL -n 8 "prompt"`):
    argparse's own parse_known_args fills an optional positional (the prompt) with nothing when flags follow the
    model, and then calls the prompt an unrecognized argument."""

    _intermixed = False

    def parse_known_args(self, args=None, namespace=None):
        if self._intermixed:  # parse_known_intermixed_args calls back here for each of its two passes
            return super().parse_known_args(args, namespace)
        self._intermixed = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixed = False


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="pyllm", description="Quantized local LLM inference.",
        epilog=EXAMPLES.format(default=registry.DEFAULT_MODEL, environment=environment.help_text()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="store_true", help="print versions and the extension's build, then exit")
    p.add_argument("--verbose", "-v", action="store_true", help="timings, memory and tracebacks")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_SubcommandParser)
    _add_parser = sub.add_parser

    def add_parser(*args, **kw):
        sp = _add_parser(*args, **kw)
        # SUPPRESS keeps a top-level --verbose from being reset by the subcommand's default
        sp.add_argument("--verbose", "-v", action="store_true", default=argparse.SUPPRESS,
                        help="timings, memory and tracebacks")
        return sp

    sub.add_parser = add_parser

    s = sub.add_parser("chat", help="interactive chat (streams tokens)", description="Interactive chat.",
                       epilog=CHAT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arg(s, optional=True)
    s.add_argument("--system", default=None, help="system prompt")
    s.add_argument("--quiet", action="store_true", help="no status line after replies")
    s.add_argument("--no-color", action="store_true", help="no colors")
    s.add_argument("--lines", action="store_true", help="piped input: one message per line")
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable; /set stop in the chat)")
    add_runtime_args(s)
    add_sampling_args(s, 512)
    add_spec_args(s)
    s.set_defaults(func=run_chat)

    s = sub.add_parser("run", help="complete a prompt", description="Print a completion as it is generated.")
    add_model_arg(s)
    s.add_argument("prompt", nargs="?", default=None,
                   help="the prompt; '-' or none with piped input reads standard input; none on a terminal "
                        "opens a chat")
    s.add_argument("-p", "--prompt", dest="prompt_flag", default=None, metavar="PROMPT",
                   help="the prompt, as llama.cpp's -p (instead of the PROMPT argument)")
    s.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    s.add_argument("--system", default=None, help="system prompt (implies --chat)")
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument("--json", action="store_true", help="print one JSON object with text, tokens and timings")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--json-schema", "-j", metavar="FILE", default=None,
                   help="constrain the output to JSON valid under the JSON schema in FILE ('-' = stdin), or given "
                        "inline as llama.cpp's -j takes it (a value starting with '{')")
    g.add_argument("--grammar", metavar="FILE", default=None,
                   help="constrain the output to the llama.cpp GBNF grammar in FILE ('-' = stdin)")
    add_runtime_args(s)
    add_sampling_args(s, 256)
    add_spec_args(s)
    s.set_defaults(func=cmd_run)

    s = sub.add_parser("serve", help="HTTP server: the OpenAI and Ollama APIs",
                       description="Serve a model over the OpenAI API (/v1/chat/completions, /v1/completions, "
                                   "/v1/embeddings, /v1/models, /health, /metrics) and Ollama's (/api/chat, "
                                   "/api/generate, /api/embed, /api/tags, /api/show, /api/ps, /api/version). Each "
                                   "flag's default can come from PYLLM_ARG_<FLAG> (PYLLM_ARG_PORT=8081, "
                                   "PYLLM_ARG_MODEL=...); the command line wins.")
    add_model_arg(s, optional=True)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 and /api routes (default: $PYLLM_API_KEY, else "
                        "none)")
    s.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="also let browser pages from ORIGIN (scheme://host[:port], '*' a wildcard; '*' alone: any "
                        "site) call the server; repeatable (default: only local pages: localhost, 127.0.0.1, "
                        "[::1], 0.0.0.0 at any port, and app://, file://, tauri://, vscode-webview:// pages)")
    s.add_argument("--alias", default=None, help="model id clients use (default: the registry name or file name)")
    s.add_argument("--parallel", "-np", type=int, default=1,
                   help="requests decoded together in one batched step, each with its own KV slot (default 1: one "
                        "at a time); greedy requests speculate (--spec), beside others in the batched step's spare rows")
    s.add_argument("--kv-pool-tokens", type=int, default=None, metavar="N",
                   help="KV cache positions the --parallel slots share, at least --ctx (default: every slot's "
                        "whole context); when they are all in use a new request waits, and a running one that "
                        "cannot grow is paused and resumed later where it stopped")
    s.add_argument("--prompt-cache", default=None, metavar="DIR",
                   help="keep prompt prefixes' KV in DIR across restarts (at most 1 GiB, least recently used go)")
    s.add_argument("--replicas", type=int, default=1,
                   help="serve from N model replicas (processes) behind Ray Serve's proxy; needs the ray extra "
                        "(default 1: this process, no Ray)")
    s.add_argument("--max-body", type=int, default=8 * 2**20, help="largest request body in bytes (default 8 MiB)")
    s.add_argument("--max-request-memory", type=int, default=None, metavar="MIB",
                   help="memory that request bodies, read and parsed, may hold at once; a request past it is "
                        "answered 503 with Retry-After (default 512, or more for a large --max-body)")
    s.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="also answer requests whose Host header is NAME ('*.domain' for its subdomains, '*' any), "
                        "when listening on loopback; repeatable (default: only this machine's names: localhost, "
                        "*.localhost, loopback and private addresses, the host name)")
    s.add_argument("--client-timeout", type=int, default=30, metavar="S",
                   help="seconds a client may take to send a request head, or pause within a body, before a 408 "
                        "and a closed connection (a body must also average 500 bytes/s past its first S); "
                        "responses are never cut (default 30)")
    s.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="one line per request on stderr (method, path, status, prompt and generated tokens, ms), "
                        "as text or as JSON objects (default text; not with --replicas)")
    add_runtime_args(s)
    add_spec_args(s)
    s.set_defaults(func=cmd_serve)

    s = sub.add_parser("info", help="describe a model file", description="Describe a model file.")
    add_model_arg(s)
    s.add_argument("--ctx", "-c", type=int, default=4096, help="context length for the KV cache size (default 4096)")
    s.add_argument("--kv", default="f16", help="KV cache type for the size (default f16)")
    add_device_arg(s, default=None, help="also load the model on this device (cpu, cuda, cuda:N, or auto: the GPU "
                                         "when one is usable, else the CPU) and report where it runs (default: "
                                         "describe the file from its header alone)")
    s.add_argument("--threads", "-t", type=int, default=None, help="CPU threads with --device")
    add_kernels_arg(s)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_info)

    s = sub.add_parser("list", help="registry models and the cache",
                       description="List registry models (base = no chat template) and the cached files. The "
                                   "cache is $PYLLM_CACHE_DIR, else $XDG_CACHE_HOME/pyllm, else ~/.cache/pyllm.")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_list)

    s = sub.add_parser("pull", help="download models into the cache",
                       description="Download models into the cache and check their sha256: registry names, "
                                   "http(s) URLs of GGUF files (resumable), or hf.co/OWNER/REPO[:QUANT] (the "
                                   "repository's GGUF for QUANT, default Q4_K_M). A cached model is re-hashed "
                                   "and downloaded again if corrupted.")
    s.add_argument("names", nargs="+", metavar="NAME",
                   help=f"{', '.join(registry.REGISTRY)}, a URL, or hf.co/OWNER/REPO[:QUANT]")
    s.add_argument("--force", action="store_true", help="download again even if cached and intact")
    s.add_argument("--sha256", default=None, metavar="HEX", help="expected sha256 of a URL's file")
    s.set_defaults(func=cmd_pull)

    s = sub.add_parser("rm", help="delete cached models", description="Delete cached models (and their records "
                                                                      "and partial downloads).")
    s.add_argument("targets", nargs="+", metavar="MODEL",
                   help="a registry name, a pulled URL or hf.co/... reference, or a file in the cache")
    s.set_defaults(func=cmd_rm)

    # Subcommands that live in their own modules register themselves here.
    from .bench import add_bench_parser
    from .convert import add_convert_parser
    from .perplexity import add_perplexity_parser

    add_bench_parser(sub)
    add_perplexity_parser(sub)
    add_convert_parser(sub)
    return p


def version_text() -> str:
    import torch

    from .. import __version__

    lines = [f"pyllm {__version__}", f"torch {torch.__version__}"]
    try:
        from .. import _ext

        lines.append(f"extension: {_ext.build_info()}")
    except Exception as e:  # the version banner must work even when the extension cannot build
        lines.append(f"extension: unavailable ({e})")
    lines.append(f"cuda usable: {torch.cuda.is_available()}")
    return "\n".join(lines)


def parse_command_line(argv: list[str] | None = None):
    """(parser, {subcommand: parser}, namespace) for ``argv``: llama.cpp's -fa values dropped, serve's PYLLM_ARG_*
    defaults applied, -m/-p merged with the positionals. A usage error exits 2 (SystemExit) with one line."""
    parser = build_parser()
    argv = drop_flash_attn_values(sys.argv[1:] if argv is None else list(argv))
    a, extra = parser.parse_known_args(argv)
    subs = next((act.choices for act in parser._actions if isinstance(act, argparse._SubParsersAction)), {})
    if extra:  # a subcommand's unknown flag: that subcommand's usage, not the top-level one
        (subs.get(a.command) or parser).error(f"unrecognized arguments: {shorten(' '.join(extra))}")
    if a.command:
        try:
            if a.command == "serve":
                apply_env_defaults(a, subs["serve"], argv)
            merge_model_flag(a)
        except SettingError as e:
            subs[a.command].exit(2, f"{subs[a.command].prog}: error: {e}\n")
    return parser, subs, a


def main(argv: list[str] | None = None) -> int:
    parser, subs, a = parse_command_line(argv)
    if a.version:
        print(version_text())
        return 0
    if not a.command:
        parser.print_help()
        return 2
    a.verbose = getattr(a, "verbose", False)
    try:
        check_numeric_args(a)
    except (PyllmError, SettingError) as e:
        # a usage error worded as argparse's own for a value that does not parse (exit 2, "pyllm run: error:
        # argument --ctx: ..."), reported before any model is loaded
        print(f"{subs[a.command].prog}: error: {e}", file=sys.stderr)
        return 2
    try:
        return a.func(a)
    except PyllmError as e:
        if a.verbose:
            raise
        hint = ""
        if isinstance(e, TemplateError) and hasattr(a, "plain_template") and not a.plain_template:
            hint = "; rerun with --plain-template to use a plain chat format instead"
        print(f"pyllm: error: {e}{hint}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # stdout closed early (e.g. `| head`): not an error worth a traceback
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
    except OSError as e:
        # a path the system refuses where no check expected it (a pasted text given as a model or folder name is
        # "File name too long" to Path.exists): still one line naming the path, not a traceback
        if a.verbose:
            raise
        where = f"{shorten(e.filename)}: " if e.filename else ""
        print(f"pyllm: error: {where}{e.strerror or e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
