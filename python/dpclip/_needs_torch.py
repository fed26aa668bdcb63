"""Imported before torch by the modules that need it (dpclip.torch,
dpclip.data, dpclip.losses): where torch is missing, say which python3 has
it. scripts/deps.sh installs Debian's python3-torch, which only
/usr/bin/python3 imports; a python3 earlier on PATH (pyenv, a venv) fails
with a bare "No module named 'torch'"."""
import sys

DEBIAN_PYTHON = "/usr/bin/python3"

try:
    import torch  # noqa: F401
except ModuleNotFoundError as e:
    if e.name != "torch":
        raise
    raise ModuleNotFoundError(
        "No module named 'torch' in %s: dpclip's PyTorch integration needs it. Debian's "
        "python3-torch (what scripts/deps.sh installs) is for %s: run your script with %s "
        "(e.g. %s examples/train_transformer.py), or install torch for this python"
        % (sys.executable, DEBIAN_PYTHON, DEBIAN_PYTHON, DEBIAN_PYTHON), name="torch") from None
