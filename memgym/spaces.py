"""A Gymnasium text space for arbitrary Unicode strings.

Gymnasium's :class:`~gymnasium.spaces.Text` only accepts characters of its charset
(alphanumeric by default). LLM observations and actions are any Unicode text, so
:class:`UnicodeText` accepts every ``str`` within the length bounds; it stays a ``Text``
subclass so vector environments batch it like any text space.
"""

from __future__ import annotations

from typing import Any

from gymnasium.spaces import Text

# Printable characters used by sample(): ASCII, Latin-1 letters, Greek, Cyrillic, CJK, symbols.
SAMPLE_CHARSET = "".join(
    ch
    for lo, hi in ((0x20, 0x7E), (0xC0, 0xFF), (0x391, 0x3C9), (0x410, 0x44F), (0x4E00, 0x4E3F), (0x2190, 0x21FF))
    for ch in map(chr, range(lo, hi + 1))
    if ch.isprintable()
) + "\n"


class UnicodeText(Text):
    """Any Unicode string of ``min_length`` to ``max_length`` characters.

    ``sample()`` draws printable Unicode strings of at most ``sample_max_length`` characters
    (``max_length`` is a cap, not a typical size; sampling a million characters helps nobody).
    """

    def __init__(self, max_length: int, *, min_length: int = 0, sample_max_length: int = 256, seed: Any = None):
        super().__init__(max_length, min_length=min_length, charset=SAMPLE_CHARSET, seed=seed)
        self.sample_max_length = max(self.min_length, min(int(sample_max_length), self.max_length))

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        if mask is None and probability is None:
            length = int(self.np_random.integers(self.min_length, self.sample_max_length + 1))
            return super().sample(mask=(length, None))
        return super().sample(mask=mask, probability=probability)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length

    @property
    def is_np_flattenable(self) -> bool:
        return False  # arbitrary Unicode has no fixed-size integer encoding

    def __repr__(self) -> str:
        return f"UnicodeText({self.min_length}, {self.max_length})"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, UnicodeText) and self.min_length == other.min_length
                and self.max_length == other.max_length)

    def __hash__(self) -> int:
        return hash(("UnicodeText", self.min_length, self.max_length))
