"""The docs state what the code does: the role table in docs/security.md is authz.ALLOWED."""

from __future__ import annotations

import re
from pathlib import Path

from elasticpipe.security import authz, tls

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


def test_the_sdk_reference_covers_every_argument_member_and_field() -> None:
    """docs/sdk.md names every argument of Pipeline and LocalPipeline, every public member,
    every StepStats and StageStep field and every error class, so it cannot fall behind."""
    import dataclasses
    import inspect

    from elasticpipe import LocalPipeline, Pipeline, StepStats, errors
    from elasticpipe.client.pipeline import StageStep

    text = (Path(__file__).resolve().parents[2] / "docs" / "sdk.md").read_text()
    names = {
        *list(inspect.signature(Pipeline.__init__).parameters)[1:],
        *list(inspect.signature(LocalPipeline.__init__).parameters)[1:],
        *(n for n in dir(Pipeline) if not n.startswith("_")),
        *(n for n in dir(LocalPipeline) if not n.startswith("_")),
        *(f.name for f in dataclasses.fields(StepStats)),
        *(f.name for f in dataclasses.fields(StageStep)),
        *(
            name
            for name, cls in vars(errors).items()
            if isinstance(cls, type)
            and issubclass(cls, errors.ElasticPipeError)
            and cls not in (errors.ElasticPipeError, errors.Unavailable)
        ),
    }
    missing = sorted(n for n in names if f"`{n}`" not in text and f"`{n}(" not in text)
    assert not missing, f"docs/sdk.md does not document {missing}"


def _table_rows(lines: list[str]) -> set[tuple[str, str]]:
    """The (field, bound) rows of the fixed-width table in ``elasticpipe.security.bounds``."""
    rules = [i for i, line in enumerate(lines) if line.startswith("====")]
    rows: list[list[str]] = []
    for line in lines[rules[1] + 1 : rules[2]]:
        field, bound = line[:44].strip(), line[44:].strip()
        if not line.startswith(" "):
            rows.append([field, bound])
            continue
        rows[-1][0] += f" {field}" if field else ""
        rows[-1][1] += f" {bound}" if bound else ""
    return {(f, b) for f, b in rows}


def test_the_documented_bounds_are_the_codes() -> None:
    """docs/security.md's bounds table is the one in elasticpipe/security/bounds.py, row for row."""
    from elasticpipe.security import bounds

    text = (DOCS / "security.md").read_text()
    section = text.split("## Bounds", 1)[1].split("\n## ", 1)[0]
    documented = set()
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0] not in ("field", "---"):
            documented.add((cells[0], cells[1].strip("`")))
    assert documented == _table_rows((bounds.__doc__ or "").splitlines())
