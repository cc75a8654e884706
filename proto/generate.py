"""Generates the Python modules of the contract from ``proto/`` (run after editing a .proto).

Usage: ``python proto/generate.py [OUT_DIR]`` -- writes ``OUT_DIR/elasticpipe/v1/*_pb2*.py``
(the contract) and ``OUT_DIR/elasticpipe/etcdpb/*_pb2*.py`` (the part of etcd's v3 API the
coordinator's etcd store speaks), by default into the repository root, next to the
hand-written ``elasticpipe`` package. The
generated files are committed; ``tests/unit/test_proto_generated.py`` fails when they are
stale, so never edit them by hand.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent
PACKAGES = ("elasticpipe/v1", "elasticpipe/etcdpb")  # where the generated modules go


def generate(out_dir: Path) -> list[Path]:
    """Runs protoc on every .proto under proto/ and returns the files it wrote."""
    sources = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).resolve().parent / "_proto"
    # The mypy plugins (protoc-gen-mypy*) live next to this interpreter.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {sources}")
    return sorted(p for package in PACKAGES for p in (out_dir / package).glob("*_pb2*"))


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_ROOT
    for path in generate(target):
        print(path)
