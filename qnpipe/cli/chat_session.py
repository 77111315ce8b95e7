"""The `qnpipe chat` loop: read a line, run a /command or answer it with streamed text.

Each answer's prompt is the whole conversation under the chat template; prefix snapshots
(qnpipe.live.prefix) resume it from the previous turn's state, so a turn prefills only what is new.
"""

from __future__ import annotations

import sys
from typing import Any

from qnpipe.chat.conversation import Conversation
from qnpipe.cli.common import echo, print_engine_stats, print_stats
from qnpipe.errors import ChatError, OutputError

HELP = ("commands: /reset (forget the turns), /system [TEXT] (show or set the system message; "
        "/system - removes it), /stats, /save FILE, /load FILE, /help, /quit or Ctrl-D; "
        "Ctrl-C stops an answer; start a line with // to send one beginning with /")


def say(msg: str) -> None:
    print(msg, file=sys.stderr)


class ChatSession:
    """One terminal conversation with an Engine; `run` returns the exit status."""

    def __init__(self, eng: Any, args: Any) -> None:
        self.eng = eng
        self.args = args
        self.conv = Conversation(args.system or None)
        self.last: Any = None  # the last answer's GenerateStats

    def run(self) -> int:
        say("chat: type a message; /help lists the commands, /quit or Ctrl-D leaves.")
        while True:
            try:
                line = input("you> ")
            except EOFError:
                print(file=sys.stderr)
                return 0
            except UnicodeDecodeError as e:
                say(f"qnpipe chat: error: the input line is not valid UTF-8 (byte 0x{e.object[e.start]:02x}); "
                    f"not sent")
                continue
            from qnpipe.config.validate import check_text

            try:
                check_text(line, "the input line")
            except ValueError as e:
                say(f"qnpipe chat: error: {e}; not sent")
                continue
            cmd = line.strip()
            if not cmd:
                continue
            if cmd.startswith("//"):
                line = line.lstrip()[1:]
            elif cmd.startswith("/"):
                name, _, rest = cmd.partition(" ")
                if name in ("/quit", "/exit"):
                    return 0
                self.command(name, rest.strip())
                continue
            self.answer(line)

    def command(self, name: str, rest: str) -> None:
        if name == "/reset":
            self.conv.reset()
            say("[conversation cleared]")
        elif name == "/system":
            if not rest:
                say(f"[system: {self.conv.system!r}]" if self.conv.system else "[no system message]")
                return
            self.conv.system = None if rest == "-" else rest
            say("[system message removed]" if rest == "-" else "[system message set]")
        elif name == "/stats":
            self.stats()
        elif name in ("/save", "/load"):
            if not rest:
                say(f"qnpipe chat: error: {name} needs a file name ({name} FILE)")
                return
            try:
                if name == "/save":
                    self.check_save(rest)
                    self.conv.save(rest)
                    say(f"[saved {len(self.conv.turns)} messages to {rest}]")
                else:
                    self.conv = Conversation.load(rest)
                    say(f"[loaded {len(self.conv.turns)} messages from {rest}]")
            except (ChatError, OutputError) as e:
                say(f"qnpipe chat: error: {e}")
            except OSError as e:  # a full disk, a missing directory: the file and the reason
                say(f"qnpipe chat: error: {e.filename or rest}: {e.strerror or e}")
        elif name == "/help":
            say(HELP)
        else:
            say(f"qnpipe chat: unknown command {name} ({HELP})")

    def check_save(self, path: str) -> None:
        """/save FILE replaces none of the files this chat reads or writes (qnpipe.io.clobber)."""
        from qnpipe.io.clobber import check_outputs

        cfg = self.eng.cfg
        check_outputs([("--trace", cfg.trace.event_log_path), ("/save", path)], [("--config", self.args.config)],
                      models=[("MODEL_DIR", self.args.model_dir), ("model.expert_dir", cfg.model.resolved_expert_dir())])

    def stats(self) -> None:
        st = self.eng.stats()
        say(f"[{len(self.conv.turns)} messages; {st.requests} answers, {st.prompt_tokens} prompt tokens, "
            f"{st.generated_tokens} generated; peak memory {st.peak_memory_bytes / 2**20:.0f} MiB]")
        if self.last is not None:
            say(f"[last answer: {self.last.prompt_tokens} prompt tokens, {self.last.prefix_tokens_reused} "
                f"resumed from a snapshot; {self.last.generated_tokens} generated, "
                f"prefill {self.last.prefill_s:.2f}s, decode {self.last.decode_tok_s:.1f} tok/s]")
        p = st.prefix
        if p is None:
            say("[prefix snapshots off]")
        else:
            say(f"[prefix snapshots: {p.hits} hits ({p.disk_loads} from disk), {p.misses} misses, "
                f"{p.tokens_reused} tokens reused; {p.entries} kept, {p.bytes / 2**20:.1f} MiB]")
        say(f"[KV cache: {st.kv_bytes_per_token} bytes per token of context]")
        print_engine_stats(st)

    def answer(self, line: str) -> None:
        self.conv.add("user", line)
        sys.stdout.write("assistant> ")
        pieces: list[str] = []

        def show(piece: str) -> None:
            pieces.append(piece)
            echo(piece)

        try:
            res = self.eng.generate(self.eng.render_chat(self.conv.messages()), max_tokens=self.args.max_tokens,
                                    temperature=self.args.temperature, top_p=self.args.top_p, seed=self.args.seed,
                                    top_k=self.args.top_k, min_p=self.args.min_p, on_text=show)
        except KeyboardInterrupt:
            # The engine stopped the answer at its next layer and stays usable; the conversation
            # keeps the part the user saw.
            print()
            say("[answer interrupted]")
            if pieces:
                self.conv.add("assistant", "".join(pieces))
            else:
                self.conv.turns.pop()
            return
        print()
        self.last = res.stats
        if self.args.verbose:
            print_stats(res.stats)
        if getattr(self.args, "stats", False):
            print_engine_stats(self.eng.stats())
        self.conv.add("assistant", res.text)
