"""Tests that the committed protobuf modules are exactly what proto/generate.py produces."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("elasticpipe/v1", "elasticpipe/etcdpb")  # as in proto/generate.py


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_proto_generate", REPO / "proto" / "generate.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """Runs the generator once into a temporary folder; maps file name to contents."""
    # protoc finds the mypy plugins on PATH: make sure this interpreter's scripts are on it.
    scripts = str(Path(sys.executable).parent)
    old_path = os.environ.get("PATH", "")
    os.environ["PATH"] = scripts + os.pathsep + old_path
    try:
        paths = _generator().generate(tmp_path_factory.mktemp("proto"))
    finally:
        os.environ["PATH"] = old_path
    root = paths[0].parents[2]  # OUT_DIR: the generated files are OUT_DIR/elasticpipe/<pkg>/
    return {str(p.relative_to(root)): p.read_bytes() for p in paths}


def test_generator_covers_every_proto(generated: dict[str, bytes]) -> None:
    """Every .proto under proto/ yields its message and service modules and stubs."""
    for proto in (REPO / "proto").rglob("*.proto"):
        stem = str(proto.relative_to(REPO / "proto").with_suffix(""))
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi"):
            assert stem + suffix in generated


def test_committed_files_are_exactly_the_generated_ones(generated: dict[str, bytes]) -> None:
    """No generated module is missing from its package, and none there lacks a source."""
    committed = {
        str(p.relative_to(REPO)) for package in PACKAGES for p in (REPO / package).glob("*_pb2*")
    }
    assert committed == set(generated)


def test_committed_files_are_byte_identical(generated: dict[str, bytes]) -> None:
    """Every committed generated module matches a fresh generation byte for byte."""
    stale = [
        name
        for name, content in sorted(generated.items())
        if not (REPO / name).is_file() or (REPO / name).read_bytes() != content
    ]
    assert not stale, f"regenerate with `python proto/generate.py`: stale {stale}"
