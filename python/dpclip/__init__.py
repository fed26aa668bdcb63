"""dpclip: differentially private training through the dpclipd daemon.

The C client library (libdpclip) is bound with ctypes in dpclip._lib; the
PyTorch integration is dpclip.torch (make_private, PrivacyEngine) and the
Poisson-sampling loader dpclip.data. Importing this package loads libdpclip
and checks that it is this release with these struct sizes (an ImportError
says which library was refused and why); it does not import torch.
"""
from ._lib import Client, DpclipError, PerformanceWarning, Step, lib
from ._version import __version__

try:
    lib()
except OSError as _e:
    raise ImportError(str(_e), name=__name__) from None

__all__ = ["Client", "DpclipError", "PerformanceWarning", "Step", "lib", "__version__"]
