"""The examples with gradient accumulation (issue 39) run against the
suite's (secure) daemon: the pipeline under both schedules with 8
micro-batches per logical step, and the GPT-2 fine-tuning example with a
logical batch split into physical ones, on a stand-in for transformers
(the suite has none) that builds models.GPT2Like from the GPT2Config the
example makes."""
import math
import os
import re
import subprocess
import sys

import pytest

from conftest import HERE, REPO

_TRANSFORMERS = '''"""A stand-in for transformers (tests only): GPT2LMHeadModel is
models.GPT2Like, of the config's sizes, its output's .logits."""
import sys
import torch.nn as nn
sys.path.insert(0, %(tests)r)
from models import GPT2Like


class GPT2Config:
    def __init__(self, vocab_size, n_positions, n_embd, n_layer, n_head):
        self.vocab_size, self.n_positions = vocab_size, n_positions
        self.n_embd, self.n_layer, self.n_head = n_embd, n_layer, n_head


class _Output:
    def __init__(self, logits):
        self.logits = logits


class GPT2LMHeadModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transformer = GPT2Like(config.vocab_size, T=config.n_positions, d=config.n_embd,
                                    heads=config.n_head, layers=config.n_layer)

    def forward(self, input_ids):
        return _Output(self.transformer(input_ids))
'''


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipeline_example_with_micro_batches(secure_daemon, schedule):
    p = subprocess.run([sys.executable, os.path.join(REPO, "examples", "train_pipeline.py"),
                        "--socket", secure_daemon.socket, "--steps", "12", "--microbatches",
                        "8", "--schedule", schedule], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "in 8 micro-batches (%s)" % schedule in p.stdout, p.stdout
    m = re.search(r"^epoch 1: loss ([0-9.]+), epsilon ([0-9.]+), ([0-9]+) tokens/s$", p.stdout,
                  re.M)
    assert m, p.stdout
    assert 0 < float(m.group(1)) < 10 and 0 < float(m.group(2)) < math.inf, m.group(0)
    assert "after 12 steps" in p.stdout, p.stdout


def test_gpt2_example_with_a_logical_batch_in_physical_ones(secure_daemon, tmp_path):
    """--logical-batch 256 --physical-batch 16 (each logical batch about 16
    micro-batches): 3 logical steps, their loss, epsilon and tokens/s
    printed."""
    (tmp_path / "transformers.py").write_text(_TRANSFORMERS % {"tests": HERE})
    # the example's own lines, not tqdm's bar (where tqdm is installed)
    (tmp_path / "tqdm.py").write_text('raise ImportError("the test reads the example lines")\n')
    p = subprocess.run([sys.executable, os.path.join(REPO, "examples", "train_hf_gpt2.py"),
                        "--socket", secure_daemon.socket, "--logical-batch", "256",
                        "--physical-batch", "16", "--steps", "3", "--seq", "16", "--d", "16",
                        "--layers", "1", "--heads", "2", "--log", "1", "--device", "cpu"],
                       env=dict(os.environ, PYTHONPATH=str(tmp_path)), capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "expected logical batch 256 in micro-batches of at most 16" in p.stdout, p.stdout
    lines = re.findall(r"^  step ([0-9]+): loss ([0-9.]+), epsilon ([0-9.]+), ([0-9]+) "
                       r"tokens/s$", p.stdout, re.M)
    assert [int(s) for s, _, _, _ in lines] == [1, 2, 3], p.stdout
    eps = [float(e) for _, _, e, _ in lines]
    assert 0 < eps[0] < eps[1] < eps[2] < math.inf, eps
    m = re.search(r"^epoch 1: loss ([0-9.]+), epsilon ([0-9.]+), ([0-9]+) tokens/s \(3 logical "
                  r"steps of ([0-9]+) windows on average", p.stdout, re.M)
    assert m, p.stdout
    assert 0 < float(m.group(1)) < 50 and int(m.group(3)) > 0, m.group(0)  # (a random init)
    assert 150 < int(m.group(4)) < 400, m.group(0)  # Poisson around 256
    assert "after 3 steps" in p.stdout, p.stdout


def test_transformer_example_with_physical_batches(secure_daemon):
    """examples/train_transformer.py --physical-batch 16: one epoch, one
    optimizer step per Poisson batch of expected size 64 (36 steps)."""
    p = subprocess.run([sys.executable, os.path.join(REPO, "examples", "train_transformer.py"),
                        "--socket", secure_daemon.socket, "--epochs", "1", "--physical-batch",
                        "16", "--d", "32", "--layers", "1"], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    m = re.search(r"^epoch 1: train loss ([0-9.]+), held-out loss ([0-9.]+), clipped "
                  r"([0-9]+)% of samples, [0-9.]+ s, epsilon ([0-9.]+)$", p.stdout, re.M)
    assert m, p.stdout
    assert 0 < float(m.group(1)) < 10 and 0 < float(m.group(4)) < math.inf, m.group(0)
    assert re.search(r"after 36 steps", p.stdout), p.stdout
