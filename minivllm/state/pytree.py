"""Registering frozen attrs classes as torch pytrees.

A field marked `static()` lives in the treedef context (ints, dtypes, configs, shard specs);
every other field is a child (tensors, tuples of tensors, nested pytrees, None). Because the
registration is with `torch.utils._pytree`, `tree_map`, `torch.func` and `torch.compile` all see
through these classes.
"""

from __future__ import annotations

import attrs
import torch.utils._pytree as pytree

_STATIC = "minivllm_static"


def static(**kwargs):
    """An attrs field that is treedef metadata, not a pytree child."""
    metadata = dict(kwargs.pop("metadata", {}) or {})
    metadata[_STATIC] = True
    return attrs.field(metadata=metadata, **kwargs)


def pytree_class(cls):
    """Decorator: make `cls` a frozen attrs class and register it as a torch pytree node."""
    cls = attrs.frozen(cls)
    fields = attrs.fields(cls)
    child_names = tuple(f.name for f in fields if not f.metadata.get(_STATIC))
    static_names = tuple(f.name for f in fields if f.metadata.get(_STATIC))

    def flatten(obj):
        children = [getattr(obj, n) for n in child_names]
        context = tuple(getattr(obj, n) for n in static_names)
        return children, context

    def unflatten(children, context):
        kwargs = dict(zip(child_names, children))
        kwargs.update(zip(static_names, context))
        return cls(**kwargs)

    def flatten_with_keys(obj):
        children, context = flatten(obj)
        return [(pytree.GetAttrKey(n), c) for n, c in zip(child_names, children)], context

    pytree.register_pytree_node(
        cls,
        flatten,
        unflatten,
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        flatten_with_keys_fn=flatten_with_keys,
    )
    return cls
