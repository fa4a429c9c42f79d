"""Write the wire-contract tables of docs/strategies.md from ``pollen.protocol`` (their one source).

Run ``python docs/gen_contracts.py`` after changing a protocol module; ``tests/test_docs.py`` fails
while the page and the modules disagree.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

PAGE = Path(__file__).with_name("strategies.md")


def families() -> list[str]:
    """The ``pollen.protocol`` modules whose docstring holds a contract table: one per family (and node
    identity), found rather than listed, so a new family's table needs no edit here."""
    import pollen.protocol

    names = [m.name for m in pkgutil.iter_modules(pollen.protocol.__path__)]
    return [name for name in sorted(names) if contract_table(name)]


def contract_table(family: str) -> str:
    """The Markdown table in ``pollen.protocol.<family>``'s docstring (RST literals → Markdown)."""
    doc = importlib.import_module(f"pollen.protocol.{family}").__doc__ or ""
    return "\n".join(line for line in doc.splitlines() if line.startswith("|")).replace("``", "`")


def render(text: str) -> str:
    for family in families():
        start, end = f"<!-- contract:{family} -->", f"<!-- /contract:{family} -->"
        if start in text:
            table = contract_table(family)
            block = f"{start}\n{table}\n{end}"
            text = re.sub(re.escape(start) + ".*?" + re.escape(end), lambda _m, b=block: b, text, flags=re.S)
    return text


if __name__ == "__main__":
    PAGE.write_text(render(PAGE.read_text()))
