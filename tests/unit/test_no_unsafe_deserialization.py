"""Tests that no package code can run code from the wire: no pickle, torch.load, eval, exec."""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("elasticpipe", "coordinator", "stage_server", "client")  # real folders (no links)
GENERATED = REPO / "elasticpipe" / "v1"


def unsafe_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) of every pickle, torch.load, eval( or exec( in code (not comments/strings)."""
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    tokens = [
        t for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type not in skip
    ]
    found = []
    for i, tok in enumerate(tokens):
        if tok.type != tokenize.NAME:
            continue
        before = tokens[i - 1].string if i > 0 else ""
        after = [t.string for t in tokens[i + 1 : i + 3]]
        if tok.string in ("pickle", "cPickle", "_pickle"):
            found.append((tok.start[0], tok.string))
        elif tok.string == "torch" and after == [".", "load"]:
            found.append((tok.start[0], "torch.load"))
        elif tok.string in ("eval", "exec") and after[:1] == ["("] and before != ".":
            # ``module.eval()`` is nn.Module's train/eval switch, not the builtin
            found.append((tok.start[0], f"{tok.string}("))
    return found


def _package_files() -> list[Path]:
    files = [p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))]
    return [p for p in files if GENERATED not in p.parents]


def test_package_code_never_deserializes_unsafely() -> None:
    """No .py file of the packages uses pickle, torch.load, eval( or exec( in code."""
    files = _package_files()
    assert len(files) > 10  # the scan really looked at the packages
    offences = [
        f"{path.relative_to(REPO)}:{line}: {what}"
        for path in files
        for line, what in unsafe_uses(path.read_text(encoding="utf-8"))
    ]
    assert not offences, "unsafe deserialization in package code:\n" + "\n".join(offences)


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("import pickle\n", [(1, "pickle")]),
        ("x = 1\nfrom pickle import loads\n", [(2, "pickle")]),
        ("import torch\nstate = torch.load(f)\n", [(2, "torch.load")]),
        ("y = eval(text)\n", [(1, "eval(")]),
        ("def f(c):\n    exec (c)\n", [(2, "exec(")]),
        ("x = torch.\\\n    load(f)\n", [(1, "torch.load")]),
    ],
    ids=["import", "from-import", "torch-load", "eval", "exec-space", "continued-line"],
)
def test_scanner_finds_unsafe_code(source: str, found: list[tuple[int, str]]) -> None:
    """The scanner reports each unsafe use with its line."""
    assert unsafe_uses(source) == found


@pytest.mark.parametrize(
    "source",
    [
        "# never pickle or torch.load what arrives; no eval(\n",
        '"""Nothing here is pickled, torch.load-ed or eval(ed)."""\n',
        "model.eval()\nnet.train()\n",
        "x = torch.loads\ntorch.save(m, f)\n",
        "evaluate(x)\nexecutor(y)\n",
        "msg = 'do not eval( this'\n",
    ],
    ids=["comment", "docstring", "module-eval", "other-torch", "longer-names", "string"],
)
def test_scanner_ignores_safe_mentions(source: str) -> None:
    """Mentions in comments and strings, Module.eval() and similar names are not reported."""
    assert unsafe_uses(source) == []
