"""The optimizer wrapper of the PyTorch integration: step() first has the
engine (dpclip.torch.PrivacyEngine) fill param.grad with the private
gradient, then runs the wrapped optimizer's step."""
import collections
from typing import Any, Callable, Dict, List, Optional

import torch

from . import _batches


class DPOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer: step() first has the engine fill param.grad with
    the private gradient, then runs the wrapped optimizer's step. State,
    param_groups and defaults are the wrapped optimizer's (LR schedulers
    work on either)."""

    def __init__(self, optimizer: torch.optim.Optimizer,
                 engine: Any) -> None:  # pylint: disable=super-init-not-called
        # engine: the dpclip.torch.PrivacyEngine (which imports this module)
        # Optimizer.__init__ would rebuild param_groups; share the wrapped ones.
        self.original_optimizer = optimizer
        self.engine = engine
        self._optimizer_step_pre_hooks: Dict[int, Callable] = collections.OrderedDict()
        self._optimizer_step_post_hooks: Dict[int, Callable] = collections.OrderedDict()

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self.original_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, v: List[Dict[str, Any]]) -> None:
        self.original_optimizer.param_groups = v

    @property
    def state(self) -> Dict[Any, Any]:
        return self.original_optimizer.state

    @state.setter
    def state(self, v: Dict[Any, Any]) -> None:
        self.original_optimizer.state = v

    @property
    def defaults(self) -> Dict[str, Any]:
        return self.original_optimizer.defaults

    @defaults.setter
    def defaults(self, v: Dict[str, Any]) -> None:
        self.original_optimizer.defaults = v

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears param.grad and what the engine captured; in the middle
        of a logical step (several backwards before one step()) that drops
        the logical step, with a warning. Inside engine.logical_batches(),
        a no-op after a skipped step (the logical batch goes on)."""
        if _batches.skip_zero_grad(self.engine._batches):  # pylint: disable=protected-access
            return
        self.engine.clear()
        self.original_optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Fills param.grad with the private gradient (committing the
        logical step of every backward since the last step) and steps the
        wrapped optimizer. Inside engine.logical_batches(), a no-op except
        after a logical batch's last micro-batch."""
        if closure is not None:
            with torch.enable_grad():
                closure()
        if _batches.skip_step(self.engine._batches):  # pylint: disable=protected-access
            return None
        # the engine refuses (fail closed) where one of these holds a
        # gradient it did not compute
        self.engine.step(params=(p for g in self.param_groups for p in g["params"]))
        return self.original_optimizer.step()

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        self.original_optimizer.add_param_group(param_group)

    def state_dict(self) -> Dict[str, Any]:
        return self.original_optimizer.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.original_optimizer.load_state_dict(state_dict)

    def __getstate__(self) -> Dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return "DPOptimizer(%r)" % (self.original_optimizer,)
