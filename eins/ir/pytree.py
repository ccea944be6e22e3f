"""Pytrees: the nested tuples, lists, dicts and namedtuples a traced function takes and
returns, flattened into leaves and a :class:`TreeDef` (as JAX's pytrees), and the names of a
call's leaves as the user wrote them (``argument 1['s']``) for error messages."""
from __future__ import annotations

from dataclasses import dataclass

from eins.errors import TraceError

__all__ = ["TreeDef", "tree_flatten", "tree_unflatten", "flatten_call", "call_leaf_names"]


@dataclass(frozen=True)
class TreeDef:
    """The structure of a nested tuple/list/dict with leaves; ``kind`` is 'leaf', 'tuple',
    'namedtuple' (``cls`` is its class, rebuilt on the way out), 'list', 'dict' or 'none'."""

    kind: str
    children: tuple = ()
    keys: tuple = ()
    cls: type | None = None

    def __str__(self):
        """``*`` per leaf: ``((*, *), {'w': *})``."""
        if self.kind == "leaf":
            return "*"
        if self.kind == "none":
            return "None"
        kids = [str(c) for c in self.children]
        if self.kind == "dict":
            return "{" + ", ".join(f"{k!r}: {c}" for k, c in zip(self.keys, kids)) + "}"
        if self.kind == "tuple":
            return "(" + ", ".join(kids) + ("," if len(kids) == 1 else "") + ")"
        if self.kind == "namedtuple":
            return f"{self.cls.__name__}(" + ", ".join(
                f"{k}={c}" for k, c in zip(self.keys, kids)) + ")"
        return "[" + ", ".join(kids) + "]"

    @property
    def num_leaves(self) -> int:
        if self.kind == "leaf":
            return 1
        return sum(c.num_leaves for c in self.children)


def tree_flatten(tree):
    """-> (leaves, treedef). Tuples (namedtuples too, kept as their class), lists and dicts
    (sorted keys) are containers; None is an empty container; everything else is a leaf."""
    if tree is None:
        return [], TreeDef("none")
    if isinstance(tree, (tuple, list)):
        leaves, defs = [], []
        for c in tree:
            l, d = tree_flatten(c)
            leaves += l
            defs.append(d)
        if isinstance(tree, tuple) and hasattr(type(tree), "_fields"):   # a namedtuple
            return leaves, TreeDef("namedtuple", tuple(defs), tuple(type(tree)._fields),
                                   type(tree))
        return leaves, TreeDef("tuple" if isinstance(tree, tuple) else "list", tuple(defs))
    if isinstance(tree, dict):
        try:
            keys = tuple(sorted(tree))
        except TypeError:  # keys order the leaves, so they must compare with each other
            kinds = sorted({type(k).__name__ for k in tree})
            raise TraceError(f"dict with keys of types {kinds} ({list(tree)!r:.80}): "
                             f"the keys of one dict must be mutually sortable (all str, or "
                             f"all int)") from None
        leaves, defs = [], []
        for k in keys:
            l, d = tree_flatten(tree[k])
            leaves += l
            defs.append(d)
        return leaves, TreeDef("dict", tuple(defs), keys)
    return [tree], TreeDef("leaf")


def flatten_call(args, kwargs):
    """-> (leaves, treedef) of a call's ``(args, kwargs)``; a dict whose keys do not sort is
    named as an argument."""
    try:
        return tree_flatten((tuple(args), dict(kwargs)))
    except TraceError as e:
        raise TraceError(f"an argument is a {e}") from None


def call_leaf_names(treedef: TreeDef) -> list[str]:
    """What the user wrote for each leaf of a call's ``(args, kwargs)`` tree, in leaf order:
    ``argument 1``, ``argument 0[2]``, ``argument 1.u`` (a namedtuple field), ``keyword
    argument 'p'['s']``."""
    out: list[str] = []
    args, kwargs = treedef.children
    for i, c in enumerate(args.children):
        _leaf_names(c, f"argument {i}", out)
    for k, c in zip(kwargs.keys, kwargs.children):
        _leaf_names(c, f"keyword argument {k!r}", out)
    return out


# the recursions a call runs are module functions: a nested function calling itself is a
# reference cycle (it holds its own cell), garbage only the cyclic collector frees
def _leaf_names(d, path, out) -> None:
    if d.kind == "leaf":
        out.append(path)
    elif d.kind in ("tuple", "list"):
        for i, c in enumerate(d.children):
            _leaf_names(c, f"{path}[{i}]", out)
    elif d.kind == "namedtuple":
        for k, c in zip(d.keys, d.children):
            _leaf_names(c, f"{path}.{k}", out)
    elif d.kind == "dict":
        for k, c in zip(d.keys, d.children):
            _leaf_names(c, f"{path}[{k!r}]", out)


def tree_unflatten(treedef: TreeDef, leaves):
    """The inverse of :func:`tree_flatten`: ``treedef``'s structure with ``leaves`` in
    order (as many as it has; otherwise a TraceError)."""
    leaves = list(leaves)
    want = _count_leaves(treedef)
    if len(leaves) != want:
        raise TraceError(f"tree_unflatten: the structure has {want} leaves, got "
                         f"{len(leaves)}")
    return _build(treedef, iter(leaves))


def _build(d: TreeDef, it):
    if d.kind == "leaf":
        return next(it)
    if d.kind == "none":
        return None
    kids = [_build(c, it) for c in d.children]
    if d.kind == "tuple":
        return tuple(kids)
    if d.kind == "namedtuple":
        return d.cls(*kids)
    if d.kind == "list":
        return kids
    return dict(zip(d.keys, kids))


def _count_leaves(d: TreeDef) -> int:
    if d.kind == "leaf":
        return 1
    return sum(_count_leaves(c) for c in (d.children or ()))
