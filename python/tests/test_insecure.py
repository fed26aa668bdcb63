"""A daemon run with --insecure-fixed-seed (predictable noise) is surfaced:
dpclip.torch refuses to train against it unless allow_insecure_seed=True
is passed to PrivacyEngine (or to the make_private shorthand, which makes
one), and then warns once per engine. A daemon without the flag needs no
permission and gets no warning."""
import warnings

import pytest
import torch
import torch.nn as nn

import dpclip
from dpclip import _lib
from dpclip.torch import PrivacyEngine, make_private


def _insecure_warnings(record):
    return [w for w in record if "insecure-fixed-seed" in str(w.message)]


def test_client_reports_the_flag(daemon, secure_daemon):
    assert daemon.insecure and not secure_daemon.insecure
    with dpclip.Client(daemon.socket) as c:
        assert c.insecure
    with dpclip.Client(secure_daemon.socket) as c:
        assert not c.insecure


def test_insecure_daemon_refused_by_default(daemon):
    with pytest.raises(dpclip.DpclipError) as ei:
        PrivacyEngine(daemon.socket)
    assert ei.value.code == _lib.EPERM
    msg = str(ei.value)
    assert "--insecure-fixed-seed" in msg and "allow_insecure_seed=True" in msg and \
        daemon.socket in msg
    model = nn.Linear(3, 2)
    with pytest.raises(dpclip.DpclipError, match="allow_insecure_seed"):
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0,
                     max_grad_norm=1.0, socket_path=daemon.socket, expected_batch_size=4)


def test_allowed_insecure_daemon_warns_once(daemon):
    """Allowed: one UserWarning for the engine, at its connection; none for
    its steps."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        engine = PrivacyEngine(daemon.socket, allow_insecure_seed=True)
        model = nn.Linear(3, 2)
        model, opt, _ = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4)
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(4, 3)).sum().backward()
            opt.step()
        engine.close()
    got = _insecure_warnings(record)
    assert len(got) == 1, [str(w.message) for w in record]
    assert issubclass(got[0].category, UserWarning) and daemon.socket in str(got[0].message)
    assert engine.steps == 2


def test_secure_daemon_needs_no_permission(secure_daemon):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        engine = PrivacyEngine(secure_daemon.socket)
        model = nn.Linear(3, 2)
        model, opt, _ = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4)
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        engine.close()
    assert not _insecure_warnings(record)
