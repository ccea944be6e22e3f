"""Reverse-mode automatic differentiation as a transformation of the traced IR, in JAX's
style: ``vjp``, ``grad``, ``value_and_grad`` and ``checkpoint``.

Inside a trace, the transformed function runs ``fn`` on the enclosing trace's values, so its
eqns land in the enclosing program as they are (the forward). Then it walks those eqns
backwards and applies each primitive's backward rule (``Primitive.vjp``, or
``Primitive.transpose`` for a linear one, declared in its op family file): the rules are
written with the ordinary eins operators, so the backward is eqns like any other (marked
``phase="bwd"``), planned together with the forward by the same DP. Outside a trace, the
transformed function runs under :func:`eins.jit`.

A rule is called ``vjp(cts, ins, outs, needs, **params)`` (``transpose`` without ``outs``):
``cts`` the cotangents of the eqn's outputs (None: zero), ``ins`` its operands (traced
arrays; a literal as its Python value), ``outs`` its results (traced arrays), ``needs`` per
operand whether its cotangent is wanted. It returns one cotangent per operand (None: zero or
not wanted), of the operand's shape; the cast to the operand's dtype is made here.

Non-differentiable values (integer and bool results: indices, masks, comparisons) carry no
cotangent (JAX's float0 without the type): the walk never sends one to them, and the
gradient with respect to an integer or bool argument is refused with an EinsError.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import sys

import numpy as np

from eins.api import jit
from eins.errors import EinsError, TraceError
from eins.ir.program import Literal, Var
from eins.ir.types import is_float
from eins.ops import astype, broadcast_to
from eins.tracing import (Tracer, bind, current_trace, install_operators, tree_flatten,
                          tree_unflatten, user_frame)

__all__ = ["vjp", "grad", "value_and_grad", "checkpoint", "saved_bytes"]

_REGIONS = itertools.count()


# ----------------------------------------------------------------------------- the walk
@contextlib.contextmanager
def _phase(ctx, phase: str):
    """Mark the eqns recorded meanwhile ``phase`` ("bwd" while the backward is emitted)."""
    before = ctx.phase
    ctx.phase = phase
    try:
        yield
    finally:
        ctx.phase = before


def _context(leaves):
    """The trace the differentiated values belong to (a primal's, else the current one)."""
    for x in leaves:
        if isinstance(x, Tracer):
            return x._ctx
    ctx = current_trace()
    if ctx is None:
        raise TraceError("eins.vjp: no trace in progress")
    return ctx


def _as_tracer(ctx, x, what):
    """A primal leaf as a traced array of ``ctx``: numpy arrays become constants."""
    if isinstance(x, Tracer):
        return x
    if isinstance(x, (np.ndarray, np.generic)):
        return Tracer(ctx.const(np.asarray(x)), ctx)
    raise TraceError(f"{what}: cannot differentiate with respect to a {type(x).__name__} "
                     f"({x!r:.40}); pass an array")


class _Linearized:
    """The forward of ``fn`` recorded in ``ctx``, ready to be walked backwards."""

    def __init__(self, ctx, primal_vars, eqns, out_vars):
        self.ctx = ctx
        self.primal_vars = primal_vars
        self.eqns = eqns
        self.out_vars = out_vars
        active = {id(v) for v in primal_vars}
        for e in eqns:   # forward: which values depend on a primal (and are floats)
            if any(isinstance(a, Var) and id(a) in active for a in e.inputs):
                active.update(id(v) for v in e.outputs if is_float(v.dtype))
        self.active = active

    def backward(self, cts: list):
        """The cotangents of the primals, given those of the outputs (None: zero)."""
        ctx = self.ctx
        acc: dict[int, Tracer] = {}
        for v, c in zip(self.out_vars, cts):
            if c is not None and isinstance(v, Var) and id(v) in self.active:
                _accumulate(acc, v, c)
        recomputed: dict[int, Tracer] = {}
        done_regions: set = set()
        with _phase(ctx, "bwd"):
            for e in reversed(self.eqns):
                out_cts = [acc.get(id(v)) for v in e.outputs]
                if all(c is None for c in out_cts):
                    continue
                needs = tuple(isinstance(a, Var) and id(a) in self.active
                              for a in e.inputs)
                if not any(needs):
                    continue
                region = ctx.remat.get(id(e))
                if region is not None and region not in done_regions:
                    done_regions.add(region)
                    self._recompute(region, recomputed)
                ins = tuple(_operand(ctx, a, recomputed) for a in e.inputs)
                outs = tuple(_operand(ctx, v, recomputed) for v in e.outputs)
                got = _apply_rule(e, out_cts, ins, outs, needs)
                for a, need, g in zip(e.inputs, needs, got):
                    if need and g is not None:
                        _accumulate(acc, a, _fit(g, a, e))
        return [acc.get(id(v)) for v in self.primal_vars]

    def _recompute(self, region, env):
        """Run the eqns of checkpointed ``region`` again, in the backward: its rules then
        read the recomputed values, and only the region's inputs stay saved across it."""
        for e in self.eqns:
            if self.ctx.remat.get(id(e)) != region:
                continue
            args = [a if isinstance(a, Literal) else _operand(self.ctx, a, env)
                    for a in e.inputs]
            res = _bind_again(e, args)
            for v, r in zip(e.outputs, res):
                env[id(v)] = r


def _bind_again(e, args):
    res = bind(e.primitive, *args, **e.params)
    return res if isinstance(res, tuple) else (res,)


def _operand(ctx, a, env):
    if isinstance(a, Literal):
        return a.value
    hit = env.get(id(a))
    return hit if hit is not None else Tracer(a, ctx)


def _apply_rule(e, cts, ins, outs, needs):
    prim = e.primitive
    where = f" (at {e.source})" if e.source else ""
    if prim.vjp is not None:
        got = prim.vjp(tuple(cts), ins, outs, needs, **e.params)
    elif prim.transpose is not None:
        got = prim.transpose(tuple(cts), ins, needs, **e.params)
    else:
        raise EinsError(f"cannot differentiate {prim.name!r}: the primitive has no backward "
                        f"rule (vjp) yet{where}")
    got = tuple(got)
    if len(got) != len(e.inputs):
        raise EinsError(f"the backward rule of {prim.name!r} returned {len(got)} cotangents "
                        f"for {len(e.inputs)} operands{where}")
    return got


def _fit(g, a: Var, e):
    """A rule's cotangent for operand ``a``: its shape checked, cast to its dtype."""
    if tuple(g.shape) != tuple(a.shape):
        raise EinsError(f"the backward rule of {e.prim!r} returned a cotangent of shape "
                        f"{tuple(g.shape)} for an operand of shape {tuple(a.shape)}")
    if g.dtype != a.dtype:
        g = astype(g, a.dtype)
    return g


def _accumulate(acc, v, c):
    prev = acc.get(id(v))
    acc[id(v)] = c if prev is None else prev + c


def _linearize(fn, primals: tuple, what: str):
    """Run ``fn(*primals)`` in the trace, recording its eqns. -> (out, the trace, the
    primals' vars, the recorded eqns, the primals' treedef)."""
    leaves, tree = tree_flatten(primals)
    ctx = _context(leaves)
    if not ctx.live:
        raise TraceError(f"{what}: a traced value was used after its trace ended")
    tracers = [_as_tracer(ctx, x, what) for x in leaves]
    for k, t in enumerate(tracers):
        if not is_float(t.dtype):
            raise EinsError(f"{what}: differentiable arguments must be floats; leaf {k} of "
                            f"the differentiated arguments is {t.dtype} {tuple(t.shape)} "
                            f"(at {user_frame()})")
    start = len(ctx.eqns)
    out = fn(*tree_unflatten(tree, tracers))
    return out, ctx, [t._var for t in tracers], list(ctx.eqns[start:]), tree


def _out_vars(ctx, out, what):
    leaves, tree = tree_flatten(out)
    vars_ = []
    for o in leaves:
        if isinstance(o, Tracer):
            vars_.append(o._var)
        elif isinstance(o, (np.ndarray, np.generic)):
            vars_.append(ctx.const(np.asarray(o)))
        else:
            raise TraceError(f"{what}: the function returned a {type(o).__name__}; outputs "
                             f"must be arrays")
    return leaves, tree, vars_


# ----------------------------------------------------------------------------- public API
def _traced_vjp(fn, primals, has_aux, what="eins.vjp"):
    out, ctx, pvars, eqns, ptree = _linearize(fn, primals, what)
    aux = None
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TraceError(f"{what}(has_aux=True): the function must return a pair "
                             f"(output, aux), got {type(out).__name__}")
        out, aux = out
    oleaves, otree, ovars = _out_vars(ctx, out, what)
    lin = _Linearized(ctx, pvars, eqns, ovars)

    def vjp_fn(ct):
        cleaves, ctree = tree_flatten(ct)
        if ctree != otree:
            raise TraceError(f"{what}: the cotangent is structured as {ctree}, the output "
                             f"as {otree}")
        with _phase(ctx, "bwd"):
            cts = []
            for k, (c, v) in enumerate(zip(cleaves, ovars)):
                c = _as_tracer(ctx, c, what)
                if tuple(c.shape) != tuple(v.shape):
                    raise EinsError(f"{what}: cotangent {k} has shape {tuple(c.shape)}, the "
                                    f"output has shape {tuple(v.shape)}")
                cts.append(c if c.dtype == v.dtype else astype(c, v.dtype))
            got = lin.backward(cts)
            # a primal the output does not depend on: zeros
            res = [g if g is not None else broadcast_to(Literal(0, v.dtype), v.shape)
                   for g, v in zip(got, pvars)]
        return tree_unflatten(ptree, res)

    return out, vjp_fn, aux


def vjp(fn, *primals, has_aux=False):
    """``(out, vjp_fn)``: ``fn(*primals)`` and the function mapping a cotangent of ``out``
    (same structure) to the cotangents of ``primals`` (a tuple, one per primal, each of
    its primal's structure). With ``has_aux``, ``fn`` returns ``(out, aux)`` and this
    returns ``(out, vjp_fn, aux)``. Inside a traced function the backward joins its trace;
    outside one, ``out`` and each call of ``vjp_fn`` run under :func:`eins.jit`."""
    _callable(fn, "eins.vjp")
    if _tracing(primals):
        out, f, aux = _traced_vjp(fn, primals, has_aux)
        return (out, f, aux) if has_aux else (out, f)
    fwd = jit(lambda *p: fn(*p))
    res = fwd(*primals)
    out, aux = res if has_aux else (res, None)

    def vjp_fn(ct):
        return jit(lambda p, c: _traced_vjp(fn, p, has_aux)[1](c))(primals, ct)

    return (out, vjp_fn, aux) if has_aux else (out, vjp_fn)


def _tracing(leaves_of) -> bool:
    leaves, _ = tree_flatten(leaves_of)
    return current_trace() is not None or any(isinstance(x, Tracer) for x in leaves)


def _callable(fn, what):
    if not callable(fn):
        raise TraceError(f"{what} expects a function, got {type(fn).__name__}")


def _argnums(argnums, nargs, what):
    many = isinstance(argnums, (tuple, list))
    nums = tuple(argnums) if many else (argnums,)
    for a in nums:
        if isinstance(a, bool) or not isinstance(a, (int, np.integer)):
            raise TraceError(f"{what}: argnums must be an int or a tuple of ints, got "
                             f"{argnums!r}")
        if not -nargs <= a < nargs:
            raise TraceError(f"{what}: argnums {argnums!r} out of range for {nargs} "
                             f"positional argument(s)")
    return tuple(int(a) % nargs for a in nums), many


def value_and_grad(fn, argnums=0, has_aux=False):
    """``fn`` and its gradient with respect to the positional arguments ``argnums`` (an int,
    or a tuple: then a tuple of gradients), each a pytree of its argument's structure (a
    dict of weights gives a dict of gradients). ``fn`` returns a float scalar (with
    ``has_aux``: ``(scalar, aux)``, and this returns ``((value, aux), grads)``). Composes
    with :func:`eins.jit`, :func:`eins.make_ir` and :func:`eins.distribute`; called outside
    a traced function it runs under :func:`eins.jit` (traced once per signature)."""
    _callable(fn, "eins.value_and_grad")
    what = "eins.grad"

    def traced(*args, **kwargs):
        nums, many = _argnums(argnums, len(args), what)

        def part(*diff):
            full = list(args)
            for a, d in zip(nums, diff):
                full[a] = d
            return fn(*full, **kwargs)

        out, vjp_fn, aux = _traced_vjp(part, tuple(args[a] for a in nums), has_aux, what)
        if not hasattr(out, "shape") or tuple(out.shape) != () or not is_float(out.dtype):
            got = (f"{np.dtype(out.dtype)} of shape {tuple(out.shape)}"
                   if hasattr(out, "shape") else type(out).__name__)
            raise EinsError(f"{what}: the function must return a float scalar (shape ()), "
                            f"got {got}; differentiate a loss, or use eins.vjp "
                            f"(at {user_frame()})")
        ctx = _context(tree_flatten(args)[0])
        with _phase(ctx, "bwd"):   # the seed: d out / d out = 1
            one = broadcast_to(Literal(1, np.dtype(out.dtype)), ())
        grads = vjp_fn(one)
        grads = grads if many else grads[0]
        return ((out, aux) if has_aux else out), grads

    jitted = jit(traced)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if _tracing((args, kwargs)):
            return traced(*args, **kwargs)
        return jitted(*args, **kwargs)

    return wrapped


def grad(fn, argnums=0, has_aux=False):
    """The gradient of ``fn`` (a float scalar) with respect to its positional arguments
    ``argnums``: :func:`value_and_grad` without the value (with ``has_aux``: ``(grads,
    aux)``)."""
    vg = value_and_grad(fn, argnums, has_aux)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        value, g = vg(*args, **kwargs)
        return (g, value[1]) if has_aux else g

    return wrapped


def checkpoint(fn):
    """``fn`` rematerialized: under a gradient, its eqns are recomputed in the backward pass
    (just before the backward first needs them) instead of their results being kept from
    the forward, so the values saved across it are only its inputs. Elsewhere it is ``fn``."""
    _callable(fn, "eins.checkpoint")

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        ctx = current_trace()
        leaves, _ = tree_flatten((args, kwargs))
        for x in leaves:
            if isinstance(x, Tracer):
                ctx = x._ctx
                break
        if ctx is None:
            return fn(*args, **kwargs)
        start = len(ctx.eqns)
        out = fn(*args, **kwargs)
        region = next(_REGIONS)
        for e in ctx.eqns[start:]:   # an enclosing checkpoint, called later, takes them over
            if e.phase == "fwd":
                ctx.remat[id(e)] = region
        return out

    return wrapped


def saved_bytes(program) -> int:
    """The bytes a program keeps from its forward for its backward: every value a forward
    eqn produces that a backward eqn reads (each counted once)."""
    fwd = {id(v): v for e in program.eqns if e.phase == "fwd" for v in e.outputs}
    read = {id(a) for e in program.eqns if e.phase != "fwd" for a in e.inputs
            if isinstance(a, Var)}
    return sum(fwd[k].type.nbytes for k in read if k in fwd)


install_operators(sys.modules[__name__], "autodiff")
