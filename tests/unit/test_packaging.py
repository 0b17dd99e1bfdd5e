"""The folder -> package mapping is written once, in pyproject.toml's package-dir: the
``packages`` list beside it names every package folder under it, the type-checking mirror
(.ci/linktree.py) is built from it, and the README's table lists every mapping."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _setuptools() -> dict[str, object]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        table: dict[str, object] = tomllib.load(f)["tool"]["setuptools"]
    return table


def _package_dir() -> dict[str, str]:
    package_dir = _setuptools()["package-dir"]
    assert isinstance(package_dir, dict)
    return package_dir


def _package_folders() -> dict[str, Path]:
    """Every folder holding Python code under a mapped folder, by the package it installs as."""
    out: dict[str, Path] = {}
    for package, folder in _package_dir().items():
        top = ROOT / folder
        for path in [top, *sorted(p for p in top.rglob("*") if p.is_dir())]:
            if "__pycache__" in path.parts or not any(path.glob("*.py")):
                continue
            out[".".join([package, *path.relative_to(top).parts])] = path
    return out


def test_the_packages_list_names_every_package_folder_and_nothing_else() -> None:
    folders = _package_folders()
    packages = _setuptools()["packages"]
    assert isinstance(packages, list)
    assert sorted(packages) == sorted(folders)
    assert len(packages) == len(set(packages))
    for package, path in folders.items():
        assert (path / "__init__.py").is_file(), f"{package}: {path} has no __init__.py"


def test_the_typecheck_mirror_holds_every_package(tmp_path: Path) -> None:
    out = tmp_path / "tree"
    subprocess.run([sys.executable, str(ROOT / ".ci" / "linktree.py"), str(out)], check=True)
    for package in _package_folders():
        init = out / package.replace(".", "/") / "__init__.py"
        assert init.is_symlink(), package
    assert sorted(p.name for p in out.iterdir()) == ["kvpool"]


def test_the_readme_table_lists_every_mapping() -> None:
    readme = (ROOT / "README.md").read_text()
    for package, folder in _package_dir().items():
        assert f"| `{folder}/` | `{package}` |" in readme, package
