"""Mirror the installed package layout as a tree of symlinks under .typecheck/kvpool.

The top-level folders are installed as kvpool.client, kvpool.raft_master, ... (setuptools
package-dir). Static tools (mypy, import-linter) read files, not the editable install's import
hook, so they are pointed at this mirror: real directories, each file a symlink to its source.
The folder -> package mapping is read from pyproject.toml's [tool.setuptools] package-dir, the
one place it is written.
"""

from __future__ import annotations

import os
import shutil
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def mapping(root: Path = ROOT) -> dict[str, str]:
    """Source folder -> its path in the installed tree ("client" -> "kvpool/client"), from
    pyproject.toml's package-dir (installed package name -> source folder)."""
    with (root / "pyproject.toml").open("rb") as f:
        package_dir: dict[str, str] = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {folder: package.replace(".", "/") for package, folder in package_dir.items()}


def main() -> int:
    out = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT / ".typecheck"
    shutil.rmtree(out, ignore_errors=True)
    for src_name, dst_name in mapping().items():
        src = ROOT / src_name
        if not src.is_dir():
            continue
        for path in src.rglob("*"):
            if "__pycache__" in path.parts or path.is_dir():
                continue
            if path.suffix not in (".py", ".pyi") and path.name != "py.typed":
                continue
            target = out / dst_name / path.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(path, target)
    print(f"linked the package tree into {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
