"""The documentation says what the code does: contract tables equal the protocol modules."""

import runpy

from tests.conftest import PROJECT_ROOT

GEN = runpy.run_path(str(PROJECT_ROOT / "docs" / "gen_contracts.py"))


def test_contract_tables_in_docs_match_the_protocol_modules():
    page = (PROJECT_ROOT / "docs" / "strategies.md").read_text()
    assert GEN["render"](page) == page, "run `python docs/gen_contracts.py` to refresh docs/strategies.md"
    found = GEN["families"]()
    assert {"weights", "prototypes", "logits", "glfc"} <= set(found), found
    for family in found:  # each family's table is on the page, not just refreshable
        table = GEN["contract_table"](family)
        assert table.count("\n") >= 3 and f"<!-- contract:{family} -->" in page and table in page, family
