"""The whole device's used memory (every process on it: a trainer and the
daemon, with the daemon's kept per-sample gradients), as the benches
report it.

    with DeviceMemory(device) as m:   # samples every 5 ms on a thread
        ...
    m.base, m.peak                    # bytes; 0 on a CPU device
"""
import threading

import torch


class DeviceMemory:
    """The device's used memory (all processes), sampled on a thread."""

    def __init__(self, device):
        self.device = device
        self.peak = 0
        self._stop = threading.Event()
        self._thread = None

    def used(self):
        if self.device.type != "cuda":
            return 0
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def __enter__(self):
        self.base = self.used()
        self.peak = self.base
        if self.device.type == "cuda":
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def _loop(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.used())

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, self.used())
