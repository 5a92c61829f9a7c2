"""`pyllm chat`: a streaming chat REPL on a terminal; one reply per message when piped.

The conversation logic (``ChatSession``) is separate from the terminal (``run_repl``) so that it can be driven
by piped input, by tests with a fake model, and by prompt_toolkit alike. This module imports only the standard
library and light pyllm modules (errors, registry, cli/common) at the top: ``pyllm --help`` imports it for the
epilog and must stay fast.
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable, TextIO

from ..errors import ContextFullError, PyllmError, shorten
from ..conversation import (MAX_CONVERSATION_BYTES, dump_conversation, load_conversation_json,
                            parse_conversation)
from ..safe_io import kind_of, open_regular, read_regular
from .common import (Settings, SettingError, canonical_setting, check_numeric_args, load_from_args,
                     read_stdin_lines, read_stdin_text, runtime_label)

HELP_EPILOG = """keys (on a terminal):
  Enter sends; Alt-Enter or Esc then Enter inserts a newline; a line starting with \"\"\" opens a block that
  ends at a line ending with \"\"\"; Ctrl-C stops a reply (the partial reply is kept) or clears the line;
  Ctrl-D or /bye quits; /help lists the commands. History is kept in $XDG_DATA_HOME/pyllm/chat_history.

piped (not a terminal): standard input is one message (or one per line with --lines); only replies are written.

examples:
  pyllm chat                                  the default model, fetched on first use
  pyllm chat model.gguf --system "Be brief." --temp 0.2
  echo "Write a haiku about rain" | pyllm chat smollm2-135m --temp 0
"""


RULES_EXAMPLE = {"temp": 0.7, "temperature": 0.7, "top_p": 0.9, "min_p": 0.05, "seed": 42, "max_tokens": 256,
                 "stop": '"User:"', "num_ctx": 8192}
CONTEXT_SETTINGS = ("num_ctx", "ctx", "n_ctx")  # Ollama's name and pyllm's: the context length, a reload


# ---- commands ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Command:
    name: str  # canonical name, or "unknown"
    arg: str  # the rest of the line (for "unknown": the word that was typed)


COMMANDS: dict[str, tuple[tuple[str, ...], str, str]] = {
    "help": (("help", "?", "h"), "/help", "this list"),
    "bye": (("bye", "exit", "quit", "q"), "/bye", "quit (or Ctrl-D)"),
    "reset": (("reset", "clear", "new"), "/reset", "start a new conversation (the system prompt stays)"),
    "system": (("system", "sys"), "/system [TEXT]", "set the system prompt (no TEXT: show it; '/system -' clears it)"),
    "set": (("set",), "/set NAME VALUE", "NAME: temp top_k top_p min_p seed max_tokens repeat_penalty stop "
                                         "num_ctx (Ollama's names too: /set parameter num_predict 64); /set alone "
                                         "shows them"),
    "show": (("show", "info"), "/show [WHAT]", "model, settings, context used, KV cache; WHAT: info (the same), "
                                               "parameters, system, template"),
    "save": (("save",), "/save FILE", "write the conversation as JSON"),
    "load": (("load",), "/load FILE", "replace the conversation with one saved by /save (or a JSON message list)"),
    "regen": (("regen", "retry", "redo"), "/regen", "throw away the last reply and generate it again"),
}
_BY_ALIAS = {alias: name for name, (aliases, _, _) in COMMANDS.items() for alias in aliases}


def parse_command(text: str) -> Command | None:
    """A slash command, or None for a message. '//text' is the message '/text'."""
    s = text.strip()
    if not s.startswith("/") or s.startswith("//"):
        return None
    words = s[1:].split(None, 1)
    head = words[0] if words else ""
    arg = words[1].strip() if len(words) > 1 else ""
    name = _BY_ALIAS.get(head.lower())
    return Command(name, arg) if name else Command("unknown", head)


def help_text() -> str:
    width = max(len(usage) for _, usage, _ in COMMANDS.values())
    lines = [f"  {usage:<{width}}  {desc}" for _, usage, desc in COMMANDS.values()]
    lines.append("  start a message with // to send a text beginning with /")
    lines += ["", *HELP_EPILOG.split("\n\n")[0].splitlines()]
    return "\n".join(lines)


# ---- conversation files --------------------------------------------------------------------------------------------

def saved_settings(data, current: Settings, source: str) -> Settings | None:
    """The settings a /save file holds (its "settings" object) applied over ``current``, each checked as /set checks
    it; None when the file has none (a plain message list). A name this version does not know is skipped: a newer
    pyllm may save more."""
    saved = data.get("settings") if isinstance(data, dict) else None
    if saved is None:
        return None
    if not isinstance(saved, dict):
        raise PyllmError(f"{source}: 'settings' must be an object, got {type(saved).__name__}")
    out = Settings(**{f.name: getattr(current, f.name) for f in fields(Settings)})
    names = {f.name for f in fields(Settings)}
    for name, value in saved.items():
        if name not in names:
            continue
        try:
            out.set(name, value)
        except SettingError as e:
            raise PyllmError(f"{source}: settings: {e}") from None
    return out


def _sanitize_for_terminal(text: str) -> str:
    """Model text can hold control characters (a byte-level token can be any byte): shown raw, ESC sequences
    would restyle the terminal and CR would overwrite the line being written."""
    return text.translate(_CONTROL)


_CONTROL = {c: "\ufffd" for c in [*range(0x00, 0x09), 0x0B, 0x0C, *range(0x0E, 0x20), 0x7F, *range(0x80, 0xA0)]}
_CONTROL[0x0D] = None


def _typed_path(arg: str, command: str) -> Path:
    """The file a /save or /load line names, ~ expanded. A NUL byte (pasted binary) and ~USER of a user with no
    home directory are PyllmErrors naming the command and the path: they were a ValueError or RuntimeError that
    named neither ("embedded null byte", "Could not determine home directory.")."""
    if "\x00" in arg:
        shown = shorten(arg.replace("\x00", "\\0"))
        raise PyllmError(f"{command} {shown}: a file name cannot hold a NUL byte; the conversation is unchanged")
    try:
        return Path(arg).expanduser()
    except RuntimeError:  # ~name of an unknown user
        raise PyllmError(f"{command} {shorten(arg)}: no home directory for {shorten(arg.split('/')[0])}; the "
                         f"conversation is unchanged") from None


# ---- the conversation ----------------------------------------------------------------------------------------------

class ChatSession:
    """One conversation with one model: turns, settings, slash commands, context fitting and streaming.

    ``out`` receives reply text only; ``ui`` receives everything else (status lines, notes, command output).
    Turns are committed only once a reply is complete or interrupted, so an exception at any point leaves the
    conversation as it was before the message.
    """

    def __init__(self, llm, settings: Settings, system: str | None = None, out: TextIO = sys.stdout,
                 ui: TextIO = sys.stderr, color: bool = False, quiet: bool = False, terminal: bool = False,
                 piped: bool = False):
        self.llm = llm
        self.settings = settings
        self.system = system or None
        self.turns: list[dict] = []
        self.out, self.ui = out, ui
        self.color, self.quiet, self.terminal = color, quiet, terminal
        # messages come from piped standard input, not typed: ways out name flags, not slash commands
        self.piped = piped
        self.interrupted = False  # whether the last reply was stopped by Ctrl-C
        # n_ctx -> the same model loaded with that context (/set num_ctx); None: the context cannot change here
        self.reload: Callable[[int], object] | None = None
        self._prompt_start = 0  # index in turns of the first message the last prompt held (see fit)
        self._regens = 0  # consecutive /regen of the same message: a fixed seed would replay the same reply

    # ---- output ----
    def _style(self, code: str, text: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.color else text

    def note(self, text: str) -> None:
        self.ui.write(self._style("2", text) + "\n")
        self.ui.flush()

    def error(self, text: str) -> None:
        self.ui.write(self._style("31", f"error: {text}") + "\n")
        self.ui.flush()

    def say(self, text: str) -> None:
        self.ui.write(text + "\n")
        self.ui.flush()

    def messages(self, turns: list[dict] | None = None) -> list[dict]:
        sys_msg = [{"role": "system", "content": self.system}] if self.system else []
        return sys_msg + list(self.turns if turns is None else turns)

    # ---- context ----
    def fit(self, turns: list[dict]) -> tuple[list[int], list[dict], int]:
        """Prompt ids for ``turns`` (the last one is the new user message), leaving the oldest turns after the
        system prompt out of the prompt when the conversation and room for a reply no longer fit (the conversation
        itself keeps them). Returns (ids, turns in the prompt, number of messages left out). Nothing is changed
        when even the newest message alone does not fit."""
        n_ctx = self.llm.n_ctx
        reserve = self._reserve()
        stop = getattr(self.llm, "context_policy", "shift") == "stop"
        # What must fit whatever is dropped: the whole conversation ("stop"), or the system prompt and the new
        # message. When its text alone shows it cannot (a pasted megabyte), it is refused here, as the library and
        # the server refuse such a prompt (check_prompt_fits), instead of after seconds of tokenizing it.
        least = self.messages(turns if stop else turns[-1:])
        try:
            self.llm.check_prompt_fits(self.llm.format_chat(least), add_bos=False)  # the template may write BOS
        except ContextFullError as e:
            self.check_system_fits(self.system)  # if the system prompt is what cannot fit, say so
            # the library's "the prompt has at least N tokens" does not say which part is too long, nor that the
            # conversation survives it
            kept = "; the conversation is unchanged" if self.turns else ""
            alone = e
            if stop and len(turns) > 1:
                try:
                    self.llm.check_prompt_fits(self.llm.format_chat(self.messages(turns[-1:])), add_bos=False)
                except ContextFullError as e2:
                    alone = e2
                else:  # the message alone would fit: it is the conversation before it that takes the room
                    clear = "" if self.piped else "/clear to start over, or "
                    raise ContextFullError(f"the conversation with this message is too long for --ctx {n_ctx}: "
                                           f"{clear}restart with a larger --ctx or --context-policy shift (drops "
                                           f"the oldest turns){kept}") from None
            least = getattr(alone, "least_tokens", None)
            what = "with the system prompt " if self.system else ""
            has = f" it has at least {least} tokens {what}and the context holds {n_ctx};" if least else ""
            raise ContextFullError(f"the message is too long for --ctx {n_ctx}:{has} shorten it or restart with a "
                                   f"larger --ctx{kept}") from None
        # The prompt starts at a user message. The start of the last prompt is tried first: while the messages
        # after it fit, the prompt only grows at its end and the cached prefix is reused.
        start = self._prompt_start
        if stop or not (0 < start < len(turns) - 1 and turns[start]["role"] == "user"):
            start = 0
        ids = self.llm.chat_ids(self.messages(turns[start:]))
        if len(ids) + reserve <= n_ctx:
            return ids, turns[start:], start
        # /clear and dropping turns keep the system prompt: when it alone leaves no room, neither can help
        self.check_system_fits(self.system)
        if stop:
            alone = ids if len(turns) == 1 else self.llm.chat_ids(self.messages(turns[-1:]))
            if len(alone) + reserve > n_ctx:  # /clear would leave this much: it cannot help
                what = "the message and the system prompt take" if self.system else "the message takes"
                raise ContextFullError(f"{what} {len(alone)} tokens and the reply needs room for {reserve} in a "
                                       f"context of {n_ctx}: shorten it or restart with a larger --ctx")
            clear = "" if self.piped else "/clear to start over, or "
            raise ContextFullError(f"the conversation takes {len(ids)} tokens and the reply needs room for {reserve} "
                                   f"in a context of {n_ctx}: {clear}restart with a larger --ctx "
                                   f"or --context-policy shift (drops the oldest turns)")
        # Leaving turns out re-prefills the prompt, so trim to 3/4 of the context rather than to just fit:
        # otherwise every following message would leave out one more turn and pay that prefill again. The
        # token count falls as the start moves later, so the earliest start that fits is found by bisection:
        # O(log n) renders, not one per message of a long conversation.
        goal = n_ctx * 3 // 4
        starts = [i for i in range(start + 1, len(turns) - 1) if turns[i]["role"] == "user"] + [len(turns) - 1]
        lo, hi = 0, len(starts) - 1  # starts[hi] is the new message alone: the last resort
        best = None
        while lo <= hi:
            mid = (lo + hi) // 2
            cand = self.llm.chat_ids(self.messages(turns[starts[mid]:]))
            if len(cand) + reserve <= goal:
                best, hi = (mid, cand), mid - 1
            else:
                lo = mid + 1
        k, ids = best if best is not None else (len(starts) - 1, self.llm.chat_ids(self.messages(turns[-1:])))
        if len(ids) >= n_ctx:
            what = "the message and the system prompt take" if self.system else "the message takes"
            raise ContextFullError(f"{what} {len(ids)} tokens but the context holds {n_ctx}; "
                                   f"shorten it or use a larger --ctx")
        return ids, turns[starts[k]:], starts[k]

    def _reserve(self) -> int:
        # room for at least part of a reply; max_tokens -1 (until the context is full) as the largest
        n, quarter = self.settings.max_tokens, self.llm.n_ctx // 4
        return quarter if n < 0 else min(n, quarter)

    def check_system_fits(self, system: str | None, unchanged: str = "") -> None:
        """ContextFullError when ``system`` with the shortest message leaves no room for a reply in the context:
        every prompt starts with it, so no /clear or dropped turn can make a message fit; only a larger --ctx or
        a shorter system prompt can. ``unchanged`` ends the message (what was kept as it was)."""
        if not system:
            return
        n_ctx, reserve = self.llm.n_ctx, self._reserve()
        least = [{"role": "system", "content": system}, {"role": "user", "content": ""}]
        try:
            self.llm.check_prompt_fits(self.llm.format_chat(least), add_bos=False)
            n = len(self.llm.chat_ids(least))
        except ContextFullError:  # its text alone shows it cannot fit: not worth tokenizing
            n = None
        if n is not None and n + reserve < n_ctx:
            return
        takes = "more tokens than the context holds" if n is None else f"{n} tokens"
        how = "--system TEXT, or none" if self.piped else "/system TEXT, or /system - for none"
        raise ContextFullError(f"the system prompt is too long for --ctx {n_ctx}: it takes {takes}, leaving no "
                               f"room for a message and a reply of {reserve}; restart with a larger --ctx, or give "
                               f"a shorter system prompt ({how}){unchanged}")

    # ---- replies ----
    def exchange(self, user_text: str, base: list[dict] | None = None, seed_offset: int = 0) -> str | None:
        """Sends one user message after ``base`` (default: the whole conversation) and commits it with its
        reply. Returns the reply, or None when nothing was generated (interrupted during the prompt)."""
        base = self.turns if base is None else base
        user = {"role": "user", "content": user_text}
        ids, kept, left_out = self.fit([*base, user])
        if left_out > self._prompt_start:
            self.note(f"(the conversation no longer fits the context of {self.llm.n_ctx} tokens: the prompt leaves "
                      f"out the {left_out} oldest message{'s' * (left_out > 1)}; the conversation and /save keep "
                      f"them)")
        reply, interrupted = self._stream(ids, seed_offset)
        self.interrupted = interrupted
        if interrupted and not reply:
            self.note("[interrupted before the reply started; the message was not kept]")
            return None
        # every message stays in the conversation (and in what /save writes); only the prompt was shortened
        self.turns = [*base, user, {"role": "assistant", "content": reply}]
        self._prompt_start = left_out
        if not self.quiet:
            self.status(interrupted)
        elif interrupted:
            self.note("[interrupted]")
        return reply

    def _stream(self, ids: list[int], seed_offset: int) -> tuple[str, bool]:
        s = self.settings
        parts: list[str] = []
        interrupted = False
        it = self.llm.generate(ids, max_tokens=s.max_tokens, stream=True, stop=list(s.stop) or None,
                               **s.sampling(seed_offset))
        try:
            for piece in it:
                parts.append(piece)
                self.out.write(_sanitize_for_terminal(piece) if self.terminal else piece)
                self.out.flush()
        except KeyboardInterrupt:
            # the generator extends its token list only after a forward pass completes, so stopping here
            # leaves the KV cache matching the tokens it lists; the next message reuses it
            interrupted = True
        finally:
            it.close()
            if parts:  # also before an error message, which must not continue the reply's line
                self.out.write("\n")
                self.out.flush()
        return "".join(parts), interrupted

    def status(self, interrupted: bool = False) -> None:
        st = self.llm.stats
        cached = st.prompt_tokens - st.prompt_evaluated
        parts = [f"{st.prompt_tokens} prompt tokens" + (f" ({cached} cached)" if cached > 0 else ""),
                 f"ttft {st.ttft:.2f}s", f"{st.generated_tokens} tokens", f"{st.decode_tps:.1f} tok/s"]
        if st.spec is not None and st.spec.drafted:  # speculation ran: how much of what it drafted was kept
            parts.append(f"{st.spec.acceptance:.0%} of {st.spec.drafted} drafted accepted")
        if interrupted:
            parts.append("interrupted")
        elif st.finish_reason == "length":
            parts.append("cut at max_tokens: /set max_tokens N for longer replies")
        elif st.finish_reason == "context":
            parts.append("context full")
        self.note("[" + (" · " if self.terminal else ", ").join(parts) + "]")

    # ---- commands ----
    def handle(self, text: str) -> bool:
        """One line of input: a command or a message. Returns False when the user asked to quit."""
        cmd = parse_command(text)
        if cmd is None:
            msg = text.strip()
            if msg.startswith("//"):
                msg = msg[1:]
            if msg:
                self._regens = 0
                self._guarded(lambda: self.exchange(msg))
            return True
        if cmd.name != "unknown" and cmd.arg and " " not in COMMANDS[cmd.name][1]:
            # a command that takes no argument, given one: a mistyped line must not quit or wipe the conversation
            typed = text.strip().split(None, 1)[0]
            self.error(f"{typed} takes no argument (got {shorten(cmd.arg, 40)!r}); nothing was done")
            return True
        if cmd.name == "bye":
            return False
        handler = getattr(self, f"cmd_{cmd.name}")
        self._guarded(lambda: handler(cmd.arg))
        return True

    def _guarded(self, fn) -> None:
        """Runs one command or message; any error is one line and the conversation goes on (Ctrl-C and exits
        still propagate)."""
        try:
            fn()
        except PyllmError as e:
            self.error(str(e))
        except (Exception, RecursionError, MemoryError) as e:  # a bug must not end the session and lose the chat
            first = (str(e).splitlines() or [""])[0][:300]
            self.error(f"{type(e).__name__}: {first} (the conversation is unchanged)")

    def cmd_unknown(self, word: str) -> None:
        raise PyllmError(f"unknown command /{shorten(word)}; /help lists the commands (start with // to send a "
                         f"'/' text)")

    def cmd_help(self, arg: str) -> None:
        self.say(help_text())

    def cmd_reset(self, arg: str) -> None:
        self.turns = []
        self._regens = self._prompt_start = 0
        self.llm.reset()
        self.note("(new conversation" + (", same system prompt)" if self.system else ")"))

    def cmd_system(self, arg: str) -> None:
        if not arg:
            self.say(f"system prompt: {self.system!r}" if self.system else "no system prompt")
            return
        new = None if arg == "-" else arg
        self.check_system_fits(new, unchanged="; the system prompt is unchanged")
        self.system = new
        self.llm.reset()  # the cached prefix starts with the old system prompt
        self.note("(system prompt cleared)" if self.system is None else "(system prompt set)")

    def cmd_set(self, arg: str) -> None:
        name, _, value = arg.partition(" ")
        if name.lower() == "parameter":  # Ollama's `/set parameter NAME VALUE`
            name, _, value = value.strip().partition(" ")
        if not name:
            self.say(self.settings.describe() + f", num_ctx {self.llm.n_ctx}")
            return
        if name.lower() in ("system", "verbose", "quiet"):  # Ollama's other /set words
            if name.lower() == "system":
                return self.cmd_system(value.strip())
            self.quiet = name.lower() == "quiet"
            return self.note(f"({'no ' if self.quiet else ''}status line after replies)")
        if name.lower().replace("-", "_") in CONTEXT_SETTINGS:
            return self.set_context(name, value.strip())
        try:
            if not value.strip():
                canonical_setting(name)  # an unknown name is the more useful message
                raise SettingError(f"/set {name} needs a value, e.g. /set {name} {RULES_EXAMPLE.get(name, 1)}")
            key = self.settings.set(name, value)
        except SettingError as e:
            raise PyllmError(str(e)) from None
        self.note(f"({key} = {getattr(self.settings, key)})")

    def set_context(self, name: str, value: str) -> None:
        """/set num_ctx N: the model again with a context of N tokens (0: the model's own); the conversation is
        kept, and refitted into the new context at the next message."""
        from .common import NUMERIC_FLAGS

        _, lo, hi = NUMERIC_FLAGS["ctx"]
        try:
            n = int(value)
        except ValueError:
            n = None
        if n is None or not lo <= n <= hi:
            raise PyllmError(f"{name} must be an integer in [{lo}, {hi}] (0 = the model's own), got "
                             f"{shorten(value) or 'nothing'!r}, e.g. /set {name} {RULES_EXAMPLE['num_ctx']}")
        if self.reload is None:
            raise PyllmError(f"the context cannot change in this chat; restart it with --ctx {n}")
        new = self.reload(n)  # loaded before the old model goes: a failure leaves the session as it was
        old, self.llm = self.llm, new
        old.close()
        self.note(f"(num_ctx = {new.n_ctx}; the conversation is kept and read again at the next message)")

    def cmd_show(self, arg: str) -> None:
        what = arg.strip().lower()
        if what == "parameters":
            return self.say(self.settings.describe() + f", num_ctx {self.llm.n_ctx}")
        if what == "system":
            return self.cmd_system("")
        if what == "template":
            return self.say(self.llm.template.source)
        if what not in ("", "info"):
            raise PyllmError(f"/show {shorten(arg, 40)}: one of info, parameters, system, template")
        llm = self.llm
        cfg = llm.config
        used = len(llm.generator.tokens)
        weights = sum(getattr(w, "nbytes", 0) for w in getattr(llm, "weights", {}).values())
        lines = [
            f"model      {llm.path.name} ({cfg.arch}, {cfg.n_layer} layers, vocab {cfg.n_vocab})",
            f"runtime    {runtime_label(llm)}, {llm.n_threads} threads"
            + (f", weights {weights / 2**20:.1f} MiB" if weights else ""),
            f"context    {used} / {llm.n_ctx} tokens used ({len(self.turns)} messages)",
            f"KV cache   {llm.kv.kind}, {llm.kv.nbytes / 2**20:.1f} MiB",
            f"settings   {self.settings.describe()}",
            f"system     {self._system_preview()}" if self.system else "system     (none)",
        ]
        self.say("\n".join(lines))

    def _system_preview(self, n: int = 200) -> str:
        """The system prompt for /show: a long one (a pasted document) would push the rest off the screen, and
        /system shows it whole."""
        cut = shorten(self.system, n)
        return repr(cut) if cut == self.system else f"{cut!r} ({len(self.system)} characters; /system shows it all)"

    def cmd_save(self, arg: str) -> None:
        if not arg:
            raise PyllmError("/save needs a file name, e.g. /save chat.json")
        path = _typed_path(arg, "/save")
        try:
            st = os.stat(path)
        except OSError:
            st = None
        if st is not None and not stat.S_ISREG(st.st_mode):
            # the save renames a new file over the name: a device or FIFO there would itself be replaced
            raise PyllmError(f"/save {shorten(path)}: is {kind_of(st.st_mode)}, not a regular file; the "
                             f"conversation was not saved")
        data = {"format": "pyllm-chat", "version": 1, "model": self.llm.path.name,
                "settings": {f.name: getattr(self.settings, f.name) for f in fields(Settings)},
                "messages": self.messages()}
        text = dump_conversation(data)
        tmp = None
        try:
            # write-then-rename: an interrupted save never truncates a conversation saved earlier, and the
            # temporary file is removed on any failure (a full disk, Ctrl-C)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent if str(path.parent) else ".")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, path)
            tmp = None
        except OSError as e:
            raise PyllmError(f"cannot write {shorten(path)}: {e.strerror or e}") from None
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        self.note(f"(saved {len(self.messages())} messages to {path})")  # /load counts the same: all of them

    def cmd_load(self, arg: str) -> None:
        if not arg:
            raise PyllmError("/load needs a file name, e.g. /load chat.json")
        path = _typed_path(arg, "/load")
        try:
            # /load /dev/zero must not read forever, nor /load of a FIFO block the REPL
            raw = read_regular(path, MAX_CONVERSATION_BYTES, shown=shorten(path))
        except PyllmError as e:
            raise PyllmError(f"/load {e}; the conversation is unchanged") from None
        try:
            data = load_conversation_json(raw)
        except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
            raise PyllmError(f"{shorten(path)} is not a JSON conversation ({e}); the conversation is unchanged") \
                from None
        try:
            system, turns = parse_conversation(data, shorten(path))
            settings = saved_settings(data, self.settings, shorten(path))
        except PyllmError as e:
            raise PyllmError(f"{e}; the conversation is unchanged") from None
        self.turns = turns
        if settings is not None:
            self.settings = settings
        if system is not None:
            self.system = system
        self._regens = self._prompt_start = 0
        self.llm.reset()
        n = len(turns) + (system is not None)
        self.note(f"(loaded {n} messages from {path}" + (", with its system prompt" if system is not None else "")
                  + (", and its settings)" if settings is not None else ")"))
        last = next((m for m in reversed(turns) if m["role"] == "assistant"), None)
        if last is not None:
            self.note("last reply: " + shorten(last["content"], 200))

    def cmd_regen(self, arg: str) -> None:
        if len(self.turns) < 2 or self.turns[-1]["role"] != "assistant" or self.turns[-2]["role"] != "user":
            raise PyllmError("/regen: no reply to regenerate yet")
        self._regens += 1
        if self.settings.temperature == 0:
            self.note("(temp is 0: the reply will be the same; /set temp 0.8 for a different one)")
        self.exchange(self.turns[-2]["content"], base=self.turns[:-2], seed_offset=self._regens)


# ---- terminal and pipes --------------------------------------------------------------------------------------------

def history_path() -> Path:
    base = os.environ.get("XDG_DATA_HOME", "")
    root = Path(base) if os.path.isabs(base) else Path.home() / ".local" / "share"  # the XDG spec ignores relative
    return root / "pyllm" / "chat_history"


MAX_HISTORY_BYTES = 4 << 20  # the newest entries; the file itself may have grown larger over the years


def open_history(path: Path):
    """prompt_toolkit's FileHistory over ``path``, reading at most its last MAX_HISTORY_BYTES at start; None when
    the file cannot serve (not a regular file: a FIFO would block the REPL's start, a device fills nothing; or not
    writable: FileHistory appends on every Enter, and that must fail here, once)."""
    from prompt_toolkit.history import FileHistory

    class BoundedFileHistory(FileHistory):
        def load_history_strings(self):
            try:
                with open_regular(self.filename) as f:
                    size = os.fstat(f.fileno()).st_size
                    f.seek(max(0, size - MAX_HISTORY_BYTES))
                    data = f.read(MAX_HISTORY_BYTES)
            except PyllmError:
                return []
            if size > MAX_HISTORY_BYTES:  # cut inside an entry: start at the next one (a "# date" line)
                at = data.find(b"\n#")
                data = data[at + 1:] if at >= 0 else b""
            strings, lines = [], []
            for line in data.decode("utf-8", "replace").splitlines(keepends=True):
                if line.startswith("+"):
                    lines.append(line[1:])
                else:
                    if lines:
                        strings.append("".join(lines)[:-1])
                    lines = []
            if lines:
                strings.append("".join(lines)[:-1])
            return list(reversed(strings))

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        st = os.stat(path) if os.path.lexists(path) else None
        if st is not None and not stat.S_ISREG(st.st_mode):
            return None
        os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o600))
    except OSError:
        return None
    return BoundedFileHistory(str(path))


def use_color(a, stream: TextIO) -> bool:
    return (stream.isatty() and not getattr(a, "no_color", False) and not os.environ.get("NO_COLOR")
            and os.environ.get("TERM") != "dumb")


def _prompt_sessions(color: bool):
    from prompt_toolkit import PromptSession
    from prompt_toolkit.formatted_text import ANSI
    from prompt_toolkit.history import InMemoryHistory
    from prompt_toolkit.key_binding import KeyBindings
    from prompt_toolkit.output import ColorDepth

    kb = KeyBindings()

    @kb.add("escape", "enter")
    def _newline(event):
        event.current_buffer.insert_text("\n")

    @kb.add("c-c")
    def _clear(event):
        buf = event.current_buffer
        if buf.text:
            buf.reset()
        else:  # an empty line: let the loop say how to quit
            event.app.exit(exception=KeyboardInterrupt, style="class:aborting")

    history = open_history(history_path()) or InMemoryHistory()
    depth = None if color else ColorDepth.DEPTH_1_BIT
    mk = (lambda s: ANSI(f"\x1b[1;32m{s}\x1b[0m")) if color else (lambda s: s)
    main = PromptSession(mk(">>> "), history=history, key_bindings=kb, multiline=False,
                         prompt_continuation=mk("... "), color_depth=depth)
    block = PromptSession(mk("... "), history=InMemoryHistory(), key_bindings=kb, color_depth=depth)
    return main, block


def read_block(first: str, more: Callable[[], str]) -> str:
    """A \"\"\"-quoted message: ``first`` starts with \"\"\"; ``more`` reads the next line until one ends with \"\"\"."""
    body = first.strip()[3:]
    if body.endswith('"""') and body.strip():
        return body[:-3]
    lines = [body] if body else []
    while True:
        line = more()
        if line.rstrip().endswith('"""'):
            last = line.rstrip()[:-3]
            if last:
                lines.append(last)
            return "\n".join(lines)
        lines.append(line)


def run_repl(chat: ChatSession, banner: str) -> int:
    main, block = _prompt_sessions(chat.color)
    chat.note(banner)
    while True:
        at_prompt = True
        try:
            text = main.prompt()
            if text.strip().startswith('"""'):
                text = read_block(text, block.prompt)
                try:
                    main.history.append_string('"""' + text + '"""')
                except OSError:
                    pass
            at_prompt = False
            if not chat.handle(text):
                return 0
        except KeyboardInterrupt:
            # at the prompt: Ctrl-C on an empty line (a non-empty one is cleared in place). Elsewhere: outside
            # the reply stream (e.g. while the prompt is tokenized), where nothing has been committed yet
            chat.note("(Ctrl-D or /bye to quit)" if at_prompt else "[interrupted]")
        except EOFError:
            return 0


MAX_LINE_BYTES = 64 << 20  # as read_stdin_text's limit on a whole message: no context holds more


def run_piped(chat: ChatSession, a) -> int:
    if a.lines:
        said = failed = False
        for number, line in read_stdin_lines(MAX_LINE_BYTES):
            # a message that cannot be answered is reported with its line number and the conversation goes on
            # with the next line, as in the terminal REPL; the exit status says that one failed
            if line is None:
                failed = True
                chat.error(f"line {number} of standard input is longer than {MAX_LINE_BYTES} bytes; skipped")
            elif line.strip():
                said = True
                try:
                    chat.exchange(line.strip())
                except PyllmError as e:
                    failed = True
                    chat.error(f"line {number} of standard input: {e}")
                if chat.interrupted:
                    raise KeyboardInterrupt  # exit 130 like any interrupted command, after the partial reply
        if not said and not failed:
            raise PyllmError("nothing to say: standard input is empty")
        return 1 if failed else 0
    chat.exchange(a._stdin_text)
    if chat.interrupted:
        raise KeyboardInterrupt
    return 0


def _verbose_load(llm, ui: TextIO) -> None:
    import resource

    weights = sum(getattr(w, "nbytes", 0) for w in llm.weights.values())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux
    ui.write(f"loaded {llm.path.name} in {llm.load_seconds:.2f}s: {llm.config.arch}, weights "
             f"{weights / 2**20:.1f} MiB, KV cache {llm.kv.kind} {llm.kv.nbytes / 2**20:.1f} MiB "
             f"(n_ctx {llm.n_ctx}), on {runtime_label(llm)}, {llm.n_threads} threads, peak RSS {rss:.0f} MiB\n")
    ui.flush()


def run_chat(a) -> int:
    for stream in (sys.stdout, sys.stderr):
        # a byte-level token can decode to U+FFFD or a surrogate; never let one end the session
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="replace")
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="replace")
    try:
        check_numeric_args(a)
        settings = Settings.from_args(a)
    except SettingError as e:
        # a usage error like argparse's own (exit 2), reported before the model is loaded
        print(f"pyllm chat: error: {e}", file=sys.stderr)
        return 2

    terminal = sys.stdin.isatty() and sys.stdout.isatty()
    if not terminal and not a.lines:
        a._stdin_text = read_stdin_text().strip()  # read first: empty input fails without loading a model
        if not a._stdin_text:
            raise PyllmError("nothing to say: standard input is empty (pipe a message in, or run in a terminal)")
    llm = load_from_args(a, context_policy="shift")
    ui = sys.stdout if terminal else sys.stderr
    if a.verbose:
        _verbose_load(llm, sys.stderr)
    color = terminal and use_color(a, sys.stdout)
    chat = ChatSession(llm, settings, system=a.system, out=sys.stdout, ui=ui, color=color,
                       quiet=a.quiet or (not terminal and not a.verbose), terminal=terminal, piped=not terminal)
    def reload(n_ctx: int):
        a.ctx = n_ctx
        return load_from_args(a, context_policy="shift")

    chat.reload = reload
    if not terminal:
        return run_piped(chat, a)
    banner = (f"pyllm chat · {llm.path.name} ({llm.config.arch}, context {llm.n_ctx}, KV {llm.kv.kind}) on "
              f"{runtime_label(llm)}. /help for commands, Alt-Enter for a newline, Ctrl-D or /bye "
              f"to quit.")
    return run_repl(chat, banner)
