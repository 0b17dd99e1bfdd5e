"""Without the llm extra: importing the engine works, building a model and `kvpool demo chat`
say how to install torch and transformers (run in a child interpreter that cannot import
them, so it runs whether or not they are installed here)."""

from __future__ import annotations

import subprocess
import sys

BLOCKED = "import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"


def _child(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCKED + code],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_demo_command_says_how_to_install_torch_when_missing() -> None:
    done = _child("from kvpool.cli import main\nsys.exit(main(['demo', 'chat', '--quick']))")
    assert done.returncode == 2, done.stderr
    assert "pip install 'kvpool[llm]'" in done.stderr
    assert "torch and transformers" in done.stderr


def test_the_engine_imports_without_torch_and_refuses_to_build_a_model() -> None:
    done = _child(
        "import kvpool.engine.chat, kvpool.engine.engine, kvpool.compat.mooncake\n"
        "from kvpool.engine.model import TEST_SPEC, LlmUnavailableError\n"
        "try:\n"
        "    TEST_SPEC.build()\n"
        "except LlmUnavailableError as e:\n"
        "    print('refused:', e)\n"
    )
    assert done.returncode == 0, done.stderr
    assert "refused: the example engine needs torch and transformers" in done.stdout
