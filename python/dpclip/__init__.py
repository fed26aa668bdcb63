"""dpclip: differentially private training through the dpclipd daemon.

The C client library (libdpclip) is bound with ctypes in dpclip._lib; the
PyTorch integration is dpclip.torch (make_private, PrivacyEngine) and the
Poisson-sampling loader dpclip.data. Importing this package does not import
torch.
"""
from ._lib import Client, DpclipError, Step, lib

__version__ = "0.1.0"
__all__ = ["Client", "DpclipError", "Step", "lib", "__version__"]
