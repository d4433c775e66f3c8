"""The tier's way of ending a server, on a stand-in process tree (no vLLM needed): a group whose members ignore
SIGTERM is still gone after stop_group, and a server whose parent is SIGKILLed is told to die."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.peers.conftest import stop_group

ROOT = Path(__file__).parents[2]

# a parent that ignores SIGTERM and starts a child that ignores it too, printing the child's pid
STUBBORN = ("import signal, subprocess, sys, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])\n"
            "print(child.pid, flush=True)\n"
            "time.sleep(600)\n")


def _gone(pid: int, within_s: float = 10.0) -> bool:
    """The process has exited: no such pid, or a zombie (whoever reaps it, a container's init may not)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            pass
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def test_stop_group_kills_members_that_ignore_sigterm():
    process = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    child = int(process.stdout.readline())
    started = time.monotonic()
    stop_group(process, grace_s=0.5)
    assert process.poll() is not None and _gone(child)
    assert time.monotonic() - started < 10


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_server_dies_with_the_process_that_started_it():
    """The tests' process killed outright (SIGKILL runs no finalizer): the server it started gets SIGTERM."""
    starter = ("import subprocess, sys, time\n"
               "from tests.peers.conftest import _die_with_parent\n"
               "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True, "
               "preexec_fn=_die_with_parent)\n"
               "print(p.pid, flush=True)\n"
               "time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", starter], stdout=subprocess.PIPE, text=True,
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    server = int(parent.stdout.readline())
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    try:
        assert _gone(server)
    finally:
        try:
            os.kill(server, signal.SIGKILL)
        except ProcessLookupError:
            pass
