"""The ``torch.library`` namespace of the package's operators, named after the code that defines them.

torch.compile keeps what it compiled on disk, between processes (AOTAutograd's cache and inductor's FX graph cache,
under ``TORCHINDUCTOR_CACHE_DIR``, by default in the system's temporary directory). It keys a compiled graph on the
graph dynamo traced, in which a custom op appears by its name alone. What the op's registered backward traces into
the cached backward graph, and what a Triton op's launch code traces into either graph, is not part of the key
(pytorch/pytorch#144344). Under a fixed name, a new version of this package would find the old version's compiled
graphs: a backward calling an operator with arguments it no longer takes, or, worse, silently the old gradient.

So the namespace is ``hf_rmsnorm_<digest>``, the digest of every source and data file of this package (``ops``: the
kernels, their launch, the plans, the registered forwards and backwards): code that changed compiles afresh, code
that did not keeps its cache hits. Code outside ``ops`` (the patcher) reaches compiled graphs only through what
dynamo traces of it, which the key holds.
"""

from __future__ import annotations

import hashlib
from importlib import resources
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

_SOURCE_SUFFIXES = (".py", ".json")


def source_digest(package: Traversable) -> str:
    """A digest of the contents of ``package``'s source and data files, by name: whatever changes one changes it."""
    digest = hashlib.sha256()
    for entry in sorted(package.iterdir(), key=lambda e: e.name):
        if entry.is_file() and entry.name.endswith(_SOURCE_SUFFIXES):
            digest.update(entry.name.encode() + b"\0" + entry.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


NAMESPACE = f"hf_rmsnorm_{source_digest(resources.files(__package__))}"


def qualified_name(name: str) -> str:
    """``namespace::name``, as ``torch.library`` registers an operator."""
    return f"{NAMESPACE}::{name}"


def op(name: str) -> torch._ops.OpOverloadPacket:
    """The registered operator ``name`` (``torch.ops.<namespace>.<name>``)."""
    return getattr(getattr(torch.ops, NAMESPACE), name)
