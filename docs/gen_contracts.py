"""Write the wire-contract tables of docs/strategies.md from ``pollen.protocol`` (their one source).

Run ``python docs/gen_contracts.py`` after changing a protocol module; ``tests/test_docs.py`` fails
while the page and the modules disagree.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

PAGE = Path(__file__).with_name("strategies.md")
FAMILIES = ("identity", "weights", "prototypes", "logits", "glfc")


def contract_table(family: str) -> str:
    """The Markdown table in ``pollen.protocol.<family>``'s docstring (RST literals → Markdown)."""
    doc = importlib.import_module(f"pollen.protocol.{family}").__doc__ or ""
    return "\n".join(line for line in doc.splitlines() if line.startswith("|")).replace("``", "`")


def render(text: str) -> str:
    for family in FAMILIES:
        start, end = f"<!-- contract:{family} -->", f"<!-- /contract:{family} -->"
        if start in text:
            table = contract_table(family)
            block = f"{start}\n{table}\n{end}"
            text = re.sub(re.escape(start) + ".*?" + re.escape(end), lambda _m, b=block: b, text, flags=re.S)
    return text


if __name__ == "__main__":
    PAGE.write_text(render(PAGE.read_text()))
