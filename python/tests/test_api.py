"""The public API is typed: every public function and method of the
package's public classes annotates its parameters and its result; so does
every function (nested ones too) of the internal modules that are typed
throughout."""
import ast
import inspect
import os

import pytest

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


# The internal modules annotated throughout (issue 42: _layers, _conv and
# _parallel joined the others; then _fsdp_io, _host, _mha, _registry, data,
# pipeline and torch, so every module). A module leaves this list only with a reason.
TYPED_MODULES = ["__init__", "_accumulate", "_batches", "_collect", "_conv", "_cuda", "_flags",
                 "_fsdp", "_gate", "_group", "_guard", "_host", "_layers", "_lib", "_linfn",
                 "_loader", "_mha", "_modes", "_needs_torch", "_optimizer", "_outputs",
                 "_parallel", "_params", "_planner", "_registry", "_relbias", "_rows", "_shards",
                 "_tablerows", "_terms", "_transport", "_verify", "_version", "data", "losses",
                 "pipeline", "torch"]


def unannotated(source):
    """Every parameter (bar a method's self or cls) and result of every def
    in source, nested ones too, that has no annotation: "line name(param)"
    or "line name -> ?"."""
    missing = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        a = node.args
        params = a.posonlyargs + a.args + a.kwonlyargs + [p for p in (a.vararg, a.kwarg) if p]
        for i, p in enumerate(params):
            if i == 0 and p.arg in ("self", "cls"):
                continue
            if p.annotation is None:
                missing.append("%d %s(%s)" % (node.lineno, node.name, p.arg))
        if node.returns is None:
            missing.append("%d %s -> ?" % (node.lineno, node.name))
    return missing


def test_unannotated_finds_what_it_should():
    src = ("def f(a: int, *args, k=1, **kw) -> None:\n"
           "    def g(x: int):\n"
           "        pass\n"
           "class C:\n"
           "    def m(self, y: int) -> int:\n"
           "        return y\n"
           "    @classmethod\n"
           "    def c(cls) -> None:\n"
           "        pass\n")
    assert unannotated(src) == ["1 f(k)", "1 f(args)", "1 f(kw)", "2 g -> ?"]


def test_typed_modules_are_every_module():
    here = os.path.dirname(dpclip.__file__)
    names = sorted(f[:-3] for f in os.listdir(here) if f.endswith(".py"))
    assert sorted(TYPED_MODULES) == names


@pytest.mark.parametrize("name", TYPED_MODULES)
def test_internal_module_is_annotated(name):
    path = os.path.join(os.path.dirname(dpclip.__file__), name + ".py")
    with open(path, encoding="utf-8") as f:
        missing = unannotated(f.read())
    assert not missing, "dpclip/%s.py: unannotated: %s" % (name, ", ".join(missing))
