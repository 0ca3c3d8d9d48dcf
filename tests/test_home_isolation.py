"""The suite leaves the user's qserve home and chat history alone (issue 20, item 7): its
QSERVE_HOME is the repository's .cache/qserve (or $QSERVE_TEST_HOME), which must be neither
the home qserve would use for the person running the suite nor inside it, and the chat REPL
keeps no history. tests/conftest.py reads the user's home before it points the suite away."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import conftest
from qserve.chat import history_path
from qserve.config import model_home


def _overlap(a: Path, b: Path) -> bool:
    a, b = a.expanduser().resolve(), b.expanduser().resolve()
    return a == b or a in b.parents or b in a.parents


def test_the_suite_home_is_not_the_users():
    suite, user = model_home(), conftest.USER_QSERVE_HOME
    assert not _overlap(suite, user), (
        f"the suite's QSERVE_HOME {suite} is, holds or lies in your qserve home {user}; set "
        f"QSERVE_TEST_HOME to another directory (or leave QSERVE_HOME unset)")
    assert os.environ["QSERVE_HOME"] == str(suite)  # what subprocesses inherit, too


def test_the_suite_keeps_no_chat_history():
    assert history_path() is None and os.environ["QSERVE_CHAT_HISTORY"] == ""
    if conftest.USER_CHAT_HISTORY is not None:  # not even by way of the suite's home
        assert not _overlap(model_home() / "chat_history", conftest.USER_CHAT_HISTORY)


def test_the_users_home_is_read_before_the_suite_moves_it(tmp_path):
    """conftest's USER_* come from the environment the suite started in: with QSERVE_HOME set
    to a user's directory, that directory is what conftest reports, and the suite's own home
    is elsewhere."""
    user = tmp_path / "user-home"
    code = ("import os, sys; sys.path.insert(0, 'tests'); import conftest; "
            "print(conftest.USER_QSERVE_HOME); print(conftest.USER_CHAT_HISTORY); "
            "print(os.environ['QSERVE_HOME']); print(repr(os.environ['QSERVE_CHAT_HISTORY']))")
    env = {k: v for k, v in os.environ.items()
           if k not in ("QSERVE_TEST_HOME", "QSERVE_CHAT_HISTORY")}
    env["QSERVE_HOME"] = str(user)
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=conftest.REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [str(user), str(user / "chat_history"),
                                     str(conftest.REPO / ".cache" / "qserve"), "''"]
