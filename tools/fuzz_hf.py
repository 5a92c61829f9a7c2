"""Fuzz the Hugging Face folder readers: `pyllm convert` and AWQ folders (config.json, tokenizer.json,
tokenizer_config.json, chat_template.jinja and safetensors headers).

The idea of tools/fuzz_gguf.py, for folders. Each case, derived deterministically from (seed, index), takes a
small valid checkpoint (a dense llama for convert, a hand-packed AWQ llama for the AWQ loader) and lies in one to
three places: a config field of the wrong type or range (strings, lists, objects, booleans, negatives, 2**63,
NaN/Infinity, 1e308, odd head dimensions, rotary factors outside (0, 1]), a tokenizer field (merges, vocab,
added tokens, pre-tokenizer, model type), tokenizer_config fields (special tokens, add_bos_token, a template of
the wrong type or with bytes that are not UTF-8), a safetensors header entry (dtype, shape, offsets, the header's
length itself), a whole file replaced (truncated, not UTF-8, nested 100,000 deep, empty, not an object), or a
file that is not a file (a FIFO, a directory, a link to /dev/zero). The case then goes through
``pyllm.formats.convert.convert`` (and the written file through ``open_gguf``) or ``pyllm.formats.awq.folder.read_awq`` (config,
weights, tokenizer, chat template) and one template render.

Only ``PyllmError`` may escape. Any other exception is a failure (saved to ``--out`` as the folder); a case that
hangs (a FIFO opened for reading blocks forever) ends the run through faulthandler after ``--timeout`` seconds
with the case's stack. Replay one case with ``--start I -n 1``.

    python tools/fuzz_hf.py -n 300 --seed 0
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import random
import shutil
import struct
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

HID, FF, VOCAB, G = 64, 128, 300, 32
INTERESTING = [None, -1, 0, 1, 2, 3, 7, 2 ** 31, 2 ** 63, -2 ** 63, 1e308, -0.0, 0.5, 1.5, float("nan"),
               float("inf"), "", "8", "llama", [], [1, 2], {}, {"a": 1}, True, False, [[[]]], "x" * 5000]
CONFIG_KEYS = ["model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps",
               "rope_theta", "partial_rotary_factor", "tie_word_embeddings", "sliding_window", "use_sliding_window",
               "bos_token_id", "eos_token_id", "rope_scaling", "rope_parameters", "text_config", "_name_or_path",
               "query_pre_attn_scalar", "quantization_config"]
ROPE_VALUES = [{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0},
               {"rope_type": "linear", "factor": -1}, {"rope_type": "linear"}, {"type": 5},
               {"full_attention": [1]}, {"full_attention": {"rope_theta": "x"}}, {"partial_rotary_factor": 2.0},
               {"rope_type": "yarn", "factor": 2.0}, [1], "llama3"]
QC_KEYS = ["quant_method", "bits", "group_size", "zero_point", "version", "modules_to_not_convert"]
TOKENIZER_CONFIG_KEYS = ["bos_token", "eos_token", "pad_token", "add_bos_token", "chat_template"]


# ---- seeds -------------------------------------------------------------------------------------------------------

def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 4, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog"] * 20, trainer)
    return tok.to_str()


def _config(awq: bool) -> dict:
    cfg = dict(model_type="llama", hidden_size=HID, intermediate_size=FF, num_hidden_layers=1,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
               rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=2)
    if awq:
        cfg["quantization_config"] = dict(quant_method="awq", bits=4, group_size=G, zero_point=True, version="gemm")
    return cfg


def _tensors(awq: bool) -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    t = {"model.embed_tokens.weight": torch.randn(VOCAB, HID, generator=g).half(),
         "model.norm.weight": torch.ones(HID).half(), "lm_head.weight": torch.randn(VOCAB, HID, generator=g).half()}
    p = "model.layers.0."
    t[p + "input_layernorm.weight"] = torch.ones(HID).half()
    t[p + "post_attention_layernorm.weight"] = torch.ones(HID).half()
    kv = HID // 2
    for name, (k, n) in {"self_attn.q_proj": (HID, HID), "self_attn.k_proj": (HID, kv),
                         "self_attn.v_proj": (HID, kv), "self_attn.o_proj": (HID, HID), "mlp.gate_proj": (HID, FF),
                         "mlp.up_proj": (HID, FF), "mlp.down_proj": (FF, HID)}.items():
        if awq:
            t[p + name + ".qweight"] = torch.randint(-2 ** 31, 2 ** 31 - 1, (k, n // 8), dtype=torch.int32, generator=g)
            t[p + name + ".qzeros"] = torch.randint(-2 ** 31, 2 ** 31 - 1, (k // G, n // 8), dtype=torch.int32,
                                                    generator=g)
            t[p + name + ".scales"] = (torch.rand(k // G, n, generator=g) * 0.01).half()
        else:
            t[p + name + ".weight"] = (torch.randn(n, k, generator=g) * 0.05).half()
    return t


def make_seed(awq: bool) -> dict[str, bytes]:
    """A valid checkpoint folder as {file name: bytes}."""
    from safetensors.torch import save

    tc = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "add_bos_token": False,
          "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                           "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"}
    return {"config.json": json.dumps(_config(awq)).encode(), "tokenizer.json": _tokenizer_json().encode(),
            "tokenizer_config.json": json.dumps(tc).encode(), "model.safetensors": save(_tensors(awq))}


# ---- mutations ---------------------------------------------------------------------------------------------------

def _split_st(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def _join_st(header: dict, body: bytes) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + body


SPECIAL = ("fifo", "dir", "devzero", "missing")  # whole files that are not files


def mutate(files: dict[str, bytes], rng: random.Random) -> tuple[dict, dict[str, str], list[str]]:
    """(files, {name: special kind}, what was done) with one to three lies."""
    files = dict(files)
    special: dict[str, str] = {}
    done: list[str] = []
    for _ in range(rng.choice((1, 1, 2, 3))):
        try:
            _lie(files, special, done, rng)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError, struct.error):
            done.append("(a lie about a file an earlier lie broke: skipped)")
    return files, special, done


def _lie(files: dict, special: dict, done: list, rng: random.Random) -> None:
    for _ in range(1):
        what = rng.random()
        if what < 0.35:
            cfg = json.loads(files["config.json"])
            key = rng.choice(CONFIG_KEYS)
            if key in ("rope_scaling", "rope_parameters") and rng.random() < 0.7:
                value = rng.choice(ROPE_VALUES)
            elif key == "quantization_config" and isinstance(cfg.get(key), dict) and rng.random() < 0.8:
                sub = rng.choice(QC_KEYS)
                cfg[key][sub] = rng.choice(INTERESTING + [-1, 33, 64, "gemv", "awq", 8])
                files["config.json"] = json.dumps(cfg).encode()
                done.append(f"config.json quantization_config.{sub}")
                continue
            elif key == "head_dim" and rng.random() < 0.5:
                value = rng.choice([15, 17, 33, 2, 1])
            elif key == "partial_rotary_factor" and rng.random() < 0.5:
                value = rng.choice([0.0, 1e-9, 0.01, 1.0000001, 2.0, -0.5])
            else:
                value = rng.choice(INTERESTING)
            if rng.random() < 0.1:
                cfg.pop(key, None)
                done.append(f"config.json -{key}")
            else:
                cfg[key] = value
                done.append(f"config.json {key}={str(value)[:40]}")
            files["config.json"] = json.dumps(cfg).encode()
        elif what < 0.55:
            tj = json.loads(files["tokenizer.json"])
            model = tj["model"]
            choice = rng.randrange(8)
            if choice == 0 and model.get("merges"):
                i = rng.randrange(len(model["merges"]))
                model["merges"][i] = rng.choice([["a"], "a b c", 5, ["a", 1], "", None, ["", "b"], {"a": "b"}])
            elif choice == 1:
                model["merges"] = rng.choice(INTERESTING)
            elif choice == 2:
                vocab = model["vocab"]
                k = rng.choice(sorted(vocab))
                vocab[k] = rng.choice([-1, 10 ** 9, "1", None, 1.5, VOCAB + 5])
            elif choice == 3:
                tj["added_tokens"] = rng.choice([[{"id": -1, "content": "x"}], [{"content": "x"}], 5,
                                                 [{"id": 10 ** 9, "content": "y", "special": True}], [[]]])
            elif choice == 4:
                tj["pre_tokenizer"] = rng.choice([[1], "x", {"type": "Sequence", "pretokenizers": [1]},
                                                  {"type": "Sequence", "pretokenizers": "x"}, {"type": "Split"},
                                                  None, {"type": "Digits", "individual_digits": True}])
            elif choice == 5:
                model["type"] = rng.choice(["WordPiece", "Unigram", 5, None])
            elif choice == 6:
                tj["model"] = rng.choice(INTERESTING)
            else:
                tj["decoder"] = rng.choice(INTERESTING)
            files["tokenizer.json"] = json.dumps(tj).encode()
            done.append(f"tokenizer.json choice {choice}")
        elif what < 0.65:
            tc = json.loads(files["tokenizer_config.json"])
            key = rng.choice(TOKENIZER_CONFIG_KEYS)
            tc[key] = rng.choice(INTERESTING + [{"content": 5}, {"content": "<|im_end|>"}, [{"name": "default"}],
                                                "{% for %}", "{{ raise_exception('x') }}"])
            files["tokenizer_config.json"] = json.dumps(tc).encode()
            done.append(f"tokenizer_config.json {key}")
            if rng.random() < 0.3:  # a template file whose bytes are not UTF-8
                files["chat_template.jinja"] = b"{{ messages }}\xff\xfe"
                tc.pop("chat_template", None)
                files["tokenizer_config.json"] = json.dumps(tc).encode()
                done.append("chat_template.jinja not UTF-8")
        elif what < 0.85:
            header, body = _split_st(files["model.safetensors"])
            names = [n for n in header if n != "__metadata__"]
            name = rng.choice(names)
            entry = header[name]
            choice = rng.randrange(7)
            if choice == 0:
                entry["dtype"] = rng.choice(["F64", "I16", "U64", "BOOL", 5, None, "F8_E4M3", "I32", "F32"])
            elif choice == 1:
                entry["shape"] = rng.choice([[], [0], [-1], [2 ** 40, 2 ** 40], [1.5], ["4"], [3, 5, 7], [2 ** 63]])
            elif choice == 2:
                a, b = entry["data_offsets"]
                entry["data_offsets"] = rng.choice([[b, a], [a, b + 2], [0, 2 ** 63], [-1, b], [a], "x",
                                                    [a + 1, b + 1], [len(body), len(body) + b - a]])
            elif choice == 3:
                del header[name]
            elif choice == 4:
                header[name] = rng.choice(INTERESTING)
            elif choice == 5:
                header["__metadata__"] = rng.choice(INTERESTING)
            else:
                files["model.safetensors"] = struct.pack("<Q", rng.choice([0, 2 ** 63, 2 ** 31, 7])) + \
                    files["model.safetensors"][8:]
                done.append("safetensors header length lies")
                continue
            files["model.safetensors"] = _join_st(header, body)
            done.append(f"safetensors {name} choice {choice}")
        else:
            name = rng.choice(["config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors",
                               "chat_template.jinja"])
            kind = rng.choice(["truncate", "not-utf8", "deep", "empty", "list", "huge-string", *SPECIAL])
            if kind in SPECIAL:
                special[name] = kind
                files.pop(name, None)
            elif name in files or name == "chat_template.jinja":
                data = files.get(name, b"{{ messages }}")
                files[name] = {"truncate": data[:rng.randrange(max(len(data), 1))], "not-utf8": b"\xff" + data,
                               "deep": b"[" * 100_000 + b"]" * 100_000, "empty": b"", "list": b"[1, 2]",
                               "huge-string": b'{"a": "' + b"x" * 3_000_000 + b'"}'}[kind]
            done.append(f"{name} {kind}")


# ---- running -----------------------------------------------------------------------------------------------------

def write_folder(d: Path, files: dict[str, bytes], special: dict[str, str]) -> None:
    d.mkdir(parents=True)
    for name, data in files.items():
        if name not in special:
            (d / name).write_bytes(data)
    for name, kind in special.items():
        p = d / name
        if kind == "fifo":
            os.mkfifo(p)
        elif kind == "dir":
            p.mkdir()
        elif kind == "devzero":
            p.symlink_to("/dev/zero")


def run_case(d: Path, awq: bool) -> str:
    """'ok' or 'rejected'; anything but a PyllmError propagates."""
    from pyllm.errors import PyllmError

    try:
        if awq:
            from pyllm.formats.awq.folder import read_awq

            ck = read_awq(d)
            ck.template.render([{"role": "user", "content": "hi"}])
        else:
            from pyllm.formats.convert import convert
            from pyllm.formats.gguf import open_gguf

            out = convert(d, d.parent / "out.gguf", "f16", log=None)
            with open_gguf(out):
                pass
    except PyllmError:
        return "rejected"
    return "ok"


@dataclass
class Report:
    cases: int = 0
    ok: int = 0
    rejected: int = 0
    failures: list = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        lines = [f"{self.cases} cases in {self.seconds:.1f} s: {self.ok} converted or loaded, {self.rejected} "
                 f"rejected with PyllmError, {len(self.failures)} failures"]
        lines += [f"  case {i} ({'awq' if a else 'convert'}; {'; '.join(w)}): {e}" for i, a, w, e in self.failures]
        return "\n".join(lines)


def fuzz(n: int, seed: int = 0, start: int = 0, out: str | None = None, case_timeout: float | None = None) -> Report:
    seeds = {False: make_seed(False), True: make_seed(True)}
    rep = Report()
    t0 = time.monotonic()
    for i in range(start, start + n):
        rng = random.Random(f"{seed}:{i}")
        awq = rng.random() < 0.4
        files, special, what = mutate(seeds[awq], rng)
        with tempfile.TemporaryDirectory(prefix="pyllm-fuzz-hf-") as tmp:
            d = Path(tmp) / "ckpt"
            write_folder(d, files, special)
            if case_timeout:  # a case blocked in open() (a FIFO) cannot be interrupted: the run ends with its stack
                faulthandler.dump_traceback_later(case_timeout, exit=True)
            try:
                result = run_case(d, awq)
            except (Exception, RecursionError, MemoryError) as e:  # anything but a PyllmError is a failure
                first = (str(e).splitlines() or [""])[0][:200]
                rep.failures.append((i, awq, what, f"{type(e).__name__}: {first}"))
                if out:
                    shutil.copytree(d, Path(out) / f"case{i}", symlinks=True,
                                    ignore=lambda _, names: [x for x in names if x in special])
                continue
        rep.ok += result == "ok"
        rep.rejected += result == "rejected"
    if case_timeout:
        faulthandler.cancel_dump_traceback_later()
    rep.cases = n
    rep.seconds = time.monotonic() - t0
    return rep


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=300, help="number of cases")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", type=int, default=0, help="first case index (replay one with --start I -n 1)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds before a hung case ends the run")
    ap.add_argument("--out", help="folder to save failing cases in")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    a = ap.parse_args(argv)
    os.environ.setdefault("PYLLM_NO_EXT", "1")  # the readers only: no extension build
    rep = fuzz(a.n, a.seed, a.start, a.out, case_timeout=a.timeout)
    if a.json:
        print(json.dumps({"cases": rep.cases, "ok": rep.ok, "rejected": rep.rejected, "seconds": rep.seconds,
                          "failures": [list(f[:1]) + [f[3]] for f in rep.failures]}))
    else:
        print(rep.summary())
    return 1 if rep.failures else 0


if __name__ == "__main__":
    sys.exit(main())
