"""The folder's tokenizer (tokenizer.json through the tokenizers library, ids from tokenizer_config.json and
generation_config.json) and its chat template, as pyllm's Tokenizer and template source."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ...errors import AWQError, TokenizerError
from ...safe_io import read_json, read_regular
from .config import read_folder_json, short


def _token_str(v) -> str | None:
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def tokenizer_from_hf(root: Path, n_vocab_model: int):
    """pyllm's Tokenizer over tokenizer.json (tokenizers library), with tokenizer_config / generation_config ids."""
    from tokenizers import Tokenizer as HFTok

    from ...tokenizer import Tokenizer
    from ...vocabulary import BYTE, CONTROL, EOG_TEXTS, NORMAL, UNUSED, USER_DEFINED

    path = root / "tokenizer.json"
    if not os.path.lexists(path):
        raise TokenizerError(f"{root}: tokenizer.json is missing (needed for the vocabulary)")
    spec = read_json(path, TokenizerError)
    try:
        backend = HFTok.from_str(json.dumps(spec))
    except Exception as e:  # the tokenizers library raises plain Exceptions
        raise TokenizerError(f"{path}: cannot be loaded ({str(e).splitlines()[0] if str(e) else type(e).__name__})") \
            from None
    tc = read_folder_json(root / "tokenizer_config.json", required=False)
    gc = read_folder_json(root / "generation_config.json", required=False)
    n = backend.get_vocab_size(with_added_tokens=True)
    tokens = [backend.id_to_token(i) or "" for i in range(n)]
    model = spec.get("model") or {}
    dec = json.dumps(spec.get("decoder") or {})
    spm = bool(model.get("byte_fallback")) or "\u2581" in dec or "Metaspace" in dec
    types = [NORMAL] * n
    if spm:
        for i, t in enumerate(tokens):
            if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", t):
                types[i] = BYTE
    for at in spec.get("added_tokens") or []:
        i = at.get("id")
        if isinstance(i, int) and 0 <= i < n:
            types[i] = CONTROL if at.get("special") else USER_DEFINED

    def tid(v):
        s = _token_str(v)
        return backend.token_to_id(s) if s is not None else None

    bos_id = tid(tc.get("bos_token"))
    eos_id = tid(tc.get("eos_token"))
    if bos_id is None and isinstance(gc.get("bos_token_id"), int) and tc.get("bos_token", 0) is not None:
        bos_id = gc["bos_token_id"]
        if not 0 <= bos_id < n:
            raise TokenizerError(f"{root / 'generation_config.json'}: bos_token_id {bos_id} is not in the "
                                 f"vocabulary of {n} tokens")
    eog = set()
    ge = gc.get("eos_token_id")
    for e in (ge if isinstance(ge, list) else [ge]):
        if isinstance(e, int) and 0 <= e < n:
            eog.add(e)
    if eos_id is None and eog:
        eos_id = min(eog)
    if eos_id is not None:
        eog.add(eos_id)
    for t in EOG_TEXTS:
        i = backend.token_to_id(t)
        if i is not None and types[i] == CONTROL:
            eog.add(i)
    # add BOS as transformers would: the config's flag, else whatever the post-processor does
    add_bos = tc.get("add_bos_token")
    if add_bos is not None and not isinstance(add_bos, bool):
        raise TokenizerError(f"{root / 'tokenizer_config.json'}: add_bos_token = {short(add_bos)} is not true or "
                             f"false")
    if add_bos is None:
        with_sp = backend.encode("a", add_special_tokens=True).ids
        add_bos = bool(bos_id is not None and with_sp and with_sp[0] == bos_id)
    add_bos = bool(add_bos) and bos_id is not None
    if spm:
        # pyllm's SPM encoder inserts the prefix space and the U+2581 escapes itself
        backend.normalizer = None
        backend.pre_tokenizer = None
    backend.post_processor = None
    try:
        backend.encode_special_tokens = True  # pyllm cuts special tokens out itself (or keeps them as text)
    except AttributeError:
        pass
    if n < n_vocab_model:  # embedding rows beyond the vocabulary (padding): decode to nothing
        tokens += [""] * (n_vocab_model - n)
        types += [UNUSED] * (n_vocab_model - n)
    tok = Tokenizer(kind="spm" if spm else "bpe", tokens=tokens, types=types, backend=backend, bos_id=bos_id,
                    eos_id=eos_id, eog_ids=eog, add_bos=add_bos, add_eos=False, add_space_prefix=spm)
    return tok


def chat_template_source(root: Path) -> str | None:
    tc = read_folder_json(root / "tokenizer_config.json", required=False)
    src = tc.get("chat_template")
    if isinstance(src, list):  # [{"name": "default", "template": ...}, ...]
        src = next((t.get("template") for t in src if isinstance(t, dict) and t.get("name") == "default"), None)
    if src is not None and not isinstance(src, str):
        raise AWQError(f"{root / 'tokenizer_config.json'}: chat_template = {short(src)} is not a string")
    if src is None:
        jinja = root / "chat_template.jinja"
        raw = read_regular(jinja, 1 << 20, AWQError) if os.path.lexists(jinja) else None
        try:
            src = raw.decode("utf-8") if raw is not None else None
        except UnicodeDecodeError as e:
            raise AWQError(f"{jinja}: the chat template is not UTF-8 text (byte {raw[e.start]:#04x} at offset "
                           f"{e.start})") from None
    return src if src and src.strip() else None
