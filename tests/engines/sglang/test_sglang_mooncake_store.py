"""SGLang's own Mooncake backend test, unchanged, on kvpool's Mooncake API.

``sglang/srt/mem_cache/storage/mooncake_store/test_mooncake_store.py`` (5 cases: a single
set/exists/get and four batch_set_v1/batch_exists/batch_get_v1 runs for MHA and MLA at several
TP ranks) is run from SGLang's installed package, as its ``__main__`` runs it, with the
``mooncake`` package of ``shim/`` first on ``PYTHONPATH`` (``mooncake.store`` is
:mod:`kvpool.compat.mooncake`) and ``MOONCAKE_MASTER`` naming the kvpool masters: the way a
user points SGLang's Mooncake backend at kvpool. SGLang's ``MooncakeStore`` itself is unchanged
too: it is imported from the same installed package.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import sglang

from kvpool.launcher.cluster import LocalCluster

pytestmark = pytest.mark.integration

SHIM = Path(__file__).with_name("shim")
SGLANG_TEST = (
    Path(sglang.__file__).parent / "srt/mem_cache/storage/mooncake_store/test_mooncake_store.py"
)
CASES = 5


def test_sglangs_mooncake_store_test_passes_on_kvpool(sglang_cluster: LocalCluster) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SHIM), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["MOONCAKE_MASTER"] = ",".join(sglang_cluster.client_master_addresses)
    env.pop("MOONCAKE_PROTOCOL", None)  # SGLang's default, "rdma": kvpool runs it over TCP
    done = subprocess.run(
        [sys.executable, str(SGLANG_TEST)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-6000:]
    assert "kvpool/compat/mooncake" in log or "mooncake_setting_ignored" in log, (
        "the shim was not used: " + log[-2000:]
    )
    passed = log.count("Single operation passed") + log.count("Batch operation passed")
    print(f"SGLang test_mooncake_store.py on kvpool: {passed} of {CASES} cases passed")
    assert passed == CASES, log[-6000:]
    assert "All tests passed" in log
