"""The done flags' shared words (dpclip._cuda.CudaIPC.done_flag) and what
the trainer needs to know before it may release one itself: whether the
daemon stored it, gave up the step's outputs (its abandon word), or is
gone (its process, found from the socket's peer). docs/protocol.md, "Done
flag"."""
import ctypes
import os
import socket
import struct
from typing import Optional, Tuple

import torch

from ._layers import _tref

# a done flag's shared memory: one page (the flag, then its abandon word)
_FLAG_BYTES = 4096
# where the daemon's pid is hidden (another pid namespace): how long a hang
# up waits for the daemon to store its flags before taking it for gone
_UNKNOWN_PEER_S = 10.0


class _Flag:
    """One device's done flag (CudaIPC.done_flag): its shared buffer, the
    words' address here and the flag's on the device, its reference for
    the daemon ([2]: the flag and its abandon word, docs/protocol.md "Done
    flag"), and the last value a notice gave (what release_flags stores)."""
    __slots__ = ("buffer", "addr", "dev", "ref", "last")

    def __init__(self, buffer: int, addr: int, dev: int) -> None:
        self.buffer, self.addr, self.dev = buffer, addr, dev
        self.ref = _tref(buffer, 0, torch.int32, (2,))
        self.last = 0

    def word(self, i: int) -> int:
        return ctypes.c_uint32.from_address(self.addr + 4 * i).value

    def stored(self) -> bool:
        """The flag holds the last notice's value (a cyclic >=, as the
        stream's wait reads it)."""
        return (self.word(0) - self.last) & 0xFFFFFFFF < 0x80000000

    def abandoned(self) -> bool:
        """The daemon gave up the last step's outputs (it could not zero
        them) and will never store the flag."""
        return self.last != 0 and self.word(1) == self.last


def _proc(pid: int) -> Optional[Tuple[str, str]]:
    """(state, start time) of process pid, from /proc; None: no such process."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            rest = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return rest[0], rest[19]


def _peer(fd: int) -> Optional[Tuple[int, str]]:
    """The pid and start time of the process at the other end of the Unix
    socket fd (the daemon); None where its pid is hidden (another pid
    namespace)."""
    s = socket.socket(fileno=os.dup(fd))
    try:
        pid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
    except OSError:
        return None
    finally:
        s.close()
    p = _proc(pid) if pid > 0 else None
    return (pid, p[1]) if p is not None else None


def _gone(peer: Tuple[int, str]) -> bool:
    """The daemon's process has ended (a zombie included: its CUDA context
    went with its memory), or its pid is another process's now."""
    p = _proc(peer[0])
    return p is None or p[1] != peer[1] or p[0] in ("Z", "X")
