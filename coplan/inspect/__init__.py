"""Compiler visibility: what ``torch.compile`` did to a training step, pass by pass, and its history.

``coplan.inspect(module, example_inputs, ...)`` compiles one training step and returns an
``Inspection`` (see ``coplan.inspect.api.inspect_module``). The package is itself that callable, so
``coplan.inspect`` is both the function users call and the home of its parts (``history``,
``diff``, ``dashboard``); torch is imported only when a step is inspected.
"""

from __future__ import annotations

import sys
import types
from typing import Any


class _CallableModule(types.ModuleType):
    def __call__(self, module: Any, example_inputs: Any = (), *args: Any, **kwargs: Any) -> Any:
        from coplan.inspect.api import inspect_module

        return inspect_module(module, example_inputs, *args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
