"""Where the daemon's time goes, from its status socket's /metrics: the
per-phase histograms dpclip_step_phase_seconds (validate, ledger, queue,
wait_input, run, reply; and run's parts as the backend times them: norms,
reduction, clipping, noise). A bench reads them before and after its
private rounds and prints the mean per step of each (ms).

    before = daemon_phases.read(socket)       # None: no status socket
    ...
    daemon_phases.mean_ms(before, daemon_phases.read(socket))
"""
import http.client
import os
import re
import socket
import sys
from typing import Dict, Optional, Tuple

_LINE = re.compile(r'^dpclip_step_phase_seconds_(sum|count)\{phase="([a-z_]+)"\} (\S+)$')
_HELD = re.compile(r'^dpclip_gpu_(workspace|kept)_bytes\{device="\d+"\} (\S+)$', re.M)


def status_path(sock: Optional[str]) -> str:
    """The daemon's status socket for its request socket `sock` (default
    $DPCLIP_SOCKET), as dpclipd derives it: "X.sock" -> "X-status.sock"."""
    sock = sock or os.environ.get("DPCLIP_SOCKET", "/run/dpclip/dpclipd.sock")
    base = sock[:-5] if sock.endswith(".sock") and len(sock) > 5 else sock
    return base + "-status.sock"


class _UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=5)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        self.sock.connect(self.path)


def _metrics(sock: Optional[str]) -> Optional[str]:
    try:
        c = _UnixHTTP(status_path(sock))
        c.request("GET", "/metrics")
        text = c.getresponse().read().decode()
        c.close()
    except OSError as e:
        print("daemon_phases: no metrics from %s: %s" % (status_path(sock), e), file=sys.stderr)
        return None
    return text


def held_bytes(sock: Optional[str]) -> Optional[Tuple[int, int]]:
    """Bytes of device memory the daemon serving `sock` holds over its GPUs,
    as (workspace, kept stores) (dpclip_gpu_workspace_bytes, whose kept
    per-sample gradients of whole steps are in it, and
    dpclip_gpu_kept_bytes, those of norm groups' phases, outside it), or
    None where its status socket does not answer."""
    text = _metrics(sock)
    if text is None:
        return None
    got = {"workspace": 0, "kept": 0}
    for m in _HELD.finditer(text):
        got[m.group(1)] += int(float(m.group(2)))
    return got["workspace"], got["kept"]


def workspace_bytes(sock: Optional[str]) -> Optional[int]:
    """All the device memory the daemon serving `sock` holds (held_bytes'
    two parts), or None where its status socket does not answer."""
    held = held_bytes(sock)
    return None if held is None else sum(held)


def read(sock: Optional[str]) -> Optional[Dict[str, Tuple[float, float]]]:
    """{phase: (seconds summed, steps counted)} from the daemon serving
    `sock`, or None where its status socket does not answer."""
    text = _metrics(sock)
    if text is None:
        return None
    out: Dict[str, list] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            out.setdefault(m.group(2), [0.0, 0.0])[0 if m.group(1) == "sum" else 1] = \
                float(m.group(3))
    return {k: (v[0], v[1]) for k, v in out.items()}


def mean_ms(before: Optional[Dict[str, Tuple[float, float]]],
            after: Optional[Dict[str, Tuple[float, float]]]) -> Optional[Dict[str, float]]:
    """Each phase's mean ms per step it timed between two read()s."""
    if before is None or after is None:
        return None
    out = {}
    for k, (s, n) in after.items():
        s0, n0 = before.get(k, (0.0, 0.0))
        if n > n0:
            out[k] = round((s - s0) / (n - n0) * 1e3, 4)
    return out
