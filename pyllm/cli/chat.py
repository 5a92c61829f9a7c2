"""`pyllm chat`: a streaming chat loop. On a TTY a prompt_toolkit prompt; piped, one reply to standard input."""

from __future__ import annotations

import sys

from ..errors import PyllmError


def _stream_reply(llm, messages, a, out) -> str:
    from .main import sampling_kwargs

    parts = []
    try:
        for piece in llm.chat(messages, max_tokens=a.max_tokens, stream=True, **sampling_kwargs(a)):
            parts.append(piece)
            out.write(piece)
            out.flush()
    except KeyboardInterrupt:
        out.write(" [interrupted]")
    out.write("\n")
    out.flush()
    return "".join(parts)


def run_chat(a) -> int:
    from .main import load_from_args

    llm = load_from_args(a)
    messages = [{"role": "system", "content": a.system}] if a.system else []
    if not sys.stdin.isatty():
        text = sys.stdin.read()
        inputs = [ln for ln in text.splitlines() if ln.strip()] if a.lines else [text]
        for msg in inputs:
            messages.append({"role": "user", "content": msg})
            reply = _stream_reply(llm, messages, a, sys.stdout)
            messages.append({"role": "assistant", "content": reply})
        return 0

    from prompt_toolkit import PromptSession

    session = PromptSession()
    print(f"pyllm chat: {llm.path.name} ({llm.config.arch}). Ctrl-D or /bye to quit, /reset for a new chat.",
          file=sys.stderr)
    while True:
        try:
            text = session.prompt(">>> ")
        except KeyboardInterrupt:
            continue
        except EOFError:
            return 0
        if not text.strip():
            continue
        if text.strip() in ("/bye", "/exit", "/quit"):
            return 0
        if text.strip() == "/reset":
            messages = messages[:1] if a.system else []
            print("(new conversation)", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": text})
        try:
            reply = _stream_reply(llm, messages, a, sys.stdout)
        except PyllmError as e:
            messages.pop()
            print(f"pyllm: error: {e}", file=sys.stderr)
            continue
        messages.append({"role": "assistant", "content": reply})
        if not a.quiet:
            st = llm.stats
            print(f"\x1b[2m[{st.prompt_tokens} prompt tokens, ttft {st.ttft:.2f}s, {st.generated_tokens} tokens, "
                  f"{st.decode_tps:.1f} t/s]\x1b[0m", file=sys.stderr)
