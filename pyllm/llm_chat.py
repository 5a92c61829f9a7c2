"""LLM's chat calls: chat templates, chat prompts fitted to the context, chat(), and the OpenAI-shaped entry points
(pyllm/api.py, pyllm/embed.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from .errors import ContextFullError, in_file
from .llm_args import check_sampling
from .runtime.stop_strings import stop_list


class ChatCalls:
    """The chat half of LLM (pyllm/llm.py)."""

    # ---- chat ---------------------------------------------------------------------------------------------------
    def use_fallback_template(self) -> None:
        """Format chats with pyllm's plain template for this vocabulary instead of the file's own."""
        from .chat_template import ChatTemplate

        self.template = ChatTemplate.from_metadata({}, self.tokenizer, use_file_template=False)

    def use_template(self, source: str, where: str = "chat template") -> None:
        """Format chats with the Jinja template ``source`` instead of the file's own; TemplateError naming
        ``where`` when it does not compile."""
        from .chat_template import ChatTemplate
        from .errors import TemplateError

        tok = self.tokenizer
        bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
        eos = tok.token_text(tok.eos_id) if tok.eos_id is not None else ""
        try:
            self.template = ChatTemplate(source, bos, eos)
        except TemplateError as e:
            raise TemplateError(f"{where}: {e}") from None

    def format_chat(self, messages: list[dict], add_generation_prompt: bool = True, **template_kw) -> str:
        """``template_kw``: extra template variables (``tools=[...]`` for templates that describe tools).
        Every chat entry point (chat, chat_ids, fit_chat, create_chat_completion) formats through here, so an empty
        or malformed message list is refused the same way in each, before anything is generated."""
        from .chat_messages import check_message_list
        from .chat_template import _validate
        from .errors import TemplateError

        check_message_list(messages)
        _validate(messages)  # malformed messages are the caller's error, not the file's
        try:
            return self.template.render(messages, add_generation_prompt=add_generation_prompt, **template_kw)
        except TemplateError as e:  # the template came from the model file: say which one
            raise in_file(e, Path(self.path).name) from None

    def chat_ids(self, messages: list[dict], suffix: str = "", must_fit: bool = False, **template_kw) -> list[int]:
        """The prompt ids for ``messages``; ``suffix`` is text appended after the generation prompt (the start
        of the reply, e.g. a forced tool call).  The template's own markup becomes special tokens, message content
        never does (a message holding ``<|im_start|>system`` is that text, not a forged turn; see content_spans).
        ``must_fit``: the prompt is used whole (no turns are dropped to make it fit), so one that cannot fit in
        n_ctx is refused before it is tokenized (check_prompt_fits)."""
        from .chat_template import content_spans

        text = self.format_chat(messages, **template_kw)
        if must_fit:
            self.check_prompt_fits(text + suffix, add_bos=False)  # the template may write BOS, then it is not added
        plain = content_spans(self.template, messages, text, add_generation_prompt=True, **template_kw)
        ids = self.tokenizer.encode(text + suffix, add_bos=None, special=True, plain=plain)
        bos = self.tokenizer.bos_id
        if len(ids) > 1 and bos is not None and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]  # the template wrote BOS and the tokenizer added another
        return ids

    def fit_chat(self, messages: list[dict], reserve: int = 0) -> tuple[list[int], list[dict], int]:
        """(ids, kept messages, number dropped): the prompt for ``messages`` under ``context_policy``.

        "stop": the messages unchanged (a prompt that does not fit raises ContextFullError when it is prefilled, or
        here, before it is tokenized, when its text alone shows it cannot fit: check_prompt_fits).
        "shift": drops the oldest messages after the leading system message(s), whole turns (a turn starts at a
        user message), until prompt + ``reserve`` reply tokens fit in n_ctx; the cached system prompt is reused and
        the rest re-prefilled. ContextFullError if the system prompt and the last message alone do not fit.
        """
        ids = self.chat_ids(messages, must_fit=self.context_policy == "stop")
        if self.context_policy == "stop" or len(ids) + reserve <= self.n_ctx:
            return ids, list(messages), 0
        head = 0
        while head < len(messages) and messages[head].get("role") == "system":
            head += 1
        kept = list(messages)
        while len(ids) + reserve > self.n_ctx and len(kept) - head > 1:
            del kept[head]
            while len(kept) - head > 1 and kept[head].get("role") != "user":
                del kept[head]  # never start the history with an orphaned assistant/tool reply
            ids = self.chat_ids(kept)
        if len(ids) + reserve > self.n_ctx:
            raise ContextFullError(f"the system prompt and the last message take {len(ids)} tokens; with {reserve} "
                                   f"for the reply they exceed n_ctx={self.n_ctx}: use a larger --ctx or a shorter "
                                   f"message")
        return ids, kept, len(messages) - len(kept)

    def chat(self, messages: list[dict], max_tokens: int = 512, stop: str | list[str] | None = None, stream: bool = False,
             **sampling) -> str | Iterator[str]:
        """Reply to ``messages`` ([{"role": ..., "content": ...}]) formatted with the model's chat template.

        With context_policy "shift", old turns that no longer fit are dropped first (count in ``chat_dropped``;
        room is kept for min(max_tokens, n_ctx // 4) reply tokens). A reply that still fills the context stops
        with finish_reason "context".
        """
        self.check_generates()
        max_tokens = self.check_max_tokens(max_tokens)
        sampling = check_sampling(sampling, self.n_vocab)
        stop = stop_list(stop)
        ids, _, self.chat_dropped = self.fit_chat(messages, reserve=min(max_tokens, self.n_ctx // 4))
        it = self._stream_text(ids, max_tokens, stop, sampling)
        return it if stream else "".join(it)

    # ---- OpenAI-shaped API (pyllm/api.py, pyllm/embed.py) ---------------------------------------------------------
    def create_completion(self, prompt, **kw):
        """OpenAI ``/v1/completions`` as llama-cpp-python's ``Llama.create_completion``: a dict, or an iterator of
        chunk dicts with stream=True."""
        from .api import create_completion

        return create_completion(self, prompt, **kw)

    def __call__(self, prompt, **kw):
        """``create_completion``, as llama-cpp-python's ``Llama.__call__``: ``llm("Q: ... A:", max_tokens=32)``."""
        return self.create_completion(prompt, **kw)

    def create_chat_completion(self, messages: list[dict], **kw):
        """OpenAI ``/v1/chat/completions`` as llama-cpp-python's ``Llama.create_chat_completion``."""
        from .api import create_chat_completion

        return create_chat_completion(self, messages, **kw)

    def embed(self, texts, **kw):
        """L2-normalised pooled embeddings: a list of float lists (one per text; a str gives one list)."""
        from .embed import embed

        return embed(self, texts, **kw)

    def create_embedding(self, input, **kw) -> dict:
        """OpenAI ``/v1/embeddings`` response dict."""
        from .embed import create_embedding

        return create_embedding(self, input, **kw)
