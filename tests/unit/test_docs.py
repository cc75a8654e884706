"""The docs state what the code does: the role table in docs/security.md is authz.ALLOWED."""

from __future__ import annotations

import re
from pathlib import Path

from elasticpipe import authz, tls

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _documented_roles() -> dict[str, frozenset[str]]:
    table: dict[str, frozenset[str]] = {}
    for line in (DOCS / "security.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or not cells[0].startswith("`") or "Service/" not in cells[0]:
            continue
        names = re.findall(r"`([^`]+)`", cells[0])
        service = names[0].split("/")[0]
        methods = [names[0].split("/")[1], *names[1:]]
        roles = re.findall(r"\b(\w+)\b", re.sub(r"\([^)]*\)", "", cells[1]))
        assert set(roles) <= set(tls.ROLES), (line, roles)
        for method in methods:
            assert f"{service}/{method}" not in table, f"{method} listed twice"
            table[f"{service}/{method}"] = frozenset(roles)
    return table


def test_the_documented_role_table_is_the_codes() -> None:
    assert _documented_roles() == authz.ALLOWED


def test_the_facade_exports_tls() -> None:
    import elasticpipe

    assert elasticpipe.TLS is tls.TLS
