"""A module's registered parameter read as ``getattr`` reads it, at a fraction of its host time.

``norm.weight`` finds nothing in the instance or its class, so Python falls back on ``nn.Module.__getattr__``,
which looks through the module's parameters, buffers and submodules: about 0.6 us on the host, a third of an aten
op's, at every call of every patched norm (decode is bound by host time). ``registered_parameter`` reads the
parameter dictionary directly where ``getattr`` would end up there, and calls ``getattr`` otherwise.
"""

from __future__ import annotations

from typing import Any

from torch import nn

_NO_DEFAULT = object()
_ABSENT = object()


def registered_parameter(module: nn.Module, name: str, default: Any = _NO_DEFAULT) -> Any:
    """``getattr(module, name)`` (``getattr(module, name, default)`` with a default).

    Python looks an instance attribute up in the classes of the instance's type (a descriptor there, such as a
    property, wins), then in the instance's ``__dict__``, then in the classes again, and only then calls
    ``__getattr__``, which for an ``nn.Module`` returns the registered parameter of that name first. So where
    ``name`` is a registered parameter (None included) and neither the instance's ``__dict__`` nor the type (its
    classes, or its metaclass: ``getattr`` of the type, which torch.compile traces where it refuses to read a
    class's ``__dict__``) has it, ``getattr`` returns ``module._parameters[name]``; each of those conditions is
    read here at every call (a class attribute added later counts)."""
    state = module.__dict__
    parameters = state["_parameters"]
    if name in parameters and name not in state and getattr(type(module), name, _ABSENT) is _ABSENT:
        return parameters[name]
    return getattr(module, name) if default is _NO_DEFAULT else getattr(module, name, default)
