"""What README.md and python/README.md tell a user to run works as written:
the PyTorch example, for a classifier and for a sequence model; the
commands name the python3 that holds Debian's torch; and a python3 without
torch says which one does."""
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import REPO
from models import SeqModel

DOCS = ("README.md", "python/README.md")


def _read(rel):
    with open(os.path.join(REPO, rel)) as f:
        return f.read()


def _example(rel):
    """The first ```python block of a document."""
    return re.search(r"```python\n(.*?)```", _read(rel), re.S).group(1)


def _models():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(48, 10, generator=g), torch.randint(0, 4, (48,), generator=g)
    yield "classifier", nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 4)), x, y
    tok = torch.randint(1, 11, (48, 6), generator=g)
    yield "sequence", SeqModel(), tok, torch.randint(0, 11, (48, 6), generator=g)


@pytest.mark.parametrize("doc", DOCS)
def test_pytorch_example_runs_for_classifiers_and_sequence_models(secure_daemon, monkeypatch, doc):
    monkeypatch.setenv("DPCLIP_SOCKET", secure_daemon.socket)
    code = _example(doc)
    for kind, model, x, y in _models():
        before = [p.detach().clone() for p in model.parameters()]
        ns = {"model": model, "loader": DataLoader(TensorDataset(x, y), batch_size=12)}
        exec(compile(code, "%s (%s)" % (doc, kind), "exec"), ns)  # pylint: disable=exec-used
        engine = ns["engine"]
        assert engine.steps == 4, (doc, kind)  # one epoch of the Poisson loader
        assert engine.last_epsilon > 0, (doc, kind)
        assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters())), kind
        engine.close()


def test_commands_name_the_python_that_has_debian_torch():
    """Every shell command of the docs, the quick start and the examples'
    usage lines that runs python3 runs /usr/bin/python3 (python3-torch's)."""
    texts = {rel: _read(rel) for rel in DOCS + ("scripts/quickstart.sh",
                                                "examples/train_transformer.py",
                                                "examples/train_pipeline.py")}
    bare = []
    for rel, text in texts.items():
        for line in text.splitlines():
            for m in re.finditer(r"(\S*)python3 (-m |\S+\.py)", line):
                if not m.group(1).endswith("/usr/bin/"):
                    bare.append("%s: %s" % (rel, line.strip()))
    assert not bare, "\n".join(bare)
    assert "/usr/bin/python3" in texts["scripts/quickstart.sh"]


def test_a_python_without_torch_says_which_python_has_it():
    """In a python3 that cannot import torch, importing dpclip's PyTorch
    modules names /usr/bin/python3 and python3-torch."""
    for mod in ("dpclip.torch", "dpclip.data", "dpclip.losses"):
        code = "import sys; sys.modules['torch'] = None; import %s" % mod
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=os.path.join(REPO, "python")),
                           timeout=120)
        assert p.returncode == 1, (mod, p.stderr)
        last = p.stderr.strip().splitlines()[-1]
        assert last.startswith("ModuleNotFoundError") and "/usr/bin/python3" in last and \
            "python3-torch" in last and sys.executable in last, (mod, last)


def test_scripts_with_a_shebang_are_executable():
    """What the docs run as ./examples/x.py or ./bench/x.py runs as written:
    every tracked script with a #! line has its executable bit."""
    listed = subprocess.run(["git", "-C", REPO, "ls-files", "-s", "examples", "bench", "scripts"],
                            capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout: %s" % listed.stderr.strip())
    wrong = []
    for line in listed.stdout.splitlines():
        mode, _, _, path = line.split(None, 3)
        with open(os.path.join(REPO, path), "rb") as f:
            if f.read(2) == b"#!" and mode != "100755":
                wrong.append(path)
    assert not wrong, "scripts with #! but no executable bit: %s" % ", ".join(wrong)


def test_supported_layer_lists_are_the_registry():
    """README.md and python/README.md list the layers the registry trains
    (scripts/layers_doc.py writes them): a kind added to the code, or a
    registration, fails here until the docs say so; and the list names what
    make_private takes."""
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import layers_doc
    from dpclip import _registry
    from dpclip.torch import supported_layers
    listing = _registry.supported_markdown()
    for rel in layers_doc.DOCS:
        text = _read(rel)
        assert layers_doc.render(text, listing) == text, \
            "%s: stale supported-layer list; run scripts/layers_doc.py" % rel
    names = [what for what, _ in supported_layers()]
    for cls in (nn.Linear, nn.Embedding, nn.LayerNorm, nn.Conv2d, nn.GroupNorm):
        assert "nn." + cls.__name__ in names
        assert _registry.supported_base(cls) is cls
    assert any("LlamaRMSNorm" in terms for _, terms in supported_layers())
