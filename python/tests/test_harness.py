"""The fixtures' daemon (conftest.Daemon): it does not outlive the pytest
that started it, however that process ends."""
import os
import signal
import subprocess
import sys
import time

from conftest import HERE


def _alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")  # a zombie waiting for init has exited


def test_a_killed_pytest_leaves_no_daemon():
    """A test process that starts a daemon and is killed (SIGKILL: no
    teardown, no atexit) takes the daemon with it."""
    code = ("import os, signal, sys; sys.path.insert(0, %r); import conftest; "
            "d = conftest.Daemon(); print(d.proc.pid, flush=True); "
            "os.kill(os.getpid(), signal.SIGKILL)" % HERE)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr
    pid = int(p.stdout.split()[0])
    deadline = time.monotonic() + 60  # a bound for a hang, not a timing
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _alive(pid)
    if alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, "dpclipd %d outlived the pytest that started it" % pid
