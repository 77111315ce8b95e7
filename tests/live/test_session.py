"""The decode session (qnpipe.live.session) driven directly with plain token lists: no model, no trio."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import qnpipe
from qnpipe.live import session as session_mod
from qnpipe.live.session import DecodeSession, Output, generate_stats
from qnpipe.stats import FinishReason

EOS = 0


class Detok:
    """A detokenizer that holds back each token's text until the next one (as a real one may, mid-character)."""

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.held = ""
        self.seg = ""
        self.resets = 0

    def reset(self) -> None:
        self.pieces, self.held, self.seg = [], "", ""
        self.resets += 1

    def add_token(self, tok: int) -> None:
        self.seg += self.held
        self.held = f"<{tok}>"
        self.pieces.append(self.held)

    def finalize(self) -> None:
        self.seg += self.held
        self.held = ""

    @property
    def last_segment(self) -> str:
        seg, self.seg = self.seg, ""
        return seg

    @property
    def text(self) -> str:
        return "".join(self.pieces)


class Tok:
    def __init__(self) -> None:
        self.detokenizer = Detok()


def session(max_tokens: int, *, t0: float = 10.0, reused: int = 0, partial: list[int] | None = None
            ) -> tuple[DecodeSession, list[str]]:
    streamed: list[str] = []
    s = DecodeSession(Output(Tok(), {EOS}, streamed.append, partial), 7, max_tokens, t0, reused)
    return s, streamed


def test_rounds_commit_until_the_length_limit_and_stop_inside_a_round() -> None:
    s, streamed = session(5)
    assert s.commit([1], 11.0)
    assert s.commit([2, 3], 12.0)
    assert not s.commit([4, 5, 6, 7], 13.0)  # the round made more than was wanted
    assert (s.n, s.reason, s.output.tokens, s.kept) == (5, FinishReason.LENGTH, [1, 2, 3, 4, 5], 5)
    assert "".join(streamed) == "<1><2><3><4>"  # the last token's text is still held back
    assert s.end(14.0) == "<1><2><3><4><5>"
    assert "".join(streamed) == "<1><2><3><4><5>"  # end streams it
    r = s.result(1234)
    assert r.tokens == (1, 2, 3, 4, 5) and r.text == "<1><2><3><4><5>"
    st = r.stats
    assert (st.prompt_tokens, st.generated_tokens, st.finish_reason, st.peak_memory_bytes) == (7, 5, FinishReason.LENGTH, 1234)
    assert (st.prefill_s, st.decode_s) == (1.0, 3.0)  # first token at 11, end at 14, prompt in at 10
    assert st.prefill_tok_s == 7.0 and st.decode_tok_s == pytest.approx(4 / 3)
    assert st.prefix_tokens_reused == 0


def test_eos_ends_the_call_counted_but_not_kept() -> None:
    partial: list[int] = []
    s, streamed = session(10, partial=partial, reused=4)
    assert s.commit([3, 4], 11.0)
    assert not s.commit([5, EOS, 6], 12.5)
    assert (s.n, s.reason, s.kept) == (4, FinishReason.EOS, 3)
    assert partial == [3, 4, 5]  # the caller's list sees each kept token as it comes
    s.end(13.0)
    r = s.result(0)
    assert r.tokens == (3, 4, 5) and r.stats.generated_tokens == 4 and r.stats.finish_reason is FinishReason.EOS
    assert r.stats.prefix_tokens_reused == 4


def test_only_the_first_commit_times_the_first_token() -> None:
    s, _ = session(10)
    s.commit([1], 11.0)
    s.commit([2], 15.0)
    s.end(16.0)
    assert (s.result(0).stats.prefill_s, s.result(0).stats.decode_s) == (1.0, 5.0)


def test_a_driver_that_stops_on_its_own_ends_at_length_with_no_token() -> None:
    # max_tokens 0 in plain decoding: no round is committed, the whole call is prefill.
    s, streamed = session(0)
    assert s.end(12.0) == "" and streamed == []
    st = s.result(5).stats
    assert (st.finish_reason, st.generated_tokens, st.prefill_s, st.decode_s) == (FinishReason.LENGTH, 0, 2.0, 0.0)
    assert st.prefill_tok_s == 3.5 and st.decode_tok_s == 0.0


def test_a_committed_round_keeps_its_first_token_whatever_the_limit() -> None:
    # The MTP loops commit the prefill's token before checking the limit (as they always have).
    s, _ = session(0)
    assert not s.commit([9, 8], 11.0)
    assert (s.n, s.reason, s.output.tokens) == (1, FinishReason.LENGTH, [9])


def test_no_tokenizer_no_text_and_result_needs_end() -> None:
    s = DecodeSession(Output(None, set(), None, None), 2, 3, 0.0)
    assert not s.commit([1, 2, 3, 4], 1.0)
    with pytest.raises(AssertionError):
        s.result(0)
    assert s.end(2.0) == ""
    assert s.result(0, mtp=None).tokens == (1, 2, 3)


def test_the_output_resets_the_detokenizer() -> None:
    tok = Tok()
    Output(tok, set(), None, None)
    assert tok.detokenizer.resets == 1


def test_stats_match_the_old_generate_stats() -> None:
    s, _ = session(3)
    s.commit([1, 2, 3], 10.5)
    s.end(12.0)
    assert s.result(77).stats == generate_stats(7, 3, 10.0, 10.5, 12.0, 77, FinishReason.LENGTH,
                                                prefix_tokens_reused=0)


def test_the_old_import_paths_still_work() -> None:
    from qnpipe.live import Output as LiveOutput
    from qnpipe.live import generate_stats as live_stats
    from qnpipe.live.decoding import Output as DecOutput
    from qnpipe.live.decoding import generate_stats as dec_stats
    from qnpipe.live.mtp.loop import commit_round

    assert LiveOutput is DecOutput is Output and live_stats is dec_stats is generate_stats
    out = Output(None, {EOS}, None, None)
    assert commit_round(out, [1, 2], 0, 5) == (2, None)
    assert commit_round(out, [3, EOS], 2, 5) == (4, FinishReason.EOS)
    assert commit_round(out, [4, 5, 6], 3, 5) == (5, FinishReason.LENGTH) and out.tokens == [1, 2, 3, 4, 5]


SANS_IO_BANNED = ("trio", "mlx", "numpy", "qnpipe.actors", "qnpipe.model", "qnpipe.live.mlx_thread")


def banned_imports(source: str) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return [n for n in names if any(n == b or n.startswith(b + ".") for b in SANS_IO_BANNED)]


def test_the_session_is_sans_io() -> None:
    path = Path(qnpipe.__file__).parent / "live" / "session.py"
    assert Path(session_mod.__file__) == path
    assert banned_imports(path.read_text()) == []


@pytest.mark.parametrize("line", ["import trio", "from mlx import core as mx", "import mlx.core as mx",
                                  "from qnpipe.model.decode import chunks", "def f() -> Any:\n    import trio\n"])
def test_the_sans_io_check_catches_an_import(line: str) -> None:
    src = "from __future__ import annotations\n" + line + "\n"
    assert banned_imports(src) != []
