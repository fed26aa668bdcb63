"""Fixtures: a real dpclipd per test session.

The daemon comes from $DPCLIPD, else <repo>/build/dpclipd (never another
build tree, never chosen by modification time); the library from
$DPCLIP_LIBRARY, else the package's own search (<repo>/build, then the
installed library; never a sanitizer build). It runs with
--insecure-fixed-seed (deterministic noise, for tests only) on a socket in a
temporary directory, reports READY on a pipe, as the C harness
(tests/support/harness.c) does, and is killed by the kernel if this process
dies first (PR_SET_PDEATHSIG), so a crashed or killed pytest leaves no
daemon behind.

dpclip.torch refuses such a daemon unless told otherwise: every engine the
tests make against it passes allow_insecure_seed=True explicitly (and warns
once). Code the tests run that is a user's (README.md's example, the
examples, the bench scripts) trains against `secure_daemon`, one started
without the fixed seed, which needs no such permission."""
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))  # the package, when not installed

_PR_SET_PDEATHSIG = 1


def find_dpclipd():
    env = os.environ.get("DPCLIPD")
    if env:
        return env
    built = os.path.join(REPO, "build", "dpclipd")
    if not os.path.exists(built):
        raise RuntimeError("dpclipd not found: set DPCLIPD or build the repository "
                           "(sh scripts/build.sh build)")
    return built


DPCLIPD = find_dpclipd()


def _die_with_parent(parent):
    """preexec_fn of the daemon: SIGTERM (its clean shutdown) when the
    process that started it dies, however it dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # it died before the prctl
        os._exit(1)


class Daemon:
    """A dpclipd child process; stop() asks it to exit (SIGTERM) and returns
    its exit status."""

    def __init__(self, extra=(), env=None, fixed_seed=True, stderr=None):
        self.dir = tempfile.mkdtemp(prefix="dpclip-pytest.")
        self.socket = os.path.join(self.dir, "d.sock")
        self.insecure = fixed_seed
        seed = ["--insecure-fixed-seed", "1234"] if fixed_seed else []
        r, w = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [DPCLIPD, "--socket", self.socket, "--ready-fd", str(w),
                 *seed, "--log-level", "warn", "--workers", "2",
                 "--ledger-dir", "",  # in-memory ledger: no state directory needed
                 "--config", "/dev/null",  # not a config file installed on this machine
                 # one daemon serves the whole session's tests, each a job
                 "--set", "ledger.max_jobs_per_uid=4096",
                 *extra], pass_fds=(w,), env=dict(os.environ, **(env or {})), stderr=stderr,
                preexec_fn=lambda p=os.getpid(): _die_with_parent(p))
        finally:
            os.close(w)
        got = b""
        deadline = time.monotonic() + 20
        while b"\n" not in got and time.monotonic() < deadline:
            ready, _, _ = select.select([r], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            chunk = os.read(r, 64)
            if not chunk:
                break
            got += chunk
        os.close(r)
        if got != b"READY\n":
            self.kill()
            raise RuntimeError("%s did not report READY (got %r)" % (DPCLIPD, got))

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._cleanup()
        return self.proc.returncode

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._cleanup()

    def _cleanup(self):
        try:
            os.unlink(self.socket)
        except FileNotFoundError:
            pass
        try:
            os.rmdir(self.dir)
        except OSError:
            pass


def run_rows(script, *args, python=sys.executable):
    """bench/SCRIPT (run_step_rows.sh, run_parallel_rows.sh) on the CPU
    (--cpu) against this build's dpclipd, its benches run by `python`: the
    finished process and its JSON lines."""
    env = dict(os.environ, DPCLIP_PYTHON=python)
    proc = subprocess.run(["sh", os.path.join(REPO, "bench", script), os.path.dirname(DPCLIPD),
                           "--cpu", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, timeout=600, env=env)
    return proc, [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")]


def pytest_configure(config):
    # the warning every engine against `daemon` gives once (test_insecure
    # records it with its own filter)
    config.addinivalue_line("filterwarnings",
                            "ignore:dpclip. dpclipd at .* runs with --insecure-fixed-seed")


@pytest.fixture(scope="session")
def daemon():
    d = Daemon()
    yield d
    # A clean shutdown is part of what the suite checks.
    assert d.stop() == 0, "dpclipd did not exit cleanly"


@pytest.fixture(scope="session")
def secure_daemon():
    """A daemon without --insecure-fixed-seed (noise from getrandom)."""
    d = Daemon(fixed_seed=False)
    yield d
    assert d.stop() == 0, "dpclipd did not exit cleanly"


@pytest.fixture
def fresh_daemon():
    d = Daemon()
    yield d
    d.kill()
