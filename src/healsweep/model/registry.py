"""The supported architectures, one module each, by ``general.architecture`` name.

Shared code (opening a file, writing one, the forward, healing) asks :func:`architecture` for
the :class:`~healsweep.model.arch.Architecture` of a model and never branches on its name.

Adding an architecture means adding one file, ``model/<name>.py``, and one test:

- the file subclasses :class:`~healsweep.model.arch.Architecture` (or ``RoutingFromFile`` when
  llama.cpp reads the routing from the file) and sets ``name`` (the ``general.architecture``
  value) and whichever static facts differ: ``rope_kind``, ``norm_topk_prob``,
  ``attention_kind``, ``ffn_norm``;
- it overrides the steps that differ: reading hparams (``read_shared_expert``,
  ``read_routing``, ``read_rope_scaling``, ``read_attention``, ``check_file``), writing them
  (``shared_expert_metadata``, ``attention_metadata``, ``routing_metadata``), the tensor layout
  (``attention_shapes``, ``router_shapes``), a random test model (``random_hparams``), what
  ``model info`` says (``attention_summary``) and the forward (``attention``, ``moe_block``);
- it ends with ``ARCH = TheClass()``, and the module is added to ``_MODULES`` below;
- the test compares its forward with llama.cpp's on a random file of it
  (``tests/test_arch_reference.py``: one entry in ``SHAPES`` and its deliberate errors).
"""

from __future__ import annotations

from types import MappingProxyType

from healsweep.errors import UnsupportedArchitectureError
from healsweep.model import deepseek2, glm4moe, llama, olmoe, qwen2moe, qwen3moe
from healsweep.model.arch import Architecture

_MODULES = (qwen2moe, qwen3moe, olmoe, llama, glm4moe, deepseek2)
ARCHITECTURES = MappingProxyType({m.ARCH.name: m.ARCH for m in _MODULES})
SUPPORTED_ARCHS = tuple(ARCHITECTURES)
GENERIC = Architecture()  # the shared layout: what a file of another architecture is written as


def architecture(name: str, *, where: object = None) -> Architecture:
    """The architecture called ``name``; :class:`UnsupportedArchitectureError` for another."""
    try:
        return ARCHITECTURES[name]
    except KeyError:
        prefix = f"{where} has" if where is not None else "the model has"
        raise UnsupportedArchitectureError(
            f"{prefix} architecture {name!r}; healsweep supports {', '.join(SUPPORTED_ARCHS)}"
        ) from None
