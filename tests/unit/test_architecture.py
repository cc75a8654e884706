"""The layout's rules, read from the source with ``ast``: floors, rooms, purity, sizes, surfaces.

The floors, bottom up (docs/contributing.md draws them):

====  ==========================================================================
0     ``errors``, ``logs``, ``partition``, ``layout``, ``v1``, ``etcdpb`` (generated): root concepts
1     ``security``: who may do what, and how much
2     ``training``: the job and its semantics
3     ``wire`` (bytes), ``models``
4     ``transport``: every socket
5     ``observe``: metrics, traces, timelines
6     ``coordinator``, ``stage_server``, ``client``: the services
7     ``local``: ``LocalCluster`` and ``LocalPipeline``
8     ``demo``
9     ``cli``
10    the facade (``elasticpipe/__init__.py``, ``__main__.py``)
====  ==========================================================================

A module may import from its own package and from any lower floor, never from a higher one
nor from another package on its own floor (the root concepts of floor 0 excepted). Lazy
imports inside functions count too.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "elasticpipe"
SERVICES = ("coordinator", "stage_server", "client")
GENERATED = ("v1", "etcdpb")  # protoc's output (proto/generate.py): not held to these rules

FLOORS = {
    "errors": 0,
    "logs": 0,
    "partition": 0,
    "layout": 0,
    "v1": 0,
    "etcdpb": 0,
    "security": 1,
    "training": 2,
    "wire": 3,
    "models": 3,
    "transport": 4,
    "observe": 5,
    "coordinator": 6,
    "stage_server": 6,
    "client": 6,
    "local": 7,
    "demo": 8,
    "cli": 9,
    "__init__": 10,
    "__main__": 10,
}

# Pure logic: testable without sockets, threads or clocks.
PURE = (
    "wire",
    "training",
    "coordinator/planning",
    "stage_server/protocol.py",
    "stage_server/reduction.py",
)
IMPURE_MODULES = {"grpc", "socket", "threading", "time"}
# Each exception says why the module cannot be pure.
IMPURE_ALLOWED = {
    ("elasticpipe/training/rng.py", "threading"): "LOCK guards torch's process-global generators",
}

MAX_ROOT_MODULES = 10
SOFT_LINES = 600  # over this, the module's docstring says why ("Longer than 600 lines: ...")
HARD_LINES = 700


@dataclass(frozen=True)
class Module:
    """One hand-written module of the package, under the name Python imports it by."""

    path: Path
    name: str  # "elasticpipe.wire.codec"

    @property
    def room(self) -> str:
        """The package (or root module) it belongs to: "wire", "errors", "__init__"."""
        return self.name.split(".")[1] if "." in self.name else "__init__"

    @property
    def tree(self) -> ast.Module:
        return ast.parse(self.path.read_text(), str(self.path))


def _modules() -> Iterator[Module]:
    for path in sorted(PACKAGE.glob("*.py")):
        yield Module(path, f"elasticpipe.{path.stem}" if path.stem != "__init__" else "elasticpipe")
    folders = [p for p in sorted(PACKAGE.iterdir()) if p.is_dir() and p.name not in GENERATED]
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(PACKAGE).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield Module(path, "elasticpipe." + ".".join(parts))


MODULES = list(_modules())


def _imports(module: Module) -> Iterator[tuple[int, str]]:
    """(line, imported module) of every import in the module, lazy ones included."""
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
            if node.module == "elasticpipe":
                for alias in node.names:
                    yield node.lineno, f"elasticpipe.{alias.name}"


def _room_of(imported: str) -> str | None:
    parts = imported.split(".")
    if parts[0] != "elasticpipe" or len(parts) == 1:
        return None
    return parts[1] if parts[1] in FLOORS else None


def test_every_module_has_a_floor() -> None:
    """Every package and root module of elasticpipe/ is placed on a floor of this test."""
    unplaced = sorted({m.room for m in MODULES} - set(FLOORS))
    assert not unplaced, f"place these on a floor in test_architecture.FLOORS: {unplaced}"


def test_imports_point_down_the_floors() -> None:
    """A module imports only its own package and lower floors, never a higher or level one."""
    wrong = []
    for module in MODULES:
        floor = FLOORS[module.room]
        for line, imported in _imports(module):
            room = _room_of(imported)
            if room is None or room == module.room:
                continue
            if FLOORS[room] > floor or (FLOORS[room] == floor and floor > 0):
                wrong.append(
                    f"{module.path.relative_to(ROOT)}:{line} ({module.room}, floor {floor}) "
                    f"imports {imported} ({room}, floor {FLOORS[room]})"
                )
    assert not wrong, "\n".join(wrong)


def test_the_services_never_import_each_other() -> None:
    """coordinator, stage_server and client share only the core beneath them."""
    wrong = [
        f"{m.path.relative_to(ROOT)}:{line} imports {imported}"
        for m in MODULES
        if m.room in SERVICES
        for line, imported in _imports(m)
        if _room_of(imported) in SERVICES and _room_of(imported) != m.room
    ]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("pure", PURE)
def test_pure_code_imports_no_sockets_threads_or_clocks(pure: str) -> None:
    """The wire format, training semantics, the planner and the step protocol stay pure."""
    target = PACKAGE / pure
    paths = sorted(target.rglob("*.py")) if target.is_dir() else [target]
    assert paths, f"{pure} names no module"
    wrong = [
        f"{m.path.relative_to(ROOT)}:{line} imports {imported}"
        for m in MODULES
        if m.path in paths
        for line, imported in _imports(m)
        if imported.split(".")[0] in IMPURE_MODULES
        and (m.path.relative_to(ROOT).as_posix(), imported) not in IMPURE_ALLOWED
    ]
    assert not wrong, "\n".join(wrong)


def test_few_root_modules() -> None:
    """elasticpipe/ itself holds at most 10 modules: the facade, errors, logs, partition."""
    roots = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(roots) <= MAX_ROOT_MODULES, roots


def _hand_written() -> Iterator[Path]:
    for top in ("elasticpipe", *SERVICES, "bench", "tests"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if not set(GENERATED) & set(path.relative_to(ROOT).parts):
                yield path


def test_no_module_over_its_line_limit() -> None:
    """No module passes 700 lines, and one over 600 says why in its docstring."""
    wrong = []
    for path in _hand_written():
        if path.is_relative_to(PACKAGE) and path.parent != PACKAGE and path.parent.is_symlink():
            continue  # the services, read once under their own folders
        lines = len(path.read_text().splitlines())
        if lines <= SOFT_LINES:
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if lines > HARD_LINES or "Longer than 600 lines" not in doc:
            wrong.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not wrong, "\n".join(wrong)


def _isort_order(name: str) -> tuple[int, str]:
    """ruff's order for ``__all__`` (RUF022): CONSTANTS, then Classes, then functions."""
    return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)


def test_every_package_declares_its_surface() -> None:
    """Every package's __init__ has a docstring mapping its files and a sorted ``__all__``."""
    wrong = []
    for init in sorted(
        [*PACKAGE.rglob("__init__.py"), *(ROOT / s / "__init__.py" for s in SERVICES)]
    ):
        if set(GENERATED) & set(init.relative_to(ROOT).parts):
            continue
        tree = ast.parse(init.read_text())
        names = [
            node.value
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
        ]
        if not names or ast.get_docstring(tree) is None:
            wrong.append(f"{init.relative_to(ROOT)}: no docstring or no __all__")
            continue
        listed = ast.literal_eval(names[0])
        if list(listed) != sorted(listed, key=_isort_order):
            wrong.append(f"{init.relative_to(ROOT)}: __all__ is not sorted")
    assert not wrong, "\n".join(wrong)


def test_no_test_module_imports_another() -> None:
    """Shared test code lives in tests/support/; a test module imports no other test module."""
    wrong = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if "support" in path.relative_to(ROOT / "tests").parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            module = None
            if isinstance(node, ast.ImportFrom):
                module = node.module if node.level == 0 else "." * node.level + (node.module or "")
            elif isinstance(node, ast.Import):
                module = node.names[0].name
            local = module is not None and (
                module.startswith(".") or module.split(".")[0] == "tests"
            )
            if local and not module.lstrip(".").startswith(("support", "tests.support")):  # type: ignore[union-attr]
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {module}")
    assert not wrong, "\n".join(wrong)
