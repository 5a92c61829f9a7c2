"""Fill-in-the-middle prompts: the token sequence a FIM-trained model (Qwen2.5-Coder, StarCoder, CodeLlama, ...)
continues with the text between a prefix and a suffix, built from the model's FIM tokens
(``Tokenizer.fim_ids``) in prefix-suffix-middle order, as the peers build it:

- ``suffix_ids``: OpenAI's ``suffix`` on ``/v1/completions`` (llama-cpp-python's ``create_completion``):
  ``[BOS] <PRE> prompt <SUF> suffix <MID>``.
- ``infill_ids``: llama-server's ``/infill`` (its ``format_infill``, repository-level form): the extra files, each
  after ``<SEP>`` and its file name, under ``<REP>myproject``, then ``<SEP>filename`` and
  ``[BOS] <PRE> input_prefix prompt <SUF> input_suffix <MID>``, the prefix and suffix cut to fit its batch.

A vocabulary without the prefix, suffix and middle tokens (SmolLM2) is a BadRequest naming what is missing.
"""

from __future__ import annotations

from .errors import BadRequest

# llama-server's default batch (-b 2048): /infill keeps at most the last 3/4 of it of the prefix and fills the
# first 1/4 with the suffix and the prompt, so the FIM part of the prompt fits one batch
INFILL_BATCH = 2048
# The repository and file names llama-server writes (it takes neither from the request)
INFILL_REPO, INFILL_FILE, INFILL_EXTRA_FILE = "myproject\n", "filename\n", "tmp"
# Between extra chunks where the vocabulary has no file separator token: "\n\n--- snippet ---\n\n"
INFILL_SNIPPET = "\n\n--- snippet ---\n\n"


def fim_tokens(tokenizer, param: str = "suffix") -> tuple[int, int, int]:
    """(prefix, suffix, middle) token ids; BadRequest naming ``param`` when the vocabulary lacks any of them."""
    fim = tokenizer.fim_ids
    missing = [name for name in ("prefix", "suffix", "middle") if fim.get(name) is None]
    if missing:
        raise BadRequest(f"{param}: this model has no fill-in-the-middle tokens (no FIM {', '.join(missing)} token "
                         f"in its vocabulary); use a FIM-trained model such as qwen2.5-coder-0.5b", param)
    return fim["prefix"], fim["suffix"], fim["middle"]


def _text(value, param: str) -> str:
    if not isinstance(value, str):
        raise BadRequest(f"{param} must be a string, got {type(value).__name__}", param)
    return value


def suffix_ids(tokenizer, prompt: str | list[int], suffix: str) -> list[int]:
    """The prompt of a completion with ``suffix``: ``[BOS] <PRE> prompt <SUF> suffix <MID>``, the prompt's text
    and the suffix tokenized as plain text (special tokens written in them are not parsed), as llama-cpp-python
    builds it; ``prompt`` may be token ids, taken as they are."""
    pre, suf, mid = fim_tokens(tokenizer)
    _text(suffix, "suffix")
    if isinstance(prompt, str):
        head = tokenizer.encode(prompt, add_bos=False, special=False)
    else:
        head = list(prompt)
    bos = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    return bos + [pre] + head + [suf] + tokenizer.encode(suffix, add_bos=False, special=False) + [mid]


def infill_ids(tokenizer, input_prefix: str, input_suffix: str, prompt: str = "", input_extra=None,
               n_ctx: int = 4096, n_predict: int | None = None) -> list[int]:
    """llama-server's /infill prompt (``format_infill``, prefix-suffix-middle order):

        [<REP> myproject\\n] (<SEP> name\\n text)* [<SEP> filename\\n]  [BOS] <PRE> prefix prompt <SUF> suffix <MID>

    where a vocabulary without <SEP> separates extra chunks with "\\n\\n--- snippet ---\\n\\n" instead. The prefix
    keeps its last 3/4 of INFILL_BATCH tokens, the suffix its first 1/4 less the prompt and the two FIM tokens,
    and the extra context its last ``n_ctx - INFILL_BATCH - 2 * n_predict`` tokens (``n_predict`` None: -1, as
    llama-server's default). ``input_extra``: a list of {"text": str, "filename": str (default "tmp")}. Prefix,
    suffix and extra texts are tokenized as plain text; the prompt parses special tokens, as llama-server's do."""
    pre, suf, mid = fim_tokens(tokenizer, "input_prefix")
    prefix = tokenizer.encode(_text(input_prefix, "input_prefix"), add_bos=False, special=False)
    suffix = tokenizer.encode(_text(input_suffix, "input_suffix"), add_bos=False, special=False)
    head = tokenizer.encode(_text(prompt, "prompt"), add_bos=False, special=True) if prompt else []
    if input_extra is None:
        input_extra = []
    if not isinstance(input_extra, list):
        raise BadRequest('input_extra must be an array of {"filename": string, "text": string}', "input_extra")
    rep, sep = tokenizer.fim_ids.get("repo"), tokenizer.fim_ids.get("file_sep")

    def plain(text: str) -> list[int]:
        return tokenizer.encode(text, add_bos=False, special=False)

    extra = [rep] + plain(INFILL_REPO) if rep is not None else []
    for i, chunk in enumerate(input_extra):
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise BadRequest(f'input_extra[{i}] must be an object with a "text" string', "input_extra")
        name = chunk.get("filename", INFILL_EXTRA_FILE)
        if not isinstance(name, str):
            raise BadRequest(f'input_extra[{i}].filename must be a string', "input_extra")
        extra += [sep] + plain(name + "\n") if sep is not None else plain(INFILL_SNIPPET)
        extra += plain(chunk["text"])
    if sep is not None:
        extra += [sep] + plain(INFILL_FILE)
    predict = -1 if n_predict is None else n_predict
    prefix = prefix[len(prefix) - min(len(prefix), 3 * (INFILL_BATCH // 4)):]
    suffix = suffix[:min(len(suffix), max(0, INFILL_BATCH // 4 - (2 + len(head))))]
    n_extra = min(max(0, n_ctx - INFILL_BATCH - 2 * predict), len(extra))
    bos = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    return extra[len(extra) - n_extra:] + bos + [pre] + prefix + head + [suf] + suffix + [mid]
