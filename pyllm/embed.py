"""Text embeddings from a generative model: the final (normed) hidden states pooled over the text's tokens.

Pooling follows the file's ``{arch}.pooling_type`` (llama.cpp's enum: 1 mean, 2 cls = first token, 3 last token);
files without it (every decoder-only chat model) get mean pooling. Vectors are L2-normalised, so a dot product is
the cosine similarity.

An embedding encoder (the BERT family, models/encoder.py) is what retrieval wants: its hidden states come from one
bidirectional pass over the text ([CLS] ... [SEP]), pooled as its spec says.  A Matryoshka encoder's vectors may
be shortened (``dimensions``): the first n values, normalised again.
"""

from __future__ import annotations

import torch

from .errors import BadRequest, PyllmError
from .request_checks import check_number, refuse_unknown

POOLING = {1: "mean", 2: "cls", 3: "last"}


def pooling_of(llm) -> str:
    if getattr(llm, "is_encoder", False):
        return llm.model.spec.pooling
    return POOLING.get(llm.gguf.get(f"{llm.config.arch}.pooling_type") if hasattr(llm.gguf, "get") else None,
                       "mean")


def _hidden_states(llm, ids: list[int]) -> torch.Tensor:
    """[len(ids), n_embd] float32: the hidden states the output layer would read, from a fresh evaluation."""
    model, gen = llm.model, llm.generator
    captured: list[torch.Tensor] = []

    def capture(x, w):  # stands in for the output projection: keep its input, skip the vocabulary-sized matmul
        captured.append(x.float().clone())
        return x[:, :1]

    saved = model.__dict__.get("output_linear"), model.__dict__.get("use_cpp_decode")
    model.output_linear = capture
    model.use_cpp_decode = False  # the fused one-token step never exposes its hidden state
    try:
        gen.reset()
        for i in range(0, len(ids), gen.n_batch):
            gen._forward(ids[i:i + gen.n_batch], all_logits=True)
    finally:
        gen.reset()  # the cache now holds this text, not a conversation: nothing to reuse
        for name, v in zip(("output_linear", "use_cpp_decode"), saved):
            if v is None:
                model.__dict__.pop(name, None)
            else:
                setattr(model, name, v)
    return torch.cat(captured)


def embed(llm, texts: str | list[str], normalize: bool = True, pooling: str | None = None):
    """One vector (list of floats, length n_embd) per text; a single string gives a single vector."""
    single = isinstance(texts, str)
    if not single and not isinstance(texts, (list, tuple)):  # list(5) would be a TypeError, list(b"hi") [104, 105]
        raise PyllmError(f"embed: give a string or a non-empty list of strings, got {type(texts).__name__}")
    vecs, _ = embed_counted(llm, [texts] if single else list(texts), normalize, pooling)
    return vecs[0] if single else vecs


def embed_counted(llm, items: list[str], normalize: bool = True, pooling: str | None = None, cancel=None):
    """(vectors, total tokens embedded). ``cancel``: a threading.Event that stops the work at the next text
    (PyllmError): one request may hold thousands of texts."""
    if not items or not all(isinstance(t, str) for t in items):
        raise PyllmError("embed: give a string or a non-empty list of strings")
    pooling = pooling or pooling_of(llm)
    if pooling not in ("mean", "cls", "last"):
        raise PyllmError(f"embed: pooling must be mean, cls or last, got {pooling!r}")
    out = []
    with llm._lock:
        llm._epoch += 1
        for text in items:
            if cancel is not None and cancel.is_set():
                raise PyllmError("embed: cancelled")
            least = llm.tokenizer.min_tokens(text)  # refused before a long text is tokenized
            if least > llm.n_ctx:
                raise PyllmError(f"embed: a text of at least {least} tokens exceeds the context of {llm.n_ctx}")
            ids = llm.tokenize(text) if text else []
            if not ids:
                raise PyllmError("embed: cannot embed an empty text")
            if len(ids) > llm.n_ctx:
                raise PyllmError(f"embed: a text of {len(ids)} tokens exceeds the context of {llm.n_ctx}")
            with torch.inference_mode():
                if getattr(llm, "is_encoder", False):
                    h = llm.model.hidden_states(torch.tensor(ids, dtype=torch.int64))
                else:
                    h = _hidden_states(llm, ids)
            v = h.mean(0) if pooling == "mean" else h[0] if pooling == "cls" else h[-1]
            if normalize:
                v = torch.nn.functional.normalize(v, dim=0)
            out.append((v.tolist(), len(ids)))
    return [v for v, _ in out], sum(n for _, n in out)


def _encode(v: list[float], encoding_format: str | None):
    """base64 is OpenAI's packed form (the openai client asks for it): little-endian float32 bytes."""
    if encoding_format != "base64":
        return v
    import base64

    import numpy as np

    return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode()


def create_embedding(llm, input, model: str | None = None, encoding_format: str | None = None,
                     dimensions: int | None = None, cancel=None, **ignored) -> dict:
    """OpenAI ``/v1/embeddings`` response for ``input`` (a string or a list of strings); ``cancel`` as for
    embed_counted. ``dimensions``: None or the model's own width; a vector of any other length is refused, as
    OpenAI refuses it for models that cannot shorten theirs (cutting a vector that was not trained to be cut
    would not keep its meaning), instead of answering with vectors of a length the client did not ask for.  A
    Matryoshka encoder (nomic-bert) takes 1..width: its vectors' first ``dimensions`` values, normalised again."""
    refuse_unknown(create_embedding, ignored)
    if encoding_format not in (None, "float", "base64"):
        raise BadRequest(f"encoding_format must be \"float\" or \"base64\", got {encoding_format!r}",
                         "encoding_format")
    width = llm.config.n_embd
    shorten = dimensions is not None and dimensions != width
    if dimensions is not None:
        check_number("dimensions", dimensions, 1, integer=True)
        matryoshka = getattr(llm, "is_encoder", False) and llm.model.spec.matryoshka
        if dimensions != width and not (matryoshka and dimensions < width):
            raise BadRequest(f"dimensions={dimensions}: this model's embeddings have {width} dimensions "
                             + ("and cannot be lengthened" if matryoshka else "and cannot be shortened"),
                             "dimensions")
    if isinstance(input, str):
        input = [input]
    if not isinstance(input, list) or not input or not all(isinstance(t, str) for t in input):
        raise PyllmError("input must be a string or a non-empty list of strings")
    vecs, n = embed_counted(llm, input, cancel=cancel)
    if shorten:
        vecs = [torch.nn.functional.normalize(torch.tensor(v[:dimensions]), dim=0).tolist() for v in vecs]
    return {"object": "list", "model": model or llm.path.name,
            "data": [{"object": "embedding", "index": i, "embedding": _encode(v, encoding_format)}
                     for i, v in enumerate(vecs)],
            "usage": {"prompt_tokens": n, "total_tokens": n}}
