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

    # A child that is None (an untied model's absent lm_head) is recorded in the context rather
    # than kept as a leaf: torch's pytree counts None as a leaf, which torch.func would reject.
    def flatten(obj):
        values = [getattr(obj, n) for n in child_names]
        present = tuple(v is not None for v in values)
        context = (tuple(getattr(obj, n) for n in static_names), present)
        return [v for v in values if v is not None], context

    def unflatten(children, context):
        static_values, present = context
        it = iter(children)
        kwargs = {n: next(it) if p else None for n, p in zip(child_names, present)}
        kwargs.update(zip(static_names, static_values))
        return cls(**kwargs)

    def flatten_with_keys(obj):
        children, context = flatten(obj)
        names = [n for n in child_names if getattr(obj, n) is not None]
        return [(pytree.GetAttrKey(n), c) for n, c in zip(names, children)], context

    pytree.register_pytree_node(
        cls,
        flatten,
        unflatten,
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        flatten_with_keys_fn=flatten_with_keys,
    )
    return cls
