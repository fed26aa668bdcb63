"""The public API is typed: every public function and method of the
package's public classes annotates its parameters and its result."""
import inspect

import dpclip
import dpclip.data
import dpclip.losses
import dpclip.torch

PUBLIC = [dpclip.Client, dpclip.Step, dpclip.DpclipError, dpclip.lib,
          dpclip.torch.PrivacyEngine, dpclip.torch.DPOptimizer, dpclip.torch.make_private,
          dpclip.torch.fresh_job_id, dpclip.losses.reduce_loss,
          dpclip.losses.per_sample_cross_entropy, dpclip.losses.sequence_cross_entropy,
          dpclip.losses.cross_entropy,
          dpclip.data.DPDataLoader, dpclip.data.UniformWithReplacementSampler,
          dpclip.data.poisson_loader]


def _functions(obj):
    if not inspect.isclass(obj):
        yield obj.__qualname__, obj
        return
    for name, v in vars(obj).items():
        if name.startswith("_") and name not in ("__init__", "__enter__", "__exit__"):
            continue
        if isinstance(v, property):
            yield "%s.%s" % (obj.__name__, name), v.fget
        elif isinstance(v, (classmethod, staticmethod)):
            yield "%s.%s" % (obj.__name__, name), v.__func__
        elif inspect.isfunction(v):
            yield "%s.%s" % (obj.__name__, name), v


def test_public_api_is_annotated():
    missing = []
    for obj in PUBLIC:
        for name, fn in _functions(obj):
            sig = inspect.signature(fn)
            for p in sig.parameters.values():
                if p.name not in ("self", "cls") and p.annotation is inspect.Parameter.empty:
                    missing.append("%s(%s)" % (name, p.name))
            if sig.return_annotation is inspect.Signature.empty:
                missing.append("%s -> ?" % name)
    assert not missing, "unannotated: " + ", ".join(missing)
