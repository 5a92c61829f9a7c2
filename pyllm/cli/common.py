"""What every pyllm subcommand shares: its arguments (model, runtime, device, sampling), their checks before any
model loads, loading a model from them, the sampling rules the REPL's /set also follows, and bounded reading of
text from files and standard input.

Every other module in pyllm/cli imports this one and no other cli module (main dispatches to the subcommand
modules; none of them imports main). At the top it imports only the standard library and light pyllm modules
(errors, registry): `pyllm --help` imports it and must stay fast; torch comes with the first model.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
from dataclasses import dataclass, fields
from typing import Callable

from .. import registry
from ..errors import PyllmError, shorten
from ..runtime.sampler_settings import SamplerSettings

# ---- sampling settings: the rules of the flags and of the REPL's /set ---------------------------------------------

class SettingError(ValueError):
    """A sampling setting outside its range (from /set, or from a command line flag)."""


def _finite_float(text) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(text)
    return v


def _strict_int(text) -> int:
    if isinstance(text, float):  # int(1.5) would silently truncate a value the user meant as given
        raise ValueError(text)
    return int(text)


def _seed(text):
    if text is None or (isinstance(text, str) and text.strip().lower() in ("none", "random", "off", "-1")):
        return None
    if isinstance(text, int) and not isinstance(text, bool) and text == -1:  # --seed -1: random, as in llama.cpp
        return None
    return _strict_int(text)


MAX_STOPS, MAX_STOP_CHARS = 16, 256  # a stop list is a few short markers; a pasted page is a mistake to refuse


def _stops(value) -> tuple[str, ...]:
    """Stop strings: a list (a flag given several times, a saved conversation), or one line of words, quoted as in
    a shell where a stop string holds spaces (/set stop "User:" "###"); '-' or 'none' for none."""
    if isinstance(value, (list, tuple)):
        if not all(isinstance(x, str) and x for x in value):
            raise ValueError(value)
        return tuple(value)  # empty: none (as /save writes "no stop strings")
    text = str(value).strip()
    if text.lower() in ("-", "none"):
        return ()
    try:
        items = shlex.split(text)
    except ValueError:  # an unbalanced quote: the words as typed
        items = text.split()
    if not items:
        raise ValueError(value)
    return tuple(items)


# name -> (parser, check, what a valid value is). The ranges match SamplerSettings.validate, so a value that
# passes here never fails later in the middle of a reply.
RULES: dict[str, tuple[Callable, Callable, str]] = {
    "temperature": (_finite_float, lambda v: v >= 0, "a number >= 0 (0 = greedy)"),
    "top_k": (_strict_int, lambda v: v >= 0, "an integer >= 0 (0 = off)"),
    "top_p": (_finite_float, lambda v: 0 < v <= 1, "a number in (0, 1] (1 = off)"),
    "min_p": (_finite_float, lambda v: 0 <= v < 1, "a number in [0, 1) (0 = off)"),
    "seed": (_seed, lambda v: v is None or 0 <= v < 2**63, "an integer >= 0, or 'random'"),
    "max_tokens": (_strict_int, lambda v: v >= 1 or v == -1, "an integer >= 1, or -1 (until the context is full)"),
    "repeat_penalty": (_finite_float, lambda v: v > 0, "a number > 0 (1 = off)"),
    "stop": (_stops, lambda v: len(v) <= MAX_STOPS and all(len(x) <= MAX_STOP_CHARS for x in v),
             f"up to {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} characters (quoted where they hold "
             f"spaces), or 'none'"),
}
ALIASES = {"temp": "temperature", "t": "temperature", "k": "top_k", "p": "top_p", "n": "max_tokens",
           "num_predict": "max_tokens", "max": "max_tokens"}
FLAGS = {"temperature": "--temp", "top_k": "--top-k", "top_p": "--top-p", "min_p": "--min-p", "seed": "--seed",
         "max_tokens": "-n/--max-tokens", "repeat_penalty": "--repeat-penalty", "stop": "--stop"}


def canonical_setting(name: str) -> str:
    key = name.strip().lower().replace("-", "_")
    key = ALIASES.get(key, key)
    if key not in RULES:
        raise SettingError(f"unknown setting {shorten(name)!r}; one of: temp, "
                           f"{', '.join(k for k in RULES if k != 'temperature')}")
    return key


def parse_setting(name: str, value) -> tuple[str, object]:
    """(canonical name, checked value) from a name and a string (or an already typed value)."""
    key = canonical_setting(name)
    parse, check, want = RULES[key]
    label = "temp" if key == "temperature" else key
    try:
        v = parse(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        raise SettingError(f"{label} must be {want}, got {shorten(value)!r}") from None
    if not check(v):
        raise SettingError(f"{label} must be {want}, got {shorten(value)!r}")
    return key, v


@dataclass
class Settings:
    """The sampling settings a session can change (/set, flags), with the library's defaults."""

    temperature: float = SamplerSettings.temperature
    top_k: int = SamplerSettings.top_k
    top_p: float = SamplerSettings.top_p
    min_p: float = SamplerSettings.min_p
    seed: int | None = SamplerSettings.seed
    max_tokens: int = 512
    repeat_penalty: float = SamplerSettings.repeat_penalty
    stop: tuple[str, ...] = ()

    @classmethod
    def from_args(cls, a) -> "Settings":
        """Checks every flag before the model loads, so a typo fails in a second, naming the flag."""
        s = cls()
        for f in fields(cls):
            attr = {"temperature": "temp"}.get(f.name, f.name)
            if not hasattr(a, attr) or (f.name == "stop" and not getattr(a, attr)):
                continue
            try:
                s.set(f.name, getattr(a, attr))
            except SettingError as e:
                raise SettingError(f"argument {FLAGS[f.name]}: {e}") from None
        return s

    def set(self, name: str, value) -> str:
        key, v = parse_setting(name, value)
        setattr(self, key, v)
        return key

    def sampling(self, seed_offset: int = 0) -> dict:
        seed = None if self.seed is None else (self.seed + seed_offset) % 2**63
        return dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p, seed=seed,
                    repeat_penalty=self.repeat_penalty)

    def describe(self) -> str:
        seed = "random" if self.seed is None else self.seed
        stop = f", stop {' '.join(shlex.quote(x) for x in self.stop)}" if self.stop else ""
        return (f"temp {self.temperature:g}, top_k {self.top_k}, top_p {self.top_p:g}, min_p {self.min_p:g}, "
                f"seed {seed}, max_tokens {self.max_tokens}, repeat_penalty {self.repeat_penalty:g}{stop}")


# ---- arguments -----------------------------------------------------------------------------------------------------

def add_model_arg(p: argparse.ArgumentParser, optional: bool = False) -> None:
    """MODEL as the first positional, or as llama.cpp's -m/--model anywhere (merge_model_flag reconciles them).
    The positional is optional to argparse either way: with -m, what follows the flags is the next positional."""
    p.add_argument("model", nargs="?", default=None,
                   help=f"a .gguf file or a registry name ({', '.join(registry.REGISTRY)})"
                        + (f" (default {registry.DEFAULT_MODEL})" if optional else ""))
    p.add_argument("-m", "--model", dest="model_flag", default=None, metavar="MODEL",
                   help="the model, as llama.cpp's -m (instead of the MODEL argument)")
    p.set_defaults(model_required=not optional)


def merge_model_flag(a) -> None:
    """a.model from -m/--model or the first positional (the registry's default model where MODEL is optional);
    with -m, a positional that argparse took for MODEL is the prompt (`run -m M "text"`), and -p/--prompt gives
    the prompt as llama.cpp's -p does. SettingError when a value is given twice or the model is missing."""
    if not hasattr(a, "model_required"):
        return
    flag = a.model_flag
    if flag is not None and a.model is not None:
        if not hasattr(a, "prompt") or a.prompt is not None:
            raise SettingError(f"argument -m/--model: the model is given twice ({shorten(flag, 60)!r} and "
                               f"{shorten(a.model, 60)!r}); give it once")
        a.prompt = a.model  # `run -m MODEL TEXT`: TEXT is the prompt
    if flag is not None:
        a.model = flag
    prompt_flag = getattr(a, "prompt_flag", None)
    if prompt_flag is not None:
        if a.prompt is not None:
            raise SettingError(f"argument -p/--prompt: the prompt is given twice ({shorten(prompt_flag, 60)!r} and "
                               f"{shorten(a.prompt, 60)!r}); give it once")
        a.prompt = prompt_flag
    if a.model is None:
        if a.model_required:
            raise SettingError("the following arguments are required: model (or -m MODEL)")
        a.model = registry.DEFAULT_MODEL


def add_runtime_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("runtime")
    g.add_argument("--ctx", "-c", type=int, default=4096, help="context length in tokens (default 4096)")
    g.add_argument("--kv", default="f16", metavar="TYPE",
                   help="KV cache type for keys and values: f16 (default), bf16, f32, q8_0, q8_rot, q4_0, q4_rot "
                        "(Hadamard-rotated 4-bit), or KEY/VALUE such as f16/q4_rot")
    g.add_argument("--kv-k", "-ctk", default=None, metavar="TYPE", help="key cache type (overrides --kv for keys)")
    g.add_argument("--kv-v", "-ctv", default=None, metavar="TYPE",
                   help="value cache type (overrides --kv for values)")
    g.add_argument("--context-policy", default=None, choices=["stop", "shift"],
                   help="when the context is full: stop with a message, or shift (drop the oldest turns after the "
                        "system prompt, or the oldest prompt tokens, and re-prefill). Default: shift for chat, "
                        "stop for run")
    g.add_argument("--threads", "-t", type=int, default=None, help="CPU threads (default: physical cores)")
    add_device_arg(g)
    add_kernels_arg(g)
    add_lora_args(g)
    g.add_argument("--plain-template", action="store_true",
                   help="format chats with pyllm's plain template instead of the file's own chat template")
    g.add_argument("--chat-template-file", default=None, metavar="FILE",
                   help="format chats with the Jinja chat template in FILE instead of the file's own (as "
                        "llama.cpp's flag)")
    add_llama_cpp_args(g)


def gpu_layers_arg(text: str) -> int:
    """-ngl's value: a layer count >= 0, or -1 / 'all' / 'max' for every layer (-1)."""
    value = text.strip().lower()
    if value in ("all", "max", "-1"):
        return -1
    try:
        n = int(value)
    except ValueError:
        n = -2
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be a number of layers >= 0, or 'all' (or -1), got {shorten(text)!r}")
    return n


def add_llama_cpp_args(g) -> None:
    """Flags llama.cpp's tools take, accepted under their names: -ngl (layers on the GPU) and -fa (attention is
    always fused here: nothing to switch)."""
    g.add_argument("--n-gpu-layers", "-ngl", "--gpu-layers", dest="gpu_layers", type=gpu_layers_arg, default=None,
                   metavar="N", help="layers on the GPU, as llama.cpp's -ngl: the last N layers and their KV cache "
                                     "on the GPU, the rest on the CPU; 'all' (or -1, or more than the model's "
                                     "layers, e.g. 99) is --device cuda, 0 is --device cpu (default: --device "
                                     "decides; auto puts as many layers as fit)")
    g.add_argument("--flash-attn", "-fa", action="store_true",
                   help="accepted for llama.cpp command lines (with an optional on/off/auto): attention is always "
                        "fused here, so it changes nothing")


FLASH_ATTN_VALUES = ("on", "off", "auto", "1", "0", "true", "false", "enabled", "disabled")


def drop_flash_attn_values(argv: list[str]) -> list[str]:
    """argv without the value llama.cpp's newer -fa/--flash-attn takes (on, off, auto): the flag is a no-op here,
    and argparse's optional value would swallow a prompt that follows the flag."""
    out, skip = [], False
    for i, word in enumerate(argv):
        if skip:
            skip = False
            continue
        if word == "--":
            out += argv[i:]
            break
        if word.startswith("--flash-attn=") or word.startswith("-fa="):
            out.append(word.split("=", 1)[0])
            continue
        out.append(word)
        if word in ("-fa", "--flash-attn") and i + 1 < len(argv) and argv[i + 1].lower() in FLASH_ATTN_VALUES:
            skip = True
    return out


def apply_gpu_layers(a) -> None:
    """-ngl N checked against --device before the model is read: 0 is the CPU (--device cpu); N > 0 needs a GPU (an
    error naming the flag where none is usable) and reaches pyllm.load as gpu_layers, which places the layers once it
    knows their number (the last N on the GPU; all, -1 or more than the model's layers: the whole model, as --device
    cuda).  --device, if given, must agree."""
    n = getattr(a, "gpu_layers", None)
    if n is None:
        return
    device = a.device or "auto"
    flag = f"-ngl {'all' if n == -1 else n}"
    if n == 0:
        if device.startswith("cuda"):
            raise PyllmError(f"{flag} puts no layer on the GPU but --device is {device}; drop one of them")
        a.device = "cpu"
        return
    if device == "cpu":
        raise PyllmError(f"{flag} puts layers on the GPU but --device is cpu; drop one of them")
    from ..backends.split import gpu_problem

    why = gpu_problem(device)
    if why:
        raise PyllmError(f"{flag}: no GPU to put layers on here ({why}); use -ngl 0 (the CPU) or leave it out")
    a.device = device


class _LoraScaled(argparse.Action):
    """--lora-scaled FILE SCALE: the scale a finite number, else argparse's own usage error naming the flag."""

    def __call__(self, parser, namespace, values, option_string=None):
        path, scale = values
        try:
            value = _finite_float(scale)
        except ValueError:
            raise argparse.ArgumentError(self, f"SCALE must be a finite number, got {shorten(scale)!r}") from None
        setattr(namespace, self.dest, (getattr(namespace, self.dest) or []) + [(path, value)])


def add_lora_args(g) -> None:
    g.add_argument("--lora", action="append", default=None, metavar="FILE",
                   help="a LoRA adapter in llama.cpp's GGUF format, applied at run time with scale 1 (repeat for "
                        "several)")
    g.add_argument("--lora-scaled", action=_LoraScaled, nargs=2, default=None, metavar=("FILE", "SCALE"),
                   help="a LoRA adapter with its scale (repeat for several; combines with --lora)")


def lora_from_args(a) -> list[tuple[str, float]]:
    """pyllm.load's lora= from --lora and --lora-scaled."""
    return [(p, 1.0) for p in getattr(a, "lora", None) or []] + list(getattr(a, "lora_scaled", None) or [])


DEVICES = ("cpu", "cuda", "auto")


def device_choice(text: str) -> str:
    """--device's value: cpu, cuda, cuda:N (one GPU of several) or auto; anything else is a usage error naming
    the choices. Which device auto means is pyllm.load's decision, not the command line's."""
    value = text.strip().lower()
    if value in DEVICES or (value.startswith("cuda:") and value[5:].isdigit()):
        return value
    raise argparse.ArgumentTypeError(f"invalid choice: {shorten(text)!r} (choose from {', '.join(DEVICES)}, or cuda:N)")


def add_device_arg(g, default: str | None = "auto", help: str | None = None) -> None:
    g.add_argument("--device", type=device_choice, default=default, metavar="{" + ",".join(DEVICES) + "}",
                   help=help or "where the model runs: cpu, cuda (cuda:N for one GPU of several), or auto (default: "
                                "the GPU when one is usable and its kernels build, else the CPU)")


def add_kernels_arg(g) -> None:
    g.add_argument("--kernels", default="fast", choices=["fast", "reference"],
                   help="CPU kernels: fast (default) or reference (float32 torch, for checking accuracy)")
    # the flag's old name, kept working
    g.add_argument("--backend", dest="kernels", default=argparse.SUPPRESS, choices=["fast", "reference"],
                   help="deprecated: --kernels")


def seed_arg(text: str) -> int:
    """--seed as argparse parses it: an integer, or a word /set seed also takes for a random seed ("random",
    "none", "off"; the bad-seed message offers "random"), which becomes -1, random on every path. The range is
    checked with the other sampling flags (check_numeric_args)."""
    try:
        seed = _seed(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"seed must be {RULES['seed'][2]}, got {shorten(text)!r}") from None
    return -1 if seed is None else seed


def add_sampling_args(p: argparse.ArgumentParser, default_n: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("-n", "--max-tokens", type=int, default=default_n,
                   help=f"tokens to generate (default {default_n}; -1: until the context is full)")
    g.add_argument("--temp", type=float, default=0.8, help="temperature; 0 = greedy (default 0.8)")
    g.add_argument("--top-k", type=int, default=40, help="top-k, 0 = off (default 40)")
    g.add_argument("--top-p", type=float, default=0.95, help="top-p (default 0.95)")
    g.add_argument("--min-p", type=float, default=0.05, help="min-p (default 0.05)")
    g.add_argument("--repeat-penalty", type=float, default=1.0, help="repetition penalty (default 1.0 = off)")
    g.add_argument("--seed", type=seed_arg, default=None,
                   help="RNG seed (same seed, same text); -1 or 'random' for a random one (default)")


def add_spec_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--spec", default=None, choices=["none", "lookup", "draft"],
                   help="speculative decoding: lookup (drafts copied from the prompt and the text so far) or draft "
                        "(a draft model, --draft); the output distribution is unchanged (default: lookup for "
                        "greedy decoding on the CPU, where the check is exact; else none)")
    g.add_argument("--spec-k", type=int, default=None, metavar="K",
                   help="most tokens drafted per step, 1..7 (default 7; fewer while acceptance is low)")
    g.add_argument("--spec-ngram", type=int, default=None, metavar="N",
                   help="prompt lookup: longest suffix matched, tried down to 1 (default 4)")
    g.add_argument("--draft", default=None, metavar="MODEL",
                   help="draft model for --spec draft (same tokenizer; --spec defaults to draft when given)")


def spec_kwargs(a) -> dict:
    """LLM.spec_options from --spec*: speculative=/spec_k=/spec_ngram= (only those given)."""
    spec = getattr(a, "spec", None)
    if spec is None and getattr(a, "draft", None):
        spec = "draft"
    out = {} if spec is None else dict(speculative=spec)
    if getattr(a, "spec_k", None) is not None:
        out["spec_k"] = a.spec_k
    if getattr(a, "spec_ngram", None) is not None:
        out["spec_ngram"] = a.spec_ngram
    return out


def sampling_kwargs(a) -> dict:
    return dict(temperature=a.temp, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p, seed=a.seed,
                repeat_penalty=a.repeat_penalty)


def kv_flag(flag: str, kind: str) -> str:
    """``kind``, a KV cache type given by ``flag``, or PyllmError naming the flag (the cache's own error names only
    the type, and a command line may give several: --kv, -ctk, -ctv, --kl-base)."""
    from ..runtime.kv_kinds import split_kind

    try:
        split_kind(kind)
    except PyllmError as e:
        raise PyllmError(f"{flag}: {e}") from None
    return kind


def kv_kind_from_args(a) -> str:
    """--kv, with --kv-k / --kv-v overriding its key or value half: the cache kind string ("q8_0", "f16/q4_rot")."""
    from ..runtime.kv_kinds import join_kind, split_kind

    k, v = split_kind(kv_flag("--kv", a.kv))
    key, value = getattr(a, "kv_k", None), getattr(a, "kv_v", None)
    return join_kind(kv_flag("--kv-k/-ctk", key) if key else k, kv_flag("--kv-v/-ctv", value) if value else v)


def load_from_args(a, context_policy: str = "stop"):
    """pyllm.load with the runtime flags of run, chat and serve (--device passed through as given), the chat
    template chosen, and speculation set for every generation."""
    import pyllm

    apply_gpu_layers(a)
    template_source = None
    if getattr(a, "chat_template_file", None):
        if a.plain_template:
            raise PyllmError("--chat-template-file and --plain-template both choose the chat template; give one")
        template_source = read_text_arg(a.chat_template_file, "--chat-template-file")
    llm = pyllm.load(a.model, device=a.device, n_ctx=a.ctx, kv_cache=kv_kind_from_args(a), n_threads=a.threads,
                     kernels=a.kernels, quiet=False, verbose=getattr(a, "verbose", False),
                     context_policy=getattr(a, "context_policy", None) or context_policy,
                     draft=getattr(a, "draft", None), lora=lora_from_args(a), gpu_layers=getattr(a, "gpu_layers", None))
    if template_source is not None:
        llm.use_template(template_source, f"--chat-template-file {shorten(a.chat_template_file)}")
    elif getattr(a, "plain_template", False):
        llm.use_fallback_template()
    elif getattr(llm.template, "is_fallback", False) and (getattr(a, "command", None) == "chat"
                                                          or getattr(a, "chat", False)):
        print(f"pyllm: warning: {llm.path.name} has no chat template (a base model?); chats use a plain "
              f"fallback format, and replies may just continue the text", file=sys.stderr)
    llm.spec_options = spec_kwargs(a)  # every generation of this run/chat speculates as --spec* say
    return llm


def runtime_info(llm) -> dict:
    """Where a loaded model runs, for banners, /show, --json and bench rows: its backend's own description
    ({"device", "backend", and "isa" on the CPU or "gpu" on CUDA}) where the model holds a backend that
    describes itself, else the LLM's device and backend names with the CPU kernel ISA in use."""
    backend = getattr(getattr(llm, "model", None), "backend", None)
    if callable(getattr(backend, "describe", None)):
        return dict(backend.describe())
    rt = {"device": str(llm.device), "backend": llm.kernels}
    if rt["device"] == "cpu" and llm.kernels == "fast":
        from .. import ops

        rt["isa"] = ops.get_isa()
    return rt


def runtime_label(llm) -> str:
    """runtime_info as one phrase: 'cpu (fast, avx2 kernels)'."""
    from ..info import format_runtime

    return format_runtime(runtime_info(llm))


def read_stdin_text(limit: int = 64 << 20) -> str:
    """Standard input as text: at most ``limit`` bytes (a bigger prompt could not fit any context anyway), and
    bytes that are not UTF-8 replaced by U+FFFD with a note (as the tokenizer does with lone surrogates)."""
    stream = getattr(sys.stdin, "buffer", None)
    if stream is None:  # a StringIO in tests
        return sys.stdin.read(limit)
    data = stream.read(limit + 1)
    if len(data) > limit:
        raise PyllmError(f"standard input is larger than {limit >> 20} MiB; give a shorter prompt")
    return decode_utf8(data, "standard input")


def read_stdin_lines(limit: int = 64 << 20):
    """Standard input line by line, lazily (another program may be conversing through the pipe): (line number,
    text) pairs. A line of more than ``limit`` bytes (/dev/zero has no newline) is skipped in bounded pieces and
    comes as (line number, None); bytes that are not UTF-8 become U+FFFD with a note."""
    stream = getattr(sys.stdin, "buffer", None)
    if stream is None:  # a StringIO in tests
        yield from enumerate(sys.stdin, 1)
        return
    number = 0
    while True:
        line = stream.readline(limit + 1)
        if not line:
            return
        number += 1
        if len(line) > limit and not line.endswith(b"\n"):
            while line and not line.endswith(b"\n"):
                line = stream.readline(1 << 20)
            yield number, None
        else:
            yield number, decode_utf8(line, f"line {number} of standard input")


def decode_utf8(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        print(f"pyllm: note: {what} is not valid UTF-8 (byte {data[e.start]:#04x} at offset {e.start}); invalid "
              f"bytes were replaced by U+FFFD", file=sys.stderr)
        return data.decode("utf-8", errors="replace")


def read_bounded(path, what: str, limit: int) -> bytes:
    """The bytes of a file, at most ``limit`` of them: a device or FIFO (/dev/zero) or a huge file is refused
    after ``limit`` bytes instead of being read until memory runs out. PyllmError naming ``what`` and the file."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise PyllmError(f"{what} {shorten(path)}: cannot read: {e.strerror or e}") from None
    if len(data) > limit:
        raise PyllmError(f"{what} {shorten(path)}: larger than {limit >> 20} MiB")
    return data


def read_text_arg(path: str, what: str, limit: int = 1 << 20, strict: bool = True) -> str:
    """The text of a FILE argument ('-' = standard input), at most ``limit`` bytes (a schema or grammar is small;
    a text to score is bigger, never unbounded). Bytes that are not UTF-8 are an error naming the flag and file
    when ``strict`` (a schema must mean what it says), else U+FFFD with a note (a text to score)."""
    if path == "-":
        return read_stdin_text(limit)
    data = read_bounded(path, what, limit)
    if not strict:
        return decode_utf8(data, f"{what} {shorten(path)}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PyllmError(f"{what} {shorten(path)}: not UTF-8 text (byte {data[e.start]:#04x} at offset "
                         f"{e.start})") from None


# ---- numeric flags: checked for every subcommand before anything is loaded --------------------------------------

# dest -> (flag as the user wrote it, lowest, highest or None); a value of None means "the default".
NUMERIC_FLAGS = {
    "ctx": ("--ctx", 0, 1 << 24),
    "threads": ("--threads", 1, None),
    "chunks": ("--chunks", 1, None),
    "spec_k": ("--spec-k", 1, 7),  # SpecSettings.validate's ranges, checked even where this run does not speculate
    "spec_ngram": ("--spec-ngram", 1, 16),
    # bench: each count multiplies its run time, and -p/-n/-d size its KV cache. No model's context exceeds 2**20
    # tokens, and a thousand repetitions already measure to a fraction of a percent; 10**21 ran "forever".
    "repetitions": ("-r/--repetitions", 1, 1000),
    "n_prompt": ("-p/--n-prompt", 0, 1 << 20),
    "n_gen": ("-n/--n-gen", 0, 1 << 20),
    "n_depth": ("-d/--n-depth", 0, 1 << 20),
    # serve
    "port": ("--port", 0, 65535),
    "parallel": ("--parallel", 1, 64),  # sequences decoded together, each with a context-sized KV slot
    "replicas": ("--replicas", 1, 64),
    "kv_pool_tokens": ("--kv-pool-tokens", 1, 1 << 30),  # at least --ctx: checked where the pool is made
    "max_body": ("--max-body", 1, None),  # bytes; below 1 every request would be refused as too large
    "max_request_memory": ("--max-request-memory", 1, None),  # MiB
    "client_timeout": ("--client-timeout", 1, 1 << 31),  # seconds; a deadline beyond a float's range cannot be set
}


def max_threads() -> int:
    """More threads than this only thrashes (and at some count the OpenMP runtime fails with its own text)."""
    return 4 * (os.cpu_count() or 1)


def check_numeric_args(a) -> None:
    """SettingError naming the flag for any numeric flag out of range (argparse checks only that it parses: it
    takes -1, 10**9, nan and inf). Sampling flags follow the REPL's /set rules (RULES above), so `run`, `chat`
    and /set accept the same values; --seed -1 means random everywhere."""
    for dest, (flag, lo, hi) in NUMERIC_FLAGS.items():
        v = getattr(a, dest, None)
        if v is None:
            continue
        if dest == "threads":
            hi = max_threads()
        if dest == "ctx" and getattr(a, "command", None) == "perplexity":
            lo = 16  # a chunk scores its second half
        if (isinstance(v, float) and not math.isfinite(v)) or v < lo or (hi is not None and v > hi):
            rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            extra = f" ({os.cpu_count()} CPUs here)" if dest == "threads" else ""
            extra += " (0 = the model's own)" if dest == "ctx" and lo == 0 else ""
            raise SettingError(f"argument {flag}: must be {rng}{extra}, got {v}")
    draft, spec = getattr(a, "draft", None), getattr(a, "spec", None)
    # run and chat speculate with --draft when --spec is not given; bench compares plain and --spec decoding only
    if draft and (spec not in (None, "draft") or (spec is None and getattr(a, "command", None) == "bench")):
        raise SettingError(f"argument --draft: only --spec draft uses a draft model, and --spec is "
                           f"{spec or 'not given'}; drop one of them")
    if getattr(a, "command", None) == "serve" and (spec == "draft" or draft) and (a.parallel or 1) > 1:
        # a draft model keeps one cache, so the batch engine's slots speculate by lookup only
        raise SettingError(f"argument --spec: a draft model drafts for one request at a time, and --parallel is "
                           f"{a.parallel}; use --spec lookup, or --parallel 1")
    if getattr(a, "command", None) in ("run", "chat") and hasattr(a, "temp"):
        Settings.from_args(a)  # names the flag; same rules as /set
        if a.seed is not None and a.seed == -1:
            a.seed = None  # random, like chat



# ---- environment defaults (serve) -----------------------------------------------------------------------------------

ENV_PREFIX = "PYLLM_ARG_"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_names(action, prefix: str = ENV_PREFIX) -> list[str]:
    """The variables that give ``action`` a default: PREFIX + each long flag (or a positional's name) in capitals,
    dashes as underscores (--ctx: PYLLM_ARG_CTX, --n-gpu-layers: PYLLM_ARG_N_GPU_LAYERS, MODEL: PYLLM_ARG_MODEL)."""
    names = [o[2:] for o in action.option_strings if o.startswith("--")] or ([] if action.option_strings
                                                                            else [action.dest])
    return [prefix + n.upper().replace("-", "_") for n in names]


def _given(action, argv: list[str], parser) -> bool:
    for word in argv:
        for opt in action.option_strings:
            if word == opt or word.startswith(opt + "=") or (
                    len(opt) == 2 and word.startswith(opt) and word not in parser._option_string_actions):
                return True
    return False


def apply_env_defaults(a, parser, argv: list[str], prefix: str = ENV_PREFIX) -> None:
    """Values from PYLLM_ARG_* variables for the flags the command line leaves out (llama-server's LLAMA_ARG_*
    habit: a container sets the variables, the command stays `pyllm serve`). The command line wins; a variable
    that names no flag, or holds a value the flag would refuse, is a SettingError naming it."""
    env = {k: v for k, v in os.environ.items() if k.startswith(prefix)}
    if not env:
        return
    known = {}
    for action in parser._actions:
        if action.dest in ("help", "verbose", "model_flag", "model_required") or isinstance(
                action, argparse._SubParsersAction):
            continue
        for name in env_names(action, prefix):
            known[name] = action
    unknown = sorted(set(env) - set(known))
    if unknown:
        raise SettingError(f"{unknown[0]} names no flag of {parser.prog}; these variables are read: "
                           f"{', '.join(sorted(known))}")
    for name, text in sorted(env.items()):
        action = known[name]
        if action.dest == "model":
            if a.model is not None or a.model_flag is not None:
                continue
        elif _given(action, argv, parser):
            continue
        try:
            if isinstance(action, argparse._StoreTrueAction):
                word = text.strip().lower()
                if word not in _TRUE + _FALSE:
                    raise ValueError("must be 1/true/yes/on or 0/false/no/off")
                value = word in _TRUE
            else:
                items = [t.strip() for t in text.split(",")] if isinstance(action, argparse._AppendAction) \
                    else [text]
                items = [action.type(t) if action.type else t for t in items]
                if action.choices is not None and any(v not in action.choices for v in items):
                    raise ValueError(f"choose from {', '.join(map(str, action.choices))}")
                value = items if isinstance(action, argparse._AppendAction) else items[0]
        except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
            why = str(e) if isinstance(e, argparse.ArgumentTypeError) or "choose" in str(e) or "must" in str(e) \
                else f"not a valid {getattr(action.type, '__name__', 'value')}"
            raise SettingError(f"{name}={shorten(text)!r} (for {'/'.join(action.option_strings) or action.dest}): "
                               f"{why}") from None
        setattr(a, action.dest, value)
