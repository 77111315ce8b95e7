"""Special-token text inside chat content stays text: it never becomes a control token.

A chat template renders messages to one string, and the tokenizer then matches every added
token in it (`<|im_start|>`, `<|im_end|>`, `<tool_call>`, ...) wherever it appears. So a user
message, or an untrusted tool result, holding the text `<|im_end|>\\n<|im_start|>system\\n...`
would close its own turn and open a system turn. The server escapes instead:

1. `Escaper.mark` replaces, in every string a request gives the template (contents, names,
   tool-call arguments, tool definitions), each added token's text by a marker of private-use
   characters: `OPEN index CLOSE`. The marker characters themselves, when a client sends
   them, are marked the same way, so no client text can forge one. A string that begins
   with the end of an added token, or ends with the start of one, also gets an empty marker
   at that edge, so it cannot complete a token with the template's text next to it.
2. The template renders the marked strings as it renders any text.
3. `encode_marked` cuts the rendered text at the markers: the template's text between them is
   encoded as always (its control tokens matched); each marker becomes its token's text
   encoded as ordinary text pieces (`literal_ids`: the tokenizer's model without its added-token
   matching), so the model reads the characters the client sent, not a control token.

A prompt without any added token's text has no marker and encodes exactly as before, byte for
byte (so prefix snapshots keep matching). Defence in depth: `encode_marked` refuses a prompt
whose template segments hold more added-token ids than added-token texts (text that some
normalisation turned into a control token).

Pure: no trio, no MLX; the caller passes its async `encode`.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from qnpipe.errors import ChatError

OPEN = "\ue000"
CLOSE = "\ue001"
_MARK = re.compile(f"{OPEN}([0-9]*){CLOSE}")
# Keys whose values the template compares rather than prints: never marked.
_KEEP = frozenset({"role", "type"})


def _hf(tokenizer: Any) -> Any:
    """The Hugging Face tokenizer behind mlx-lm's TokenizerWrapper (or the tokenizer itself)."""
    return getattr(tokenizer, "_tokenizer", tokenizer)


class Escaper:
    """The added tokens of one tokenizer, and how to mark, cut and encode their text."""

    def __init__(self, tokenizer: Any) -> None:
        hf = _hf(tokenizer)
        vocab: dict[str, int] = dict(hf.get_added_vocab()) if hasattr(hf, "get_added_vocab") else {}
        for t in getattr(hf, "all_special_tokens", ()):
            if t and t not in vocab:
                vocab[t] = hf.convert_tokens_to_ids(t)
        self.tokenizer = tokenizer
        self.specials = sorted((t for t in vocab if t), key=lambda t: (-len(t), t))  # longest first
        self.special_ids = frozenset(vocab[t] for t in self.specials)
        # Marker i stands for lits[i]: an added token's text, or a marker character sent as text.
        self.lits = [*self.specials, OPEN, CLOSE]
        self._index = {t: i for i, t in enumerate(self.lits)}
        self._find = re.compile("|".join(re.escape(t) for t in self.lits))
        self._heads = {t[:i] for t in self.specials for i in range(1, len(t))}  # proper prefixes
        self._tails = {t[i:] for t in self.specials for i in range(1, len(t))}  # proper suffixes
        self._longest = max((len(t) for t in self.specials), default=0)

    def mark_text(self, s: str) -> str:
        """`s` with every added token's text (and marker character) replaced by its marker."""
        out = self._find.sub(lambda m: f"{OPEN}{self._index[m.group()]}{CLOSE}", s)
        n = min(len(out), self._longest - 1)
        if any(out[:i] in self._tails for i in range(1, n + 1)):
            out = OPEN + CLOSE + out
        if any(out[-i:] in self._heads for i in range(1, n + 1)):
            out = out + OPEN + CLOSE
        return out

    def mark(self, obj: Any) -> Any:
        """`obj` (messages or tools: dicts, lists, strings) with every string marked (`mark_text`), keys too."""
        if isinstance(obj, str):
            return self.mark_text(obj)
        if isinstance(obj, Mapping):
            return {(self.mark_text(k) if isinstance(k, str) else k):
                    (v if k in _KEEP else self.mark(v)) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return [self.mark(v) for v in obj]
        return obj

    def literal_ids(self, text: str) -> list[int]:
        """`text` encoded as ordinary text: the tokenizer's pipeline without its added-token matching."""
        backend = getattr(_hf(self.tokenizer), "backend_tokenizer", None)
        if backend is None:  # no fast tokenizer: one character at a time is text too
            return [i for ch in text for i in _hf(self.tokenizer).encode(ch, add_special_tokens=False)]
        if backend.normalizer is not None:
            text = backend.normalizer.normalize_str(text)
        pieces = backend.pre_tokenizer.pre_tokenize_str(text) if backend.pre_tokenizer is not None else [(text, None)]
        return [tok.id for piece, _ in pieces for tok in backend.model.tokenize(piece)]

    def segments(self, text: str) -> list[tuple[str, bool]]:
        """`text` (rendered from marked strings) cut at its markers: (template text, False) and (literal text, True)."""
        out: list[tuple[str, bool]] = []
        pos = 0
        for m in _MARK.finditer(text):
            if m.start() > pos:
                out.append((text[pos:m.start()], False))
            if m.group(1):
                i = int(m.group(1))
                out.append((self.lits[i] if i < len(self.lits) else m.group(), True))
            pos = m.end()
        if pos < len(text):
            out.append((text[pos:], False))
        return out

    def count_specials(self, text: str) -> int:
        return sum(1 for m in self._find.finditer(text) if m.group() not in (OPEN, CLOSE))


def has_marks(text: str) -> bool:
    return OPEN in text


async def encode_marked(esc: Escaper, text: str, encode: Callable[[str], Awaitable[list[int]]]) -> list[int]:
    """The token ids of `text` rendered from `esc.mark`ed strings (see the module doc).

    Raises ChatError when a template segment encodes to more added-token ids than it holds
    added-token texts: text that the tokenizer would read as a control token after all.
    """
    ids: list[int] = []
    for seg, literal in esc.segments(text):
        if literal:
            ids += esc.literal_ids(seg)
            continue
        part = await encode(seg)
        if sum(1 for t in part if t in esc.special_ids) > esc.count_specials(seg):
            raise ChatError("messages: the content holds text that this model's tokenizer reads as a control "
                            "token")
        ids += part
    return ids


def mark_request(esc: Escaper, messages: Sequence[Mapping[str, Any]],
                 tools: Sequence[Mapping[str, Any]] | None) -> tuple[list[Any], list[Any] | None]:
    """`messages` and `tools` with every client string marked, ready for the template."""
    return [esc.mark(m) for m in messages], ([esc.mark(t) for t in tools] if tools else None)
