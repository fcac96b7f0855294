"""Small helpers shared by the layers, models and measures: one copy of each.

References: timm ``layers/helpers.py`` (``to_2tuple``) and ``layers/_fx.py`` / ``feature_take_indices``.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Iterable, Sequence

import torch

Size2 = tuple[int, int]


def to_2tuple(x: int | Sequence[int]) -> Size2:
    """``4 -> (4, 4)``; a pair passes through (as a tuple of ints)."""
    if isinstance(x, int):
        return (x, x)
    x = tuple(int(v) for v in x)
    if len(x) != 2:
        raise ValueError(f"expected an int or a pair of ints, got {x}")
    return x  # type: ignore[return-value]


def _whole(x: object) -> bool:
    """An int or an integer scalar (numpy's, a 0-d tensor's ``__index__``), never a bool or a float."""
    if isinstance(x, bool):
        return False
    try:
        operator.index(x)
    except TypeError:
        return False
    return True


def feature_take_indices(num_features: int, indices: int | Sequence[int] | None = None) -> list[int]:
    """Which of ``num_features`` layers to return, timm's rule: ``None`` for all, an int ``n`` for
    the last ``n``, or a list of indices where a negative one counts from the end. Raises a
    ``ValueError`` naming the indices and the range when one is out of it."""
    if indices is None:
        return list(range(num_features))
    if _whole(indices):
        n = operator.index(indices)
        if not 0 < n <= num_features:
            raise ValueError(f"indices={n}: expected 1..{num_features} last layers")
        return list(range(num_features - n, num_features))
    if isinstance(indices, (str, bytes)) or not isinstance(indices, Iterable) or not all(map(_whole, indices)):
        raise TypeError(f"indices must be None, a whole number (the last n layers) or a list of whole layer "
                        f"indices, got {indices!r}")
    idx = [operator.index(i) for i in indices]
    if not idx:
        raise ValueError(f"no layer indices given; expected at least one of 0..{num_features - 1} (or None for all)")
    if any(not -num_features <= i < num_features for i in idx):
        raise ValueError(f"layer indices {idx} out of range for {num_features} layers "
                         f"(expected {-num_features}..{num_features - 1})")
    taken = [i % num_features for i in idx]
    if len(set(taken)) != len(taken):
        raise ValueError(f"layer indices {idx} name a layer twice; each level is returned once")
    return taken


def check_int(name: str, value: object, low: int = 1) -> None:
    """A ``TypeError`` unless ``value`` is a whole number (not a bool), a ``ValueError`` below ``low``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a whole number >= {low}, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be true or false, got {value!r}")


def check_size(name: str, value: object) -> None:
    """A positive int or a pair of them (image and patch sizes)."""
    pair = value if isinstance(value, (tuple, list)) else (value, value)
    if len(pair) != 2:
        raise ValueError(f"{name} must be an int or a pair of ints (height, width), got {value!r}")
    for v in pair:
        check_int(name, v)


def check_float(name: str, value: object, low: float, high: float | None = None, *, low_open: bool = False,
                high_open: bool = True) -> None:
    """A ``TypeError`` unless ``value`` is a real number, a ``ValueError`` outside the interval."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    above = value > low if low_open else value >= low
    below = high is None or (value < high if high_open else value <= high)
    if not (above and below):  # also refuses NaN
        right = "inf)" if high is None else f"{high}{')' if high_open else ']'}"
        interval = f"{'(' if low_open else '['}{low}, {right}"
        raise ValueError(f"{name} must be in {interval}, got {value}")


def check_input_dtype(x: torch.Tensor, weight: torch.Tensor) -> None:
    """Images must be floating point, in the weights' dtype unless autocast casts them."""
    if not x.is_floating_point():
        raise TypeError(f"expected floating-point images (normalised, e.g. by "
                        f"vitattn.tasks.classify.data.Normalize), got {x.dtype}")
    if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(f"expected {weight.dtype} images, the model's dtype, got {x.dtype}; cast the images "
                        f"(x.to({weight.dtype})), convert the model (model.to({x.dtype})) or run under torch.autocast")


def is_tracing() -> bool:
    """Whether ``torch.fx`` is tracing the model: shapes are then proxies, not numbers, and a
    traced model takes one input size (timm's ``fixed_input_size``)."""
    trace = torch.fx._symbolic_trace
    return getattr(trace, "is_fx_symbolic_tracing", trace.is_fx_tracing)()  # the first since torch 2.10


def watched(*modules: torch.nn.Module) -> bool:
    """Whether anything outside the model looks at what ``modules`` (or their submodules) take and
    give: a forward, pre-forward or backward hook on one of them or on every module (torch's global
    hooks), or a trace (torch.fx, torch.export, torch.jit) that records them as calls."""
    from torch.nn.modules import module as torch_module

    if (torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks
            or torch_module._global_backward_hooks or torch_module._global_backward_pre_hooks):
        return True
    if is_tracing() or torch.compiler.is_exporting() or torch.jit.is_tracing():
        return True
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
               for module in modules for m in module.modules())


def building_graph() -> bool:
    """Whether ``torch.fx`` or ``torch.compile`` is tracing the model. Caches are then left alone:
    an fx trace's device and dtype are proxies, and a cache written inside a compiled graph fails
    its guard at the next call, which recompiles the whole model (constants fold into the graph)."""
    return is_tracing() or torch.compiler.is_compiling()


class BuildCache(dict):
    """Values built once per key (a position table per grid, device and dtype); while a graph is
    being built (``building_graph``) they are built afresh and not stored."""

    def get_or_build(self, key: tuple, build):
        if building_graph():
            return build()
        if key not in self:
            self[key] = build()
        return self[key]


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def count_flops(fn, *args, formulas: dict | None = None) -> int:
    """FLOPs of ``fn(*args)`` by torch's formulas (``torch.utils.flop_counter``; a multiply-add
    counts 2), summed over the ops it runs; ``formulas`` adds ``{op: fn(*shapes) -> flops}`` for
    ops torch has none for. Not ``FlopCounterMode`` itself: it follows modules with global hooks,
    and a model that sees a hook shows it every token (``ViT.forward``)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry, shape_wrapper

    registry = {**flop_registry, **{op._overloadpacket if hasattr(op, "_overloadpacket") else op: shape_wrapper(f)
                                    for op, f in (formulas or {}).items()}}

    class Count(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func._overloadpacket in registry:
                Count.total += registry[func._overloadpacket](*args, **(kwargs or {}), out_val=out)
            return out

    with Count():
        fn(*args)
    return int(Count.total)


def flops_per_image(model: torch.nn.Module, img_size: tuple[int, int], in_chans: int = 3) -> int:
    """Forward FLOPs of one image in eval (:func:`count_flops`).

    Counted on a copy on the ``meta`` device: no arithmetic is done, and the layers take their
    plain PyTorch path there, whose matrix products the counter sees.
    """
    ghost = copy.deepcopy(model).to("meta").eval()
    with torch.no_grad():
        return count_flops(ghost, torch.zeros(1, in_chans, *img_size, device="meta"))
