"""Printing text that came from an artifact (or any untrusted source) to a terminal.

An archive's specs carry free text (the model reference and arguments, versions, input and
symbol names, option keys and values, member names) that the CLI prints. Written as it is, a
control sequence in it can retitle the terminal, clear the screen, move the cursor over earlier
output, or turn a report's "FAILED" into a fake "PASSED"; a bidi override can reorder what a line
shows. :func:`safe_text` makes every such character visible instead: text for a human, not meant
to be read back (a backslash is left as it is, so the escaped form is not reversible).

No pydantic, no torch: the CLI's error path uses it too.
"""

from __future__ import annotations

import re

__all__ = ["safe_text"]

#: Escaped: C0 controls (tab, newline, CR, BEL, backspace, ESC, ...), DEL and the C1 controls
#: U+0080-U+009F (U+009B is a one-character CSI); U+0085, U+2028 and U+2029, which split a line;
#: the bidi embeddings, overrides and isolates (U+202A-U+202E, U+2066-U+2069) and marks (U+061C,
#: U+200E, U+200F), which reorder what a line shows; and lone surrogates (a name decoded with
#: ``surrogateescape``), which a terminal cannot be sent at all.
_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def safe_text(s: str) -> str:
    """``s`` with every control character shown as ``\\xNN`` (below U+0100) or ``\\uNNNN``, so the
    result holds no character a terminal acts on and no line break; printable text, non-ASCII
    letters included, is left unchanged. Not a ``str``: its ``str()``, escaped."""
    text = s if isinstance(s, str) else str(s)
    return _UNSAFE.sub(_escape, text)
