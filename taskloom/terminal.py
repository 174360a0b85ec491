"""Printing text that users or models wrote: as data, never as markup, never as terminal control.

Goal text, answers, reasons, task ids and event data are printed as data: never parsed as rich
markup (a goal containing "[/bold]" would crash the print, "[check-a100]" would vanish as a tag),
never turned into emoji, and stripped of control characters (a goal carrying terminal escape
sequences must not drive the user's terminal). Every command prints user text through `line`;
markup appears only in taskloom's own fixed strings, as (text, style) pairs.
"""

from __future__ import annotations

import re

from rich.text import Text

# C0 controls but tab and newline, DEL, and the C1 range (ESC [ ... sequences start with \x1b or \x9b).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def clean(text: object) -> str:
    """`text` as a string without control characters (newlines and tabs kept; CR dropped)."""
    return _CONTROL.sub("", str(text).replace("\r\n", "\n"))


def line(*parts: str | tuple[str, str]) -> Text:
    """One rich Text from plain parts (data: cleaned, never markup) and (text, style) parts (ours)."""
    return Text.assemble(*((clean(p[0]), p[1]) if isinstance(p, tuple) else clean(p) for p in parts))
