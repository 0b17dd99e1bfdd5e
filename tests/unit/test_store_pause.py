"""The engine backends' pause after a failed store (SGLang's and LMCache's ``retry_after_s``)
and its setting, without an engine: a clock the test moves."""

from __future__ import annotations

import pytest

from kvpool.client.pause import StorePause
from kvpool.errors import ConfigError
from kvpool.integrations.sglang_config import DEFAULT_RETRY_AFTER_S, parse_settings
from kvpool.logs import get_logger


def test_a_failed_store_is_left_alone_for_retry_after_s_then_asked_again() -> None:
    now = [100.0]
    pause = StorePause(5.0, clock=lambda: now[0])
    assert not pause.paused()
    pause.failed()
    assert pause.paused()
    now[0] += 4.9
    assert pause.paused()
    now[0] += 0.2
    assert not pause.paused()
    pause.failed()  # asked again, failed again: another whole pause from now
    now[0] += 4.9
    assert pause.paused()
    assert pause.pauses == 2


def test_retry_after_zero_never_pauses() -> None:
    pause = StorePause(0.0, clock=lambda: 1.0)
    pause.failed()
    assert not pause.paused()
    assert pause.pauses == 0


def test_sglangs_retry_after_s_setting_is_read_and_checked() -> None:
    log = get_logger("test")
    assert parse_settings({"masters": "h:1"}, log).retry_after_s == DEFAULT_RETRY_AFTER_S
    assert parse_settings({"masters": "h:1", "retry_after_s": 0}, log).retry_after_s == 0.0
    assert parse_settings({"masters": "h:1", "retry_after_s": 2.5}, log).retry_after_s == 2.5
    for bad in (-1, "soon", True, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="retry_after_s"):
            parse_settings({"masters": "h:1", "retry_after_s": bad}, log)
