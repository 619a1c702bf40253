"""Tokenizing chat prompts fast: the Rust tokenizer behind a transformers tokenizer
(`rust_tokenizer`), and a piecewise encoder that remembers the pieces of earlier
prompts (`SegmentEncoder`), for the thinker's re-rendered conversations."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def rust_tokenizer(tokenizer: Any) -> Any:
    """The Rust tokenizer behind a transformers fast tokenizer, for calls with less
    Python around them; None where it would not give the wrapper's results.

    It is a copy with the truncation and padding a tokenizer.json may carry turned
    off (the wrapper turns them off on every call of its own).
    """
    import copy

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None  # the wrapper post-processes decoded text
    fast = copy.deepcopy(backend)
    fast.no_truncation()
    fast.no_padding()
    return fast


class SegmentEncoder:
    """Tokenizes a rendered chat prompt piece by piece, remembering the pieces.

    A fast tokenizer first splits its input at its added tokens that are matched on
    the raw text (``normalized=False``, as chat control tokens like ``<|im_start|>``
    are), then normalizes and encodes the text between them independently; so the
    ids of a prompt are the ids of those pieces put together. Every turn of a
    conversation re-renders the whole history: with the pieces remembered only the
    new messages are encoded. Used only where that holds: no added token strips
    whitespace or must match a single word, and a self-check with every added token
    agrees with a whole encode. Added tokens matched on normalized text stay inside
    the pieces, encoded by the tokenizer itself.
    """

    MAX_PIECES = 4096  # least recently used pieces are forgotten beyond this...
    MAX_CHARS = 1 << 20  # ...or beyond this many characters kept in all
    MAX_PIECE_CHARS = 8192  # longer pieces are encoded every time, not kept

    def __init__(self, fast: Any, added: Mapping[str, int]) -> None:
        import re
        from collections import OrderedDict

        self.fast = fast
        self.added = dict(added)
        self.split = re.compile("(" + "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")")
        self.pieces: OrderedDict[str, list[int]] = OrderedDict()
        self.chars = 0

    @classmethod
    def for_tokenizer(cls, fast: Any) -> SegmentEncoder | None:
        """`fast` must encode with no truncation and no padding."""
        try:
            tokens = fast.get_added_tokens_decoder()
        except AttributeError:
            return None
        if any(t.lstrip or t.rstrip or t.single_word for t in tokens.values()):
            return None
        raw = {t.content: i for i, t in tokens.items() if not t.normalized}
        if not raw:
            return None
        enc = cls(fast, raw)
        every = [t.content for t in tokens.values()]
        sample = "".join(f"{t}system\n  Be brief, é ✓.{t} x\n{t}" for t in every) + "user\nHi  there!\n\n" + "".join(every)
        whole = list(fast.encode(sample, add_special_tokens=False).ids)
        if enc.encode(sample) != whole or enc.encode(sample) != whole:  # cold, then from the kept pieces
            return None
        enc.pieces.clear()
        enc.chars = 0
        return enc

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for piece in self.split.split(text):
            if not piece:
                continue
            tid = self.added.get(piece)
            if tid is not None:
                out.append(tid)
                continue
            ids = self.pieces.get(piece)
            if ids is None:
                ids = list(self.fast.encode(piece, add_special_tokens=False).ids)
                if len(piece) <= self.MAX_PIECE_CHARS:
                    self.pieces[piece] = ids
                    self.chars += len(piece)
                    while len(self.pieces) > self.MAX_PIECES or self.chars > self.MAX_CHARS:
                        self.chars -= len(self.pieces.popitem(last=False)[0])
            else:
                self.pieces.move_to_end(piece)
            out.extend(ids)
        return out
