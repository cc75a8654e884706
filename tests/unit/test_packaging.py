"""The distribution installs one namespace: ``elasticpipe`` (its services as subpackages)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SERVICES = ("client", "coordinator", "stage_server")


@pytest.mark.timeout(300)
def test_wheel_has_only_the_elasticpipe_top_level_package(tmp_path: Path) -> None:
    """A built wheel's only top-level package is ``elasticpipe``; the services sit under it
    as ``elasticpipe.client``, ``elasticpipe.coordinator`` and ``elasticpipe.stage_server``."""
    source = tmp_path / "src"  # a copy, so that the build leaves nothing in the checkout
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout.split()
    for name in tracked:
        target = source / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if (REPO / name).is_symlink():
            target.symlink_to((REPO / name).readlink())
        else:
            shutil.copy2(REPO / name, target)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(source),
        ],
        check=True,
        capture_output=True,
        timeout=280,
    )
    (wheel,) = tmp_path.glob("elasticpipe-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert tops == {"elasticpipe"}
    for service in SERVICES:
        assert f"elasticpipe/{service}/__init__.py" in names
    assert "elasticpipe/v1/stage_pb2.py" in names


def test_code_imports_services_only_through_the_namespace() -> None:
    """No module imports ``client``, ``coordinator`` or ``stage_server`` as a top-level
    package (they do not exist once installed)."""
    pattern = re.compile(rf"^\s*(from|import)\s+({'|'.join(SERVICES)})\b", re.MULTILINE)
    folders = ("elasticpipe", *SERVICES, "tests", "bench")
    offences = [
        str(path.relative_to(REPO))
        for folder in folders
        for path in (REPO / folder).rglob("*.py")
        if pattern.search(path.read_text(encoding="utf-8"))
    ]
    assert not offences
