"""Regenerate the Python modules of proto/cache.proto: `python -m proto.generate`.

The proto is compiled with the repository root as include path so that the generated
gRPC module imports its messages as `proto.cache_pb2` (a package import, not a bare
`import cache_pb2` that only works with proto/ on sys.path).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_FILES = ("proto/cache.proto",)
GENERATED = ("cache_pb2.py", "cache_pb2.pyi", "cache_pb2_grpc.py")


def generate(out_root: Path) -> list[Path]:
    """Compile PROTO_FILES under out_root (as out_root/proto/...); return the outputs."""
    # Imported here so that importing this module (e.g. from a test) stays cheap.
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    out_root.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{REPO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *PROTO_FILES,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return [out_root / "proto" / name for name in GENERATED]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="only report whether the checked-in modules are stale")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        stale = []
        for path in generate(Path(tmp)):
            target = REPO_ROOT / "proto" / path.name
            if not target.exists() or target.read_bytes() != path.read_bytes():
                stale.append(target)
                if not opts.check:
                    shutil.copyfile(path, target)
    verb = "stale" if opts.check else "regenerated"
    for target in stale:
        print(f"{verb}: {target.relative_to(REPO_ROOT)}")
    if opts.check and stale:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
