"""Generate the Python code for ``proto/v1/*.proto`` (``make proto``), or check it is current.

    python proto/generate.py          # regenerate proto/v1/*_pb2*.py and *.pyi
    python proto/generate.py --check  # exit 1 when the committed code is stale (CI)

The .proto files import each other as ``kvpool/proto/v1/<name>.proto`` so that the generated
modules import ``kvpool.proto.v1``, the installed package name of this folder.

It runs with the generator pinned in ``proto/requirements.txt`` (``make`` builds .venv-proto
for it) and refuses another version: the generated code's own runtime checks (protobuf >= the
protoc that wrote it, grpcio >= grpcio-tools) decide the lowest versions kvpool can claim.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")
PINNED = HERE / "requirements.txt"


def _wrong_tools() -> list[str]:
    """The pinned generator packages whose installed version differs from the pin."""
    from importlib.metadata import PackageNotFoundError, version

    wrong = []
    for raw in PINNED.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if "==" not in line:
            continue
        name, want = (part.strip() for part in line.split("==", 1))
        try:
            have = version(name)
        except PackageNotFoundError:
            have = "not installed"
        if have != want:
            wrong.append(f"{name} {have} (pinned: {want})")
    return wrong


def _generate(out: Path) -> list[Path]:
    from grpc_tools import protoc  # dev extra

    include = out / "include"
    package = include / "kvpool" / "proto" / "v1"
    package.mkdir(parents=True)
    for proto in sorted(SOURCE.glob("*.proto")):
        shutil.copy(proto, package / proto.name)
    gen = out / "gen"
    gen.mkdir()
    protos = [str(p.relative_to(include)) for p in sorted(package.glob("*.proto"))]
    well_known = Path(protoc.__file__).resolve().parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{include}",
        f"-I{well_known}",
        f"--python_out={gen}",
        f"--grpc_python_out={gen}",
        f"--mypy_out={gen}",
        f"--mypy_grpc_out={gen}",
        *protos,
    ]
    # protoc finds the mypy plugins (protoc-gen-mypy*) on PATH, next to this interpreter.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((gen / "kvpool" / "proto" / "v1").iterdir())


def _committed() -> dict[str, Path]:
    return {p.name: p for p in SOURCE.iterdir() if p.name.endswith(GENERATED_SUFFIXES)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if generated code is stale")
    args = parser.parse_args(argv)
    wrong = _wrong_tools()
    if wrong:
        print(
            "proto/generate.py needs the generator pinned in proto/requirements.txt: "
            + ", ".join(wrong)
            + "\nrun it through `make proto` / `make proto-check` (they build .venv-proto)",
            file=sys.stderr,
        )
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.name: p for p in _generate(Path(tmp)) if p.name.endswith(GENERATED_SUFFIXES)}
        committed = _committed()
        if args.check:
            stale = sorted(
                name
                for name in fresh.keys() | committed.keys()
                if name not in fresh
                or name not in committed
                or not filecmp.cmp(fresh[name], committed[name], shallow=False)
            )
            if stale:
                print(
                    "generated protobuf code is stale: "
                    + ", ".join(stale)
                    + "\nrun `make proto` and commit the result",
                    file=sys.stderr,
                )
                return 1
            print(f"protobuf code is current ({len(fresh)} files)")
            return 0
        for name in committed.keys() - fresh.keys():
            committed[name].unlink()
        for name, path in fresh.items():
            shutil.copy(path, SOURCE / name)
        print(f"generated {len(fresh)} files in {SOURCE}")
        return 0


if __name__ == "__main__":
    sys.exit(main())
