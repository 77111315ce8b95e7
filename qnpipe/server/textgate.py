"""What of the generated text may be sent as content yet: stop strings and the tool-call marker.

Pure (no trio, no MLX). A stop string ends the output before it; a tool call's marker
switches the rest of the output to the tool-call text. Text that could still become
either (a suffix that is a prefix of one) is held back until the next piece decides.
"""

from __future__ import annotations

from collections.abc import Sequence


class TextGate:
    """Feed it the detokenized pieces in order; it returns the content safe to send now."""

    def __init__(self, stops: Sequence[str] = (), tool_marker: str | None = None) -> None:
        self.stops = tuple(s for s in stops if s)
        self.marker = tool_marker or None
        self.text = ""
        self.sent = 0
        self.stopped = False
        self.tool_start: int | None = None
        watch = (*self.stops, *((self.marker,) if self.marker else ()))
        self._longest = max((len(s) for s in watch), default=0)

    def feed(self, piece: str) -> str:
        """Add `piece`; the content released by it (may be empty). Ignored once stopped."""
        if self.stopped or not piece:
            return ""
        start = max(0, len(self.text) - self._longest + 1)
        self.text += piece
        cut = min((i for s in self.stops if (i := self.text.find(s, start)) >= 0), default=-1)
        if cut >= 0 and (self.tool_start is None or cut >= self.tool_start):
            self.text = self.text[:cut]
            self.stopped = True
        if self.marker is not None and self.tool_start is None:
            at = self.text.find(self.marker, start)
            if at >= 0:
                self.tool_start = at
        return self._release(final=self.stopped)

    def finish(self) -> str:
        """The content still held back, once generation has ended."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        limit = self.tool_start if self.tool_start is not None else len(self.text) - (0 if final else self._held())
        if limit <= self.sent:
            return ""
        out = self.text[self.sent:limit]
        self.sent = limit
        return out

    def _held(self) -> int:
        """The length of the longest suffix of the text that begins a stop string or the marker."""
        watch = (*self.stops, *((self.marker,) if self.marker else ()))
        best = 0
        for s in watch:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best

    @property
    def content(self) -> str:
        """All the content (the text before any tool call, without the stop string)."""
        return self.text if self.tool_start is None else self.text[:self.tool_start]

    @property
    def tool_text(self) -> str:
        """The text from the tool-call marker on ('' when there is none)."""
        return "" if self.tool_start is None else self.text[self.tool_start:]
