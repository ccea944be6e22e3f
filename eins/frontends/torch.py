"""``eins.from_torch(module, *example_args, **example_kwargs) -> (fn, params)``: a PyTorch
module as a plain eins-traceable function.

The module goes through ``torch.export.export(..., strict=False)`` (no decomposition is run,
so ``scaled_dot_product_attention`` stays one op). Its graph is then read once, node by
node:

- **constants are folded with torch now**: a node whose inputs are all constants (graph
  constants, non-persistent buffers, Python values of the call, ``arange``/``triu``
  results, position ids, causal masks, rotary tables) is evaluated eagerly, and so is an op
  that reads only its input's shape and dtype (``new_ones``, ``zeros_like``). On the meta
  device the folded values that come from meta buffers are unknown: they stand in as zeros
  of their shape (planning needs shapes only; such a function is for ``.lower``, not to
  run);
- **the rest is mapped** through the table of eins/frontends/aten.py; an op missing from it
  is an :class:`eins.errors.UnsupportedOpError` naming the op, the submodule
  (``nn_module_stack``), the source line (``stack_trace``) and the supported ops.

``params`` holds the parameters and persistent buffers as numpy arrays by name
(``eins.ShapeDtype`` on the meta device), a tied tensor once, under the name
``named_parameters()`` keeps (:func:`canonical_names`). Non-persistent buffers are
derived from the configuration (rotary frequencies, position ids), so they are constants.

``fn(params, *args, **kwargs)`` takes the call's arguments as the module does (arrays for
tensors) and returns the module's output with plain containers: a transformers
``ModelOutput`` becomes a dict of its fields, a tuple stays a tuple. Python values of the
example call (``use_cache=False``) are baked in; a transformers model whose ``forward``
takes ``use_cache`` is converted with ``use_cache=False`` unless the call says otherwise
(a KV cache is decoding state, not part of a traced function's result).
"""
from __future__ import annotations

import hashlib
import inspect
import itertools
import operator
import re

import numpy as np

import eins.ops as ops
from eins.api import make_ir
from eins.errors import EinsError, ExportError, TraceError, UnsupportedOpError
from eins.frontends.aten import ATEN, SHAPE_ONLY, supported_ops
from eins.frontends.node import Node
from eins.ir.types import torch_to_numpy
from eins.runtime.gpu_ops import numpy_dtype
from eins.tracing import ShapeDtype

__all__ = ["from_torch", "Converted"]

_INPUT_KINDS = ("PARAMETER", "BUFFER", "CONSTANT_TENSOR", "USER_INPUT")
# random only with dropout on: their converters refuse that (dropout_p > 0, train=True)
_RANDOM_CHECKED = ("aten.dropout", "aten.scaled_dot_product_attention")


def from_torch(module, *example_args, **example_kwargs):
    """Convert ``module`` as called with these example arguments; returns ``(fn, params)``
    (module docstring). Shapes, dtypes and Python values are those of the example call."""
    conv = Converted(module, example_args, example_kwargs)
    return conv.fn, conv.params


def _op_name(target) -> str:
    """``aten.linear`` for ``aten.linear.default`` (the table is by overload packet)."""
    packet = getattr(target, "_overloadpacket", None)
    if packet is not None:
        return f"{packet._qualified_op_name.replace('::', '.')}"
    return getattr(target, "__name__", str(target))


def _frames(stack_trace: str):
    return re.findall(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)', stack_trace or "")


def where_from(node, torch_dir: str) -> str:
    """``in model.layers.0.mlp.act_fn (SiLU), at file.py:103: code``: the submodule a node
    came from and the innermost source line outside torch itself (the model's own line)."""
    stack = node.meta.get("nn_module_stack") or {}
    path, kind = next(reversed(stack.values()), ("", ""))
    parts = [f"in {path or '<the module itself>'}" + (f" ({kind.rsplit('.', 1)[-1]})"
                                                       if kind else "")]
    frames = _frames(node.meta.get("stack_trace", ""))
    own = [f for f in frames if not f[0].startswith(torch_dir)]
    if frames:
        file, line, code = (own or frames)[-1]
        parts.append(f"at {file}:{line}: {code.strip()}")
    return ", ".join(parts)


def _is_view(node) -> bool:
    """A node whose result aliases its input (slice, view, transpose, ...)."""
    return getattr(node.target, "is_view", False)


def _is_tensor(x) -> bool:
    return type(x).__module__.split(".")[0] == "torch" and hasattr(x, "dtype") \
        and hasattr(x, "shape") and not isinstance(x, type)


def _value_shape_dtype(v):
    """(shapes, dtypes) of a node's recorded value(s) (a FakeTensor or a list of them)."""
    vs = v if isinstance(v, (list, tuple)) else [v]
    shapes = [tuple(t.shape) if _is_tensor(t) else () for t in vs]   # SymInts stay
    dtypes = [np.dtype(numpy_dtype(t.dtype)) if _is_tensor(t) else None for t in vs]
    return shapes, dtypes


def canonical_names(module) -> dict:
    """Each name of ``module``'s parameters and buffers -> the name torch lists that tensor
    under: the first of its names in ``named_parameters()`` / ``named_buffers()``, whose
    deduplication drops the others (tied weights: a GPT-2 head is its embedding)."""
    first, names = {}, {}
    for name, t in itertools.chain(module.named_parameters(remove_duplicate=False),
                                   module.named_buffers(remove_duplicate=False)):
        names[name] = first.setdefault(id(t), name)
    return names


def tensor_token(t) -> tuple:
    """What tells a tensor's data apart from what it was: the object, its storage and its
    version counter (bumped by every in-place change made through it)."""
    return id(t), t.data_ptr(), t._version


class Converted:
    """One exported module, read once: its parameters, its folded constants and the nodes
    left to map, and ``fn`` (module docstring)."""

    def __init__(self, module, args, kwargs):
        import torch  # heavy, optional: only a torch module is converted
        if not isinstance(module, torch.nn.Module):
            raise TraceError(f"eins.from_torch expects a torch.nn.Module, got "
                             f"{type(module).__name__}")
        self._torch = torch
        self._torch_dir = torch.__file__.rsplit("/", 1)[0] + "/"
        self.name = type(module).__name__
        kwargs = dict(kwargs)
        self.defaults = {}
        if "use_cache" in inspect.signature(module.forward).parameters \
                and "use_cache" not in kwargs:
            self.defaults["use_cache"] = False
        kwargs.update(self.defaults)
        self.kwarg_order = tuple(kwargs)
        self.ep = self._export(module, tuple(args), kwargs)
        self.example_leaves, self.in_spec = torch.utils._pytree.tree_flatten(
            (tuple(args), kwargs))
        self.out_spec = self.ep.call_spec.out_spec
        self._numpy, self._memo = {}, {}   # constants as numpy arrays; facts about them
        self._read_signature(canonical_names(module))
        self._fold()
        self.shape_only = any(isinstance(v, ShapeDtype) for v in self.params.values()) or \
            any(t.is_meta for t in self.consts.values() if _is_tensor(t))
        self._check_by_tracing()

    # ------------------------------------------------------------------ export
    def _export(self, module, args, kwargs):
        torch = self._torch
        try:
            return torch.export.export(module, args, kwargs, strict=False)
        except EinsError:
            raise
        except Exception as e:   # the exporter's own error types vary across torch versions
            msg = str(e).strip()
            data = ("data-dependent" in msg.lower() or "DataDependent" in type(e).__name__
                    or "guard" in type(e).__name__.lower())
            why = ("its control flow depends on tensor values (a Python `if`, `for` or "
                   "`.item()` on data), which a traced program cannot follow: compute both "
                   "branches and select with torch.where, or make the decision a Python "
                   "argument" if data else "torch.export could not capture it")
            first = "\n".join(msg.splitlines()[:12])
            raise ExportError(f"eins.from_torch cannot take {self.name}: {why}. torch.export "
                              f"said ({type(e).__name__}): {first}") from e

    def _read_signature(self, canonical):
        sig = self.ep.graph_signature
        by_name = {n.name: n for n in self.ep.graph.nodes if n.op == "placeholder"}
        self.params, self.param_of, self.consts, self.user_nodes = {}, {}, {}, []
        self.read = {}   # state name -> (token of the tensor read, whether it is a param)
        self._folded = {}   # non-persistent buffer name -> a copy of the values folded
        self.input_names = {}
        for spec in sig.input_specs:
            kind = spec.kind.name
            node = by_name[spec.arg.name]
            self.input_names[node] = spec.target or f"the input {spec.arg.name}"
            if kind not in _INPUT_KINDS:
                raise UnsupportedOpError(f"eins.from_torch cannot take {self.name}: its "
                                         f"exported graph has an input of kind {kind} "
                                         f"({spec.arg.name}); supported: {_INPUT_KINDS}")
            if kind == "USER_INPUT":
                self.user_nodes.append(node)
            elif kind == "PARAMETER" or (kind == "BUFFER" and spec.persistent):
                # a tied tensor (two names, one object) is one entry under the name torch
                # lists it by, read by every placeholder of it
                name = canonical.get(spec.target, spec.target)
                t = self.ep.state_dict[spec.target]
                self.params[name] = (ShapeDtype(tuple(t.shape), numpy_dtype(t.dtype))
                                     if t.is_meta else torch_to_numpy(t, f"parameter {name}"))
                self.param_of[node] = name
                self.read[name] = (tensor_token(t), True)
            else:   # non-persistent buffers and lifted constants: part of the program
                self.consts[node] = self.ep.constants[spec.target]
                if kind == "BUFFER":
                    name = canonical.get(spec.target, spec.target)
                    t = self.consts[node]
                    self.read[name] = (tensor_token(t), False)
                    if not t.is_meta:   # its values as folded (refresh compares them)
                        self._folded[name] = t.detach().clone()
        if len(self.user_nodes) != len(self.example_leaves):
            raise ExportError(f"eins.from_torch: {self.name}'s exported graph takes "
                              f"{len(self.user_nodes)} inputs where its call has "
                              f"{len(self.example_leaves)} leaves")
        for node, leaf in zip(self.user_nodes, self.example_leaves):
            if not _is_tensor(leaf):
                self.consts[node] = leaf
        out = [s for s in sig.output_specs if s.kind.name != "USER_OUTPUT"]
        if out:
            raise UnsupportedOpError(f"eins.from_torch cannot take {self.name}: it changes "
                                     f"{out[0].target} in place ({out[0].kind.name}); an eins "
                                     f"program is a pure function (call module.eval())")

    def refresh(self, state) -> bool:
        """Read the module's parameters and buffers as they are now (``state``: {name:
        tensor} of its ``named_parameters()`` and ``named_buffers()``): a parameter or
        persistent buffer whose tensor changed since it was read (another object bound to
        its name, new ``.data``, or an in-place change: its version counter moved) is read
        again into ``params``; returns whether any was, or None when a non-persistent
        buffer changed (its values compared too: a change through ``.data`` moves no
        counter): it is folded into the program, so the module must be converted again
        (ModuleFunction does). The dtypes and shapes are those converted for (the caller
        keys its conversions by them)."""
        changed = False
        for name, (token, is_param) in self.read.items():
            t = state.get(name)
            if t is None:
                continue
            if not is_param:
                was = self._folded.get(name)
                if tensor_token(t) != token or (was is not None and not (
                        t.device == was.device and self._torch.equal(t, was))):
                    return None
                continue
            if tensor_token(t) == token:
                continue
            self.params[name] = torch_to_numpy(t, f"parameter {name}")
            self.read[name] = (tensor_token(t), True)
            changed = True
        return changed

    # ------------------------------------------------------------------ folding
    def _eager(self, node, args, kwargs):
        """Run ``node`` with torch on constant arguments; on the meta device whatever
        touches a meta tensor stays meta (its values unknown), the rest runs on the CPU."""
        torch = self._torch
        tmap = torch.utils._pytree.tree_map
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        meta = any(_is_tensor(x) and x.is_meta for x in leaves)
        dev = torch.device("meta" if meta else "cpu")

        def move(x):
            if isinstance(x, torch.device):
                return dev if (meta or x.type == "meta") else x
            if _is_tensor(x) and meta and not x.is_meta:
                return x.to("meta")
            return x
        args, kwargs = tmap(move, (args, kwargs))
        with torch.no_grad():
            return node.target(*args, **kwargs)

    def _draws_random(self, node) -> bool:
        """Whether ``node`` draws random numbers in this call: its op carries torch's
        ``nondeterministic_seeded`` tag, unless its own flags say it draws nothing here (a
        train flag off, or a dropout probability of 0: aten.gru in eval mode)."""
        if self._torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
            return False
        schema = getattr(node.target, "_schema", None)
        if schema is None:
            return True
        given = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
        given.update(zip((a.name for a in schema.arguments), node.args))
        given.update(node.kwargs)
        if any(given.get(k) is False for k in ("train", "training")):
            return False
        p = next((given[k] for k in ("p", "dropout", "dropout_p") if k in given), None)
        return not (isinstance(p, (int, float)) and not isinstance(p, bool) and p == 0)

    def _stand_in(self, node):
        """A tensor of ``node``'s recorded shape and dtype, for an op that reads only that."""
        v = node.meta.get("val")
        return self._torch.empty(tuple(v.shape), dtype=v.dtype) if _is_tensor(v) else v

    def _fold(self):
        map_arg = self._torch.fx.node.map_arg
        self.traced = []   # (node, converter, the node it changes in place or None)
        for node in self.ep.graph.nodes:
            if node.op != "call_function":
                continue
            name = _op_name(node.target)
            if name == "aten._assert_tensor_metadata":
                continue   # a check torch made while tracing; no value
            where = where_from(node, self._torch_dir)
            shapes, _ = _value_shape_dtype(node.meta.get("val"))
            if any(not isinstance(d, int) for s in shapes for d in s):
                raise UnsupportedOpError(f"eins cannot map {node.target}: its result's shape "
                                         f"{shapes[0]} depends on the data ({where})")
            if name not in _RANDOM_CHECKED and self._draws_random(node):
                raise UnsupportedOpError(f"eins cannot map {node.target}: it draws random "
                                         f"numbers, and a converted program would keep one "
                                         f"draw for every call ({where})")
            # an in-place op (add_, div_) is its functional op whose result replaces the
            # tensor it changed; changing an input or the module's state is refused
            changed = None
            if re.fullmatch(r"aten\.[a-z]\w*[a-z0-9]_", name):
                changed, name = node.args[0], name[:-1]
                if changed.op == "placeholder":
                    raise UnsupportedOpError(
                        f"eins.from_torch cannot take {self.name}: it changes "
                        f"{self.input_names[changed]} in place with {node.target} ({where}); "
                        f"an eins program is a pure function (call module.eval() first)")
                if _is_view(changed) or any(_is_view(u) for u in changed.users):
                    raise UnsupportedOpError(
                        f"eins cannot map {node.target} on a tensor that shares memory with "
                        f"another (a view); write it out of place ({where})")
            inputs = node.all_input_nodes
            if all(n in self.consts for n in inputs):
                args = map_arg((node.args, node.kwargs), self.consts.__getitem__)
                if changed is not None:   # on a copy: a folded value may be a buffer itself
                    args = ((args[0][0].clone(),) + tuple(args[0][1:]), args[1])
                self.consts[node] = self._eager(node, *args)
                if changed is not None:
                    self.consts[changed] = self.consts[node]
            elif name in SHAPE_ONLY:
                def known(n):
                    return self.consts[n] if n in self.consts else self._stand_in(n)
                self.consts[node] = self._eager(node, *map_arg((node.args, node.kwargs),
                                                               known))
            elif node.target is operator.getitem:
                self.traced.append((node, None, None))
            elif name in ATEN:
                self.traced.append((node, ATEN[name][0], changed))
            else:
                raise UnsupportedOpError(f"eins cannot map the ATen op {node.target} "
                                         f"({where}); supported ops: "
                                         f"{', '.join(supported_ops())}")

    def _check_by_tracing(self):
        """Trace once on shapes, so a converter's refusal (a sliding-window mask, a strided
        slice) is raised by from_torch, not by the first call."""
        arrays = [ShapeDtype(tuple(x.shape), numpy_dtype(x.dtype))
                  for x in self.example_leaves if _is_tensor(x)]
        abstract = {k: v if isinstance(v, ShapeDtype) else ShapeDtype(v.shape, v.dtype)
                    for k, v in self.params.items()}
        make_ir(self.flat_fn)(abstract, *arrays)

    # ------------------------------------------------------------------ the function
    def _const(self, node):
        """A folded value as eins takes it: a numpy array (zeros of its shape when only
        its shape is known), a 0-d tensor as a Python number (weak, as torch treats it).
        Equal arrays are one object, so eins holds one constant for them (the rotary
        tables every layer unsqueezes again)."""
        if node not in self._numpy:
            v = self.consts[node]
            if _is_tensor(v):
                if v.is_meta:
                    self.shape_only = True
                    v = self._shared(np.zeros(tuple(v.shape), numpy_dtype(v.dtype)), "zeros")
                else:
                    v = torch_to_numpy(v, f"the constant {node.name}")
                    v = v.item() if v.ndim == 0 else self._shared(v)
            elif isinstance(v, (list, tuple)):
                v = type(v)(torch_to_numpy(t).item() if _is_tensor(t) and t.ndim == 0 else
                            torch_to_numpy(t) if _is_tensor(t) else t for t in v)
            self._numpy[node] = v
        return self._numpy[node]

    def _shared(self, a: np.ndarray, content=None) -> np.ndarray:
        if content is None:
            content = hashlib.sha1(np.ascontiguousarray(a).view(np.uint8)).digest()
        return self._memo.setdefault(("const", a.shape, a.dtype.str, content), a)

    def _leaves(self, args, kwargs):
        """The call's leaves in the export's order (kwargs reordered as the example's)."""
        kwargs = {**kwargs, **{k: v for k, v in self.defaults.items() if k not in kwargs}}
        if set(kwargs) != set(self.kwarg_order):
            raise TraceError(f"{self.name} was converted for keyword arguments "
                             f"{sorted(self.kwarg_order)}, called with {sorted(kwargs)}")
        kwargs = {k: kwargs[k] for k in self.kwarg_order}
        leaves, spec = self._torch.utils._pytree.tree_flatten((tuple(args), kwargs))
        if spec != self.in_spec:
            raise TraceError(f"{self.name} was converted for arguments structured as "
                             f"{self.in_spec}, called with {spec}")
        for k, (got, want) in enumerate(zip(leaves, self.example_leaves)):
            if not _is_tensor(want) and got != want:
                raise TraceError(f"{self.name} was converted with the Python value "
                                 f"{want!r} as its input {k}, called with {got!r}: convert "
                                 f"it again for that value")
        return leaves

    def fn(self, params, *args, **kwargs):
        """The module's forward as eins operators (module docstring)."""
        return self._run(params, self._leaves(args, kwargs))

    def flat_fn(self, params, *arrays):
        """``fn`` taking only the call's tensors, in the order the call lists them, with its
        other values (strings, flags, None) as they were: what eins.jit/eins.distribute of
        a module trace (eins's signature takes arrays and numbers only)."""
        want = sum(map(_is_tensor, self.example_leaves))
        if len(arrays) != want:
            raise TraceError(f"{self.name} was converted for a call with {want} tensors, "
                             f"got {len(arrays)} arrays")
        it = iter(arrays)
        return self._run(params, [next(it) if _is_tensor(x) else x
                                  for x in self.example_leaves])

    def _run(self, params, leaves):
        env, notes = {}, {}
        for node, leaf in zip(self.user_nodes, leaves):
            if node not in self.consts:
                env[node] = leaf
        for node, name in self.param_of.items():
            if name not in params:
                raise TraceError(f"{self.name}: params has no {name!r} (it holds "
                                 f"{len(params)} arrays; pass the params from_torch returned)")
            env[node] = params[name]

        def value(n):
            return env[n] if n in env else self._const(n)

        map_arg = self._torch.fx.node.map_arg
        for node, conv, changed in self.traced:
            args_, kwargs_ = map_arg((node.args, node.kwargs), value)
            if conv is None:   # operator.getitem on a multi-output node
                env[node] = args_[0][args_[1]]
                continue
            shapes, dtypes = _value_shape_dtype(node.meta.get("val"))
            cx = Node(str(node.target), shapes, dtypes,
                      where_from(node, self._torch_dir), notes, self._memo)
            try:
                out = conv(cx, *args_, **kwargs_)
            except UnsupportedOpError:
                raise
            except EinsError as e:
                raise type(e)(f"{e} (mapping {node.target} {cx.where})") from None
            env[node] = self._recorded(cx, out)
            if changed is not None:
                env[changed] = env[node]
        (outs,) = [n.args[0] for n in self.ep.graph.nodes if n.op == "output"]
        leaves = iter(value(n) if hasattr(n, "op") else n for n in outs)
        return plain_tree(self.out_spec, leaves)

    def _recorded(self, cx, out):
        """``out`` in the dtype torch recorded (torch's promotion, not numpy's), checked
        against the recorded shape."""
        many = isinstance(out, (list, tuple))
        outs = list(out) if many else [out]
        fixed = []
        for x, shape, dtype in zip(outs, cx.shapes, cx.dtypes):
            if tuple(x.shape) != shape:
                raise EinsError(f"eins's mapping of {cx.op} gave shape {tuple(x.shape)} "
                                f"where torch recorded {shape} ({cx.where})")
            fixed.append(x if dtype is None or np.dtype(x.dtype) == dtype
                         else ops.astype(x, dtype))
        return fixed if many else fixed[0]


def plain_tree(spec, leaves):
    """The output structure ``spec`` (torch's pytree) with plain containers: lists, tuples
    (namedtuples too), None, and dicts for anything keyed (dict, a ``ModelOutput``)."""
    if spec.is_leaf():
        return next(leaves)
    kids = [plain_tree(c, leaves) for c in spec.children()]
    if spec.type is list:
        return kids
    if spec.type is type(None):
        return None
    if issubclass(spec.type, tuple):
        return tuple(kids)
    keys = spec.context
    if isinstance(keys, (list, tuple)) and len(keys) == len(kids):
        return dict(zip(keys, kids))
    raise TraceError(f"eins.from_torch: cannot return a {spec.type.__name__} (its fields "
                     f"are not keyed); return a tuple, list or dict")


def torch_leaves(spec, value) -> list:
    """The leaves of ``value`` (a :func:`plain_tree` result) in torch's order for ``spec``."""
    if spec.is_leaf():
        return [value]
    if spec.type is type(None):
        return []
    if spec.type is list or issubclass(spec.type, tuple):
        parts = list(value)
    else:
        parts = [value[k] for k in spec.context]
    return [leaf for c, v in zip(spec.children(), parts) for leaf in torch_leaves(c, v)]
