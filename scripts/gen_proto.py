"""Generate the committed protobuf and gRPC code under proto/gearshift/v1.

`python scripts/gen_proto.py` regenerates in place; `--check` generates into a
temporary folder and exits 1 when the committed files differ (stale code).
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc  # type: ignore[import-untyped]

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PACKAGE_DIR = PROTO_ROOT / "gearshift" / "v1"


def generate(out_root: Path) -> list[Path]:
    protos = sorted(PACKAGE_DIR.glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    for proto in protos:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={out_root}",
            f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}",
            str(proto.relative_to(PROTO_ROOT)),
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {proto}")
    return sorted((out_root / "gearshift" / "v1").glob("*_pb2*.py*"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail when committed code is stale")
    args = parser.parse_args()
    if not args.check:
        generate(PROTO_ROOT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = []
        for path in fresh:
            committed = PACKAGE_DIR / path.name
            if not committed.exists() or not filecmp.cmp(path, committed, shallow=False):
                stale.append(path.name)
        extra = {p.name for p in PACKAGE_DIR.glob("*_pb2*.py*")} - {p.name for p in fresh}
        stale.extend(sorted(extra))
        if stale:
            print("generated protobuf code is stale; run `make proto`: " + ", ".join(stale))
            return 1
    print("protobuf code is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
