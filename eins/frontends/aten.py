"""The mapping table from ATen ops (as ``torch.export`` records them) to eins operators.

Each entry maps an op's overload packet name (``aten.linear``, any overload) to a
converter ``conv(cx, *args, **kwargs)`` that receives the node's arguments as the exported
graph holds them (eins traced arrays, numpy constants, Python numbers and lists, in the
ATen schema's order and defaults) and returns the node's value. ``cx`` (:class:`eins.frontends.node.Node`)
knows the node's recorded output shapes and dtypes and raises
:class:`eins.errors.UnsupportedOpError` naming the op and where it came from.

After a converter, the interpreter casts the result to the dtype torch recorded: torch and
numpy promote differently (``int64 * 0.5`` is float32 in torch, float64 in numpy), and the
recorded dtype is the module's own. Ops whose inputs are all constants never reach a
converter: they are folded with torch at conversion time (eins/frontends/torch.py).

``docs/torch.md`` is generated from :data:`ATEN` by :func:`supported_ops_markdown`.
"""
from __future__ import annotations

import numpy as np

import eins.ops as ops
from eins.frontends import aten_experts, aten_more
from eins.frontends.node import LETTERS, dim_of, dims_of, note, wider
from eins.frontends.sdpa import sdpa
from eins.ops.gather import embedding_rows


# ----------------------------------------------------------------------------- linear algebra
def _linear(cx, x, w, b=None):
    # weight is [out, in]: one einsum, no transpose of the weight as an eqn of its own
    lead = LETTERS[:len(x.shape) - 1]
    y = ops.einsum(f"{lead}Y,ZY->{lead}Z", x, w)
    return y if b is None else y + b


def _matmul(cx, a, b):
    return ops.matmul(a, b)


def _addmm(cx, bias, a, b, beta=1, alpha=1):
    y = ops.matmul(a, b)
    y = y if alpha == 1 else y * alpha
    if beta == 0:   # torch ignores the bias then, nan and inf included
        return y
    return y + (bias if beta == 1 else bias * beta)


def _baddbmm(cx, bias, a, b, beta=1, alpha=1):
    return _addmm(cx, bias, a, b, beta, alpha)


def _einsum(cx, equation, tensors, path=None):
    return ops.einsum(equation.replace(" ", ""), *tensors)


# ----------------------------------------------------------------------------- shapes
def _as_shape(cx, x, *rest, **kw):
    """view, reshape, unsqueeze, squeeze, flatten, unflatten: the recorded shape."""
    y = ops.reshape(x, tuple(cx.shape))
    note(cx, "reshaped", y, x)
    return y


def _permute(cx, x, dims):
    return ops.transpose(x, tuple(dim_of(d, len(x.shape)) for d in dims))


def _transpose(cx, x, d0=0, d1=1):
    if len(x.shape) < 2:   # t() of a vector
        return x
    axes = list(range(len(x.shape)))
    d0, d1 = dim_of(d0, len(axes)), dim_of(d1, len(axes))
    axes[d0], axes[d1] = axes[d1], axes[d0]
    return ops.transpose(x, tuple(axes))


def _expand(cx, x, size, implicit=False):
    """Broadcast ``x`` to the recorded shape: ``where`` with a constant all-true mask that
    is only as large as the expanded dims (exact for every dtype, elementwise specs)."""
    out = tuple(cx.shape)
    src = x
    if len(x.shape) < len(out):
        x = ops.reshape(x, (1,) * (len(out) - len(x.shape)) + tuple(x.shape))
    if tuple(x.shape) == out:
        return x
    grown = tuple(o if s == 1 and o != 1 else 1 for s, o in zip(x.shape, out))
    y = ops.where(np.ones(grown, bool), x, x)
    note(cx, "expanded", y, (src, grown))
    return y


def _slice(cx, x, dim=0, start=None, end=None, step=1):
    if step != 1:
        cx.fail(f"with step {step} (only step-1 slices map to eins.slice)")
    nd = len(x.shape)
    d = dim_of(dim, nd)
    s, e, _ = slice(start, end).indices(x.shape[d])
    lo, hi = [0] * nd, list(x.shape)
    lo[d], hi[d] = s, max(s, e)
    return ops.slice(x, tuple(lo), tuple(hi))


def _narrow(cx, x, dim, start, length):
    start = start % x.shape[dim_of(dim, len(x.shape))] if start < 0 else start
    return _slice(cx, x, dim, start, start + length)


def _mT(cx, x):
    return _transpose(cx, x, -2, -1)


def _stack(cx, tensors, dim=0):
    d = dim_of(dim, len(tensors[0].shape) + 1)
    return ops.concatenate([ops.reshape(t, tuple(t.shape[:d]) + (1,) + tuple(t.shape[d:]))
                            for t in tensors], axis=d)


def _repeat(cx, x, repeats):
    """repeat and tile: copies laid end to end along each dim (concatenate)."""
    out = tuple(cx.shape)
    if len(x.shape) < len(out):
        x = ops.reshape(x, (1,) * (len(out) - len(x.shape)) + tuple(x.shape))
    for d, (n, o) in enumerate(zip(x.shape, out)):
        if o != n:
            x = ops.concatenate([x] * (o // n), axis=d)
    return x


def _repeat_interleave(cx, x, repeats, dim=None, output_size=None):
    if not isinstance(repeats, int):
        cx.fail("with a tensor of repeats (its result shape depends on the data)")
    if dim is None:
        x, d = ops.reshape(x, (-1,)), 0
    else:
        d = dim_of(dim, len(x.shape))
    shape = tuple(x.shape)
    wide = ops.reshape(x, shape[:d + 1] + (1,) + shape[d + 1:])
    grown = (1,) * (d + 1) + (repeats,) + (1,) * (len(shape) - d - 1)
    copies = ops.where(np.ones(grown, bool), wide, wide)   # each element `repeats` times
    return ops.reshape(copies, tuple(cx.shape))


def _tri(lower):
    def conv(cx, x, diagonal=0):
        n, m = x.shape[-2:]
        keep = np.tri(n, m, diagonal, dtype=bool)
        return ops.where(keep if lower else ~np.tri(n, m, diagonal - 1, dtype=bool), x,
                         np.zeros((), x.dtype))
    return conv


def _select(cx, x, dim, index):
    nd = len(x.shape)
    d = dim_of(dim, nd)
    i = index % x.shape[d]
    return ops.reshape(_slice(cx, x, d, i, i + 1), tuple(cx.shape))


def _cat(cx, tensors, dim=0):
    return ops.concatenate(list(tensors), axis=dim)


def _split(cx, x, _size=None, dim=0, *rest):
    """split, split_with_sizes, chunk, unbind: consecutive slices of the recorded sizes."""
    nd = len(x.shape)
    d = dim_of(dim, nd) if isinstance(dim, int) else 0
    if cx.op.startswith("aten.unbind"):
        d = dim_of(_size if isinstance(_size, int) else 0, nd)
    outs, at = [], 0
    for shape in cx.shapes:
        n = shape[d] if len(shape) == nd else 1
        piece = _slice(cx, x, d, at, at + n)
        outs.append(piece if len(shape) == nd else ops.reshape(piece, tuple(shape)))
        at += n
    return outs


def gather(cx, x, indices):
    """``x[indices]`` for torch's advanced indexing with index tensors on consecutive dims
    (``None`` for the dims before them): embedding lookups, ``x[ids]``, ``x[:, ids]``,
    ``x[rows, cols]`` (index tensors broadcast together), as eins's gather primitive
    (eins/ops/gather.py: numpy's integer-array indexing, the same semantics)."""
    indices = list(indices)
    real = [k for k, t in enumerate(indices) if t is not None]
    if not real or real != list(range(real[0], real[0] + len(real))):
        cx.fail(f"with index tensors at dims {real} (index tensors on consecutive dims are "
                f"supported)")
    if any(np.dtype(indices[j].dtype) == np.bool_ for j in real):
        cx.fail("with a boolean mask index (its result shape depends on the data)")
    return ops.getitem(x, (slice(None),) * real[0] + tuple(indices[j] for j in real))


def _embedding(cx, weight, ids, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    # torch's ids lie in [0, num_embeddings): a negative one is an error, not a row from
    # the end (as x[ids], aten.index, takes it)
    return embedding_rows(weight, ids)


def _index(cx, x, indices):
    return gather(cx, x, indices)


def _identity(cx, x, *rest, **kw):
    return x


def _empty_like(cx, x, *rest, **kw):
    # torch leaves the values undefined; eins's are zeros (no constant of x's size)
    return ops.astype(np.zeros_like(x), cx.dtype)


def _dropout(cx, x, p=0.5, train=False):
    if train and p > 0:
        cx.fail(f"in training mode (p={p}): call module.eval() before converting it")
    return x


# ----------------------------------------------------------------------------- elementwise
def _scaled(b, alpha):
    return b if alpha == 1 else b * alpha


def _add(cx, a, b, alpha=1):
    return a + _scaled(b, alpha)


def _sub(cx, a, b, alpha=1):
    return a - _scaled(b, alpha)


def _rsub(cx, a, b, alpha=1):
    return b - _scaled(a, alpha)


def _div(cx, a, b, rounding_mode=None):
    if rounding_mode == "floor":
        return ops.floor_divide(a, b)
    if rounding_mode is not None:
        cx.fail(f"with rounding_mode={rounding_mode!r}")
    return a / b


def _unary(name):
    fn = getattr(ops, name)
    return lambda cx, x: fn(x)


def _gelu(cx, x, approximate="none"):
    return ops.gelu(x, approximate=approximate == "tanh")


def _pow(cx, a, b):
    return ops.pow(a, b)


def _reciprocal(cx, x):
    return 1 / x


def _clamp(cx, x, min=None, max=None):  # noqa: A002 - ATen's argument names
    if min is not None:
        x = ops.maximum(x, min)
    return x if max is None else ops.minimum(x, max)


def _clamp_max(cx, x, max):  # noqa: A002
    return ops.minimum(x, max)


def _square(cx, x):
    return x * x


def _leaky_relu(cx, x, negative_slope=0.01):
    return ops.where(x > 0, x, x * negative_slope)


def _hardtanh(cx, x, min_val=-1.0, max_val=1.0):
    return _clamp(cx, x, min_val, max_val)


def _softplus_of(x, beta=1.0, threshold=20.0):
    bx = x * beta if beta != 1 else x
    soft = ops.log(1 + ops.exp(bx))
    return ops.where(bx > threshold, x, soft / beta if beta != 1 else soft)


def _softplus(cx, x, beta=1.0, threshold=20.0):
    return _softplus_of(x, beta, threshold)


def _elu(cx, x, alpha=1.0, scale=1.0, input_scale=1.0):
    neg = (ops.exp(x * input_scale if input_scale != 1 else x) - 1) * (alpha * scale)
    return ops.where(x > 0, x * scale if scale != 1 else x, neg)


def _hardsigmoid(cx, x):
    return _clamp(cx, x / 6 + 0.5, 0.0, 1.0)


def _hardswish(cx, x):
    return x * _clamp(cx, x + 3, 0.0, 6.0) / 6


def _mish(cx, x):
    return x * ops.tanh(_softplus_of(x))


def _log_sigmoid(cx, x):
    # min(x, 0) - log(1 + exp(-|x|)): no overflow for either sign
    return ops.minimum(x, 0) - ops.log(1 + ops.exp(-ops.abs(x)))


def _binary(name):
    fn = getattr(ops, name)
    return lambda cx, a, b: fn(a, b)


def _where(cx, c, x, y):
    return ops.where(c, x, y)


def _masked_fill(cx, x, mask, value):
    return ops.where(mask, value, x)


def _boolean(cx, *xs):
    for x in xs:
        if np.dtype(getattr(x, "dtype", np.bool_)) != np.bool_:
            cx.fail(f"on {np.dtype(x.dtype)} operands (bool operands only)")


def _and(cx, a, b):
    _boolean(cx, a, b)
    return ops.where(a, b, False)


def _or(cx, a, b):
    _boolean(cx, a, b)
    return ops.where(a, True, b)


def _not(cx, a):
    _boolean(cx, a)
    return ops.where(a, False, True)


def _cast(cx, x, *rest, **kw):
    """to, _to_copy, type_as: the recorded dtype (the interpreter casts every result)."""
    return ops.astype(x, cx.dtype)


# ----------------------------------------------------------------------------- reductions
def _reduction(name):
    fn = getattr(ops, name)

    def conv(cx, x, dim=None, keepdim=False, dtype=None):
        if dtype is not None:   # torch accumulates in dtype
            x = ops.astype(x, cx.dtype)
        return fn(x, dims_of(dim, len(x.shape)), keepdims=keepdim)
    return conv


def _extreme(name, binary):
    reduce, arg = getattr(ops, name), getattr(ops, f"arg{name}")

    def conv(cx, x, other=None, keepdim=False):
        if other is None:
            return reduce(x)
        if isinstance(other, int):   # max.dim: (values, indices)
            return [reduce(x, dim_of(other, len(x.shape)), keepdims=keepdim),
                    arg(x, dim_of(other, len(x.shape)), keepdims=keepdim)]
        return getattr(ops, binary)(x, other)
    return conv


def _argextreme(name):
    arg = getattr(ops, name)

    def conv(cx, x, dim=None, keepdim=False):
        if dim is None:
            return ops.reshape(arg(x), (1,) * len(x.shape)) if keepdim else arg(x)
        return arg(x, dim_of(dim, len(x.shape)), keepdims=keepdim)
    return conv


def _last(x, d):
    """``x`` with dim ``d`` moved last (eins.top_k works on the last axis), and back."""
    axes = [k for k in range(len(x.shape)) if k != d] + [d]
    back = [axes.index(k) for k in range(len(x.shape))]
    return ops.transpose(x, tuple(axes)), tuple(back)


def _topk(cx, x, k, dim=-1, largest=True, sorted=True):  # noqa: A002 - ATen's name
    d = dim_of(dim, len(x.shape))
    xt, back = _last(x, d) if d != len(x.shape) - 1 else (x, None)
    vals, ids = ops.top_k(xt if largest else -xt, k)
    vals = vals if largest else -vals
    if back is not None:
        vals, ids = ops.transpose(vals, back), ops.transpose(ids, back)
    return [vals, ids]


def _sort(cx, x, *args, dim=-1, descending=False, stable=None):
    if args and isinstance(args[0], bool) and len(args) == 1:   # sort.stable(x, stable=)
        args = ()
    if args:   # sort.default(x, dim, descending)
        dim, descending = (list(args) + [descending])[:2]
    d = dim_of(dim, len(x.shape))
    key = -x if descending else x
    ids = ops.argsort(key, axis=d)
    return [ops.take_along_axis(x, ids, axis=d), ids]


def _argsort(cx, x, *args, dim=-1, descending=False, stable=None):
    return _sort(cx, x, *args, dim=dim, descending=descending)[1]


def _var(cx, x, dim=None, correction=None, keepdim=False, unbiased=None):
    if isinstance(correction, bool):   # var.dim(x, dim, unbiased, keepdim)
        correction, unbiased = None, correction
    axes = dims_of(dim, len(x.shape)) or tuple(range(len(x.shape)))
    n = int(np.prod([x.shape[d] for d in axes]))
    corr = (1 if unbiased is None or unbiased else 0) if correction is None else correction
    centered = x - ops.mean(x, axes, keepdims=True)
    return ops.sum(centered * centered, axes, keepdims=keepdim) / max(n - corr, 0)


def _std(cx, x, dim=None, correction=None, keepdim=False, unbiased=None):
    return ops.sqrt(_var(cx, x, dim, correction, keepdim, unbiased))


def _vector_norm(cx, x, ord=2, dim=None, keepdim=False, dtype=None):  # noqa: A002
    if ord != 2:
        cx.fail(f"with ord={ord} (the 2-norm is supported)")
    x = wider(cx, x)
    return ops.sqrt(ops.sum(x * x, dims_of(dim, len(x.shape)), keepdims=keepdim))


def _softmax(cx, x, dim, *rest, **kw):
    return ops.softmax(wider(cx, x), axis=dim_of(dim, len(x.shape)))


def _log_softmax(cx, x, dim, *rest, **kw):
    x = wider(cx, x)
    d = dim_of(dim, len(x.shape))
    z = x - ops.max(x, d, keepdims=True)
    return z - ops.log(ops.sum(ops.exp(z), d, keepdims=True))


def _pad(cx, x, pad, mode="constant", value=None):
    """torch's pad: (before, after) pairs from the last dim backwards; numpy's np.pad."""
    if mode != "constant":
        cx.fail(f"with mode={mode!r} (constant padding only)")
    nd = len(x.shape)
    widths = [(0, 0)] * nd
    for i in range(len(pad) // 2):
        widths[nd - 1 - i] = (int(pad[2 * i]), int(pad[2 * i + 1]))
    if any(a < 0 or b < 0 for a, b in widths):
        cx.fail(f"with negative padding {tuple(pad)} (a crop: slice instead)")
    return np.pad(x, widths, constant_values=0 if value is None else value)


def _nll_loss(cx, x, target, weight=None, reduction=1, ignore_index=-100):
    """``nll_loss_forward``: (loss, total weight) of log-probabilities ``x`` [N, C] (or
    [C]) at ``target``; rows whose target is ``ignore_index`` count for nothing."""
    if weight is not None:
        cx.fail("with class weights")
    x = x if len(x.shape) == 2 else ops.reshape(x, (1,) + tuple(x.shape))
    t = target if len(target.shape) == 1 else ops.reshape(target, (1,))
    keep = t != ignore_index
    safe = np.where(keep, t, 0)
    picked = ops.reshape(ops.take_along_axis(x, ops.reshape(safe, (x.shape[0], 1)), 1),
                         (x.shape[0],))
    losses = np.where(keep, -picked, 0.0)
    total = ops.astype(ops.sum(keep), x.dtype)
    if reduction == 0:
        return losses if len(target.shape) == 1 else ops.reshape(losses, ()), total
    s = ops.sum(losses)
    return (s / total if reduction == 1 else s), total


def _cross_entropy(cx, x, target, weight=None, reduction=1, ignore_index=-100,
                   label_smoothing=0.0):
    """``cross_entropy_loss`` of logits [N, C] (or [C], or [N, C, d1, ..., dk]: the
    classes on dim 1, as torch's, the other dims rows) with class indices: the log-softmax
    over the classes, then :func:`_nll_loss`."""
    if label_smoothing:
        cx.fail(f"with label_smoothing={label_smoothing}")
    if np.dtype(target.dtype).kind == "f":
        cx.fail("with class probabilities as the target (class indices only)")
    nd = len(x.shape)
    if nd > 2:   # rows [N * d1 * ... * dk, C]
        x = ops.transpose(x, (0,) + tuple(range(2, nd)) + (1,))
        x = ops.reshape(x, (int(np.prod(x.shape[:-1])), x.shape[-1]))
        flat = ops.reshape(target, (x.shape[0],))
        out = _nll_loss(cx, _log_softmax(cx, x, 1), flat, weight, reduction, ignore_index)[0]
        return ops.reshape(out, tuple(target.shape)) if reduction == 0 else out
    logp = _log_softmax(cx, x, 1 if nd == 2 else 0)
    return _nll_loss(cx, logp, target, weight, reduction, ignore_index)[0]


# ----------------------------------------------------------------------------- norms
def _trailing(cx, x, normalized_shape, params):
    """Norms over the last ``k`` dims as eins's norms over the last one: flattened."""
    k = len(normalized_shape)
    n = int(np.prod(normalized_shape))
    flat = tuple(x.shape[:len(x.shape) - k]) + (n,)
    xs = x if k == 1 else ops.reshape(x, flat)
    ps = [p if p is None or k == 1 else ops.reshape(p, (n,)) for p in params]
    return xs, ps, n


def _layer_norm(cx, x, normalized_shape, weight=None, bias=None, eps=1e-5, *rest):
    xs, (w, b), n = _trailing(cx, x, normalized_shape, (weight, bias))
    w = np.ones(n, cx.dtype) if w is None else w
    b = np.zeros(n, cx.dtype) if b is None else b
    return ops.reshape(ops.layer_norm(xs, w, b, eps=eps), tuple(cx.shape))


def _rms_norm(cx, x, normalized_shape, weight=None, eps=None):
    xs, (w,), n = _trailing(cx, x, normalized_shape, (weight,))
    w = np.ones(n, cx.dtype) if w is None else w
    if eps is None:   # torch's default: the input dtype's machine epsilon
        eps = float(np.finfo(np.float32 if cx.dtype.itemsize < 4 else cx.dtype).eps)
    return ops.reshape(ops.rms_norm(xs, w, eps=eps), tuple(cx.shape))


# ----------------------------------------------------------------------------- the table
# overload packet name -> (converter, section of docs/torch.md)
ATEN = {}


def _add_ops(section, conv, *names):
    for n in names:
        ATEN[f"aten.{n}"] = (conv, section)


_add_ops("linear algebra", _linear, "linear")
_add_ops("linear algebra", _matmul, "matmul", "mm", "bmm")
_add_ops("linear algebra", _addmm, "addmm")
_add_ops("linear algebra", _baddbmm, "baddbmm")
_add_ops("linear algebra", _einsum, "einsum")
_add_ops("shapes", _as_shape, "view", "reshape", "_unsafe_view", "unsqueeze", "squeeze",
         "flatten", "unflatten")
_add_ops("shapes", _permute, "permute")
_add_ops("shapes", _transpose, "transpose", "t")
_add_ops("shapes", _mT, "mT")
_add_ops("shapes", _narrow, "narrow")
_add_ops("shapes", _stack, "stack")
_add_ops("shapes", _repeat, "repeat", "tile")
_add_ops("shapes", _repeat_interleave, "repeat_interleave")
_add_ops("shapes", _tri(True), "tril")
_add_ops("shapes", _tri(False), "triu")
_add_ops("shapes", _expand, "expand", "expand_as")
_add_ops("shapes", _slice, "slice")
_add_ops("shapes", _select, "select")
_add_ops("shapes", _cat, "cat", "concat")
_add_ops("shapes", _split, "split", "split_with_sizes", "chunk", "unbind")
_add_ops("shapes", _index, "index")
_add_ops("shapes", _embedding, "embedding")
_add_ops("shapes", _identity, "contiguous", "clone", "alias", "detach", "lift_fresh_copy")
_add_ops("shapes", _dropout, "dropout")
_add_ops("shapes", _empty_like, "empty_like")
_add_ops("elementwise", _add, "add")
_add_ops("elementwise", _sub, "sub")
_add_ops("elementwise", _rsub, "rsub")
_add_ops("elementwise", _binary("mul"), "mul")
_add_ops("elementwise", _div, "div")
_add_ops("elementwise", _pow, "pow")
_add_ops("elementwise", _binary("floor_divide"), "floor_divide")
_add_ops("elementwise", _binary("remainder"), "remainder")
for _n in ("neg", "abs", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "relu", "silu",
           "cos", "sin", "floor", "ceil", "trunc", "sign"):
    _add_ops("elementwise", _unary(_n), _n)
_add_ops("elementwise", _gelu, "gelu")
_add_ops("elementwise", _square, "square")
_add_ops("elementwise", _leaky_relu, "leaky_relu")
_add_ops("elementwise", _hardtanh, "hardtanh")
_add_ops("elementwise", _softplus, "softplus")
_add_ops("elementwise", _elu, "elu")
_add_ops("elementwise", _hardsigmoid, "hardsigmoid")
_add_ops("elementwise", _hardswish, "hardswish")
_add_ops("elementwise", _mish, "mish")
_add_ops("elementwise", _log_sigmoid, "log_sigmoid")
_add_ops("elementwise", _reciprocal, "reciprocal")
_add_ops("elementwise", _binary("maximum"), "maximum")
_add_ops("elementwise", _binary("minimum"), "minimum")
_add_ops("elementwise", _clamp, "clamp", "clamp_min")
_add_ops("elementwise", _clamp_max, "clamp_max")
for _t, _e in (("eq", "equal"), ("ne", "not_equal"), ("lt", "less"), ("le", "less_equal"),
               ("gt", "greater"), ("ge", "greater_equal")):
    _add_ops("elementwise", _binary(_e), _t)
_add_ops("elementwise", _where, "where")
_add_ops("elementwise", _masked_fill, "masked_fill")
_add_ops("elementwise", _and, "__and__", "bitwise_and", "logical_and")
_add_ops("elementwise", _or, "__or__", "bitwise_or", "logical_or")
_add_ops("elementwise", _not, "bitwise_not", "logical_not")
_add_ops("dtype casts", _cast, "to", "_to_copy", "type_as")
_add_ops("reductions", _reduction("sum"), "sum")
_add_ops("reductions", _reduction("mean"), "mean")
_add_ops("reductions", _reduction("max"), "amax")
_add_ops("reductions", _reduction("min"), "amin")
_add_ops("reductions", _extreme("max", "maximum"), "max")
_add_ops("reductions", _extreme("min", "minimum"), "min")
_add_ops("reductions", _argextreme("argmax"), "argmax")
_add_ops("reductions", _argextreme("argmin"), "argmin")
_add_ops("reductions", _topk, "topk")
_add_ops("reductions", _sort, "sort")
_add_ops("reductions", _argsort, "argsort")
_add_ops("reductions", _var, "var")
_add_ops("reductions", _std, "std")
_add_ops("reductions", _vector_norm, "linalg_vector_norm")
_add_ops("reductions", _softmax, "softmax", "_softmax")
_add_ops("reductions", _log_softmax, "log_softmax", "_log_softmax")
_add_ops("reductions", _nll_loss, "nll_loss_forward")
_add_ops("reductions", _cross_entropy, "cross_entropy_loss")
_add_ops("shapes", _pad, "pad", "constant_pad_nd")
_add_ops("norms", _layer_norm, "layer_norm")
_add_ops("norms", _rms_norm, "rms_norm")
_add_ops("attention", sdpa, "scaled_dot_product_attention")
_add_ops("experts", aten_experts.histc, "histc")
_add_ops("experts", aten_experts.cumsum, "cumsum")
_add_ops("experts", aten_experts.index_put, "index_put", "index_put_")
_add_ops("experts", aten_experts.grouped_mm, "_grouped_mm")
# transformers' own custom op where torch's grouped_mm does not apply (its CPU fallback)
ATEN["transformers.grouped_mm_fallback"] = (aten_experts.grouped_mm, "experts")
for _n, _c in aten_more.OPS.items():
    _add_ops("indices and losses", _c, _n)

# Ops whose value depends only on their inputs' shapes and dtypes (``new_ones(x, ...)``,
# ``zeros_like(x)``): folded like constants even when their input is computed.
SHAPE_ONLY = frozenset(f"aten.{n}" for n in (
    "new_ones", "new_zeros", "new_full", "ones_like", "zeros_like", "full_like",
    "sym_size", "sym_numel"))


def supported_ops() -> list[str]:
    """Every ATen op name (overload packet) the table maps, sorted."""
    return sorted(ATEN)


SECTION_NOTES = {
    "linear algebra": "`linear` is one einsum with the weight as stored ([out, in]).",
    "shapes": "`slice` with step 1 only; `repeat`, `tile` and `stack` are "
              "concatenations, `tril`/`triu` a `where` with a constant mask. `index` (index "
              "tensors on consecutive dims) and `embedding` are eins's gather primitive "
              "(`embedding`: ids in [0, num_embeddings), no negatives from the end). "
              "`dropout` only in eval mode.",
    "elementwise": "torch's type promotion: each result is cast to the dtype torch "
                   "recorded. The activations without an eins primitive (`softplus`, "
                   "`elu`, `mish`, ...) are composed of exp, log, tanh and where. `__and__`, `__or__`, `bitwise_not` on bool tensors only; "
                   "`div` with `rounding_mode` None or \"floor\" (`floor_divide`: "
                   "numpy's, floor rounding as torch's).",
    "dtype casts": "",
    "reductions": "`max`/`min` with a dim return (values, argmax/argmin); `topk`, `sort` "
                  "and `argsort` are eins's routing primitives (ties: lowest index first). "
                  "`log_softmax`, `std` and "
                  "`linalg_vector_norm` (the 2-norm) are composed of eins's reductions. "
                  "`cross_entropy_loss` takes class indices, the classes on dim 1 at any "
                  "rank ((N, C, d1, ...) as torch), without class weights or label "
                  "smoothing.",
    "norms": "over the trailing `normalized_shape` dims; a missing weight or bias is "
             "ones or zeros.",
    "attention": "`scaled_dot_product_attention` is kept whole (eins.attention): causal "
                 "(`is_causal`, or a constant causal mask), full (no mask or an all-true "
                 "one), a causal sliding window (`window=`), any other constant or "
                 "computed mask as eins.attention's `mask=` (boolean) or `bias=` "
                 "(additive: a padding mask; one broadcasting over queries or keys is "
                 "broadcast, a boolean (B, 1, 1, S) one is a key mask), `scale`, GQA "
                 "(`enable_gqa`, or "
                 "transformers' `repeat_kv`, whose copy is never computed); "
                 "`dropout_p > 0` is an UnsupportedOpError.",
    "experts": "what transformers' default mixture-of-experts layer records "
               "(eins/frontends/aten_experts.py): `histc` with a given range, `cumsum`, "
               "`index_put` as eins's `at[...].set`/`.add` (`accumulate=True`), and "
               "`_grouped_mm` of sorted rows [S, K] with weights [E, K, N] as one einsum "
               "over a one-hot of each row's group (every expert on every row: E times "
               "the grouped FLOPs, static shapes).",
    "indices and losses": aten_more.NOTE,
}


def supported_ops_markdown() -> str:
    """docs/torch.md's op list, generated from :data:`ATEN` (a test keeps them equal)."""
    lines = ["<!-- generated by eins.frontends.aten.supported_ops_markdown(): "
             "do not edit by hand -->", ""]
    for section in SECTION_NOTES:
        names = sorted(n for n, (_, s) in ATEN.items() if s == section)
        lines.append(f"- **{section}**: " + ", ".join(f"`{n}`" for n in names)
                     + (f". {SECTION_NOTES[section]}" if SECTION_NOTES[section] else ""))
    lines += ["", "Folded at conversion time whatever the inputs (they read only shapes "
              "and dtypes): " + ", ".join(f"`{n}`" for n in sorted(SHAPE_ONLY)) + "."]
    return "\n".join(lines) + "\n"
