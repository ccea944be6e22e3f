"""The paper's own graph API (Section 2), a thin front end over the tracer.

The listing of Section 2 runs verbatim with ``import eins as es``::

    graph = es.createGraph()
    x = graph.insertTensor(es.tensorDesc([tokens, d_model], dtype))
    w1 = graph.insertTensor(es.tensorDesc([d_model, d_ff], dtype))
    w2 = graph.insertTensor(es.tensorDesc([d_ff, d_model], dtype))
    act = graph.matmul(x, w1)
    hidden = graph.unary(act, "relu", 0.0)
    y = graph.matmul(hidden, w2)
    graph.save(y)
    compiled = es.compileGraph(graph)
    compiled.load(x, X); compiled.load(w1, W1); compiled.load(w2, W2)
    compiled.execute()
    Y = compiled.offload(y)

Each graph call records an abstract operator (Definition 3.3); ``compileGraph`` turns the
graph into a Python function over its inserted tensors and traces it, so it yields exactly the
IR ``eins.make_ir`` gives for the same computation written with eins operators. Shapes are
checked when an operator is added, so a mismatch names the user's line.

``unary(x, op, param)``: the third argument is the operator's scalar parameter. For ``"relu"``
it is the negative slope (``0.0`` is the plain ReLU, any other value a leaky ReLU
``where(x > 0, x, param * x)``); ``"pow"`` raises to ``param``; ``"scale"`` multiplies by it.
Every other unary operator takes no parameter and rejects a non-zero one.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

import eins.ops as eins
from eins.api import distribute
from eins.arguments import device_ids
from eins.errors import DTypeError, EinsError, PlanError, ShapeError
from eins.ir.primitive import PRIMITIVES
from eins.ir.types import TensorType, as_dtype, dtype_name
from eins.runtime.devices import default_device_count
from eins.tracing import ShapeDtype, bind, check_shape, trace

__all__ = ["createGraph", "tensorDesc", "compileGraph", "Graph", "TensorDesc", "GraphTensor",
           "CompiledGraph", "UNARY_OPS", "BINARY_OPS", "SCHEDULE_MODES"]

class _PaperOps(Mapping):
    """The graph API's operator names of ``arity`` operands -> (primitive name, static
    parameters): each elementwise primitive's ``paper_names`` (declared in its op family
    file), read from the registry on each use, and ``extra``, the graph API's own
    parameterized operators (the module docstring)."""

    def __init__(self, arity: int, extra: dict):
        self.arity, self.extra = arity, extra

    def _table(self) -> dict:
        out = {n: (p.name, params) for p in PRIMITIVES.values()
               if p.expression is not None and len(p.expression.operands) == self.arity
               for n, params in p.paper_names.items()}
        out.update(self.extra)
        return out

    def __getitem__(self, name):
        return self._table()[name]

    def __iter__(self):
        return iter(self._table())

    def __len__(self):
        return len(self._table())


# "pow" raises to the parameter, "scale" multiplies by it (binary primitives, the parameter
# their right operand); relu's parameter is a negative slope
UNARY_OPS = _PaperOps(1, {"pow": ("pow", {}), "scale": ("mul", {})})
_PARAM_UNARY = {"relu", "pow", "scale"}
BINARY_OPS = _PaperOps(2, {})
SCHEDULE_MODES = ("naive", "ai")


@dataclass(frozen=True)
class TensorDesc:
    """``tensorDesc(shape, dtype)``: the type of a graph input."""

    shape: tuple
    dtype: np.dtype

    def __repr__(self):
        return f"tensorDesc({list(self.shape)}, {dtype_name(self.dtype)})"


def tensorDesc(shape, dtype="float32") -> TensorDesc:
    """The shape (a list or tuple of non-negative ints) and dtype (a numpy dtype or its name)
    of a tensor to insert."""
    if dtype is None:   # np.dtype(None) would silently be float64
        raise DTypeError("tensorDesc: dtype is None; give a dtype or its name ('float32', "
                         "'bf16', ...), or leave it out for float32")
    try:
        shp = check_shape(shape, "tensorDesc")
    except ShapeError as e:  # the paper writes shapes as lists
        raise ShapeError(f"tensorDesc: shape must be a list of non-negative ints, got "
                         f"{shape!r} ({e})") from None
    return TensorDesc(shp, as_dtype(dtype))


class GraphTensor:
    """A tensor of a graph: an inserted input or an operator's result."""

    __slots__ = ("graph", "index", "type")

    def __init__(self, graph, index, type_):
        self.graph = graph
        self.index = index
        self.type = type_

    shape = property(lambda self: self.type.shape)
    dtype = property(lambda self: self.type.dtype)

    def __repr__(self):
        return f"GraphTensor(#{self.index}, {self.type!r})"


class Graph:
    """``createGraph()``: an empty computation to which operators are added."""

    def __init__(self):
        self.inputs: list[GraphTensor] = []
        self.saved: list[GraphTensor] = []
        # one node per tensor, in creation order: (op, input indices, params); op None = input
        self._nodes: list[tuple] = []
        self._tensors: list[GraphTensor] = []

    # ------------------------------------------------------------------ building
    def insertTensor(self, desc: TensorDesc) -> GraphTensor:
        """Add an input of type ``desc`` (loaded with ``load`` after compilation)."""
        if not isinstance(desc, TensorDesc):
            raise EinsError(f"insertTensor expects es.tensorDesc(shape, dtype), got "
                            f"{type(desc).__name__}: {desc!r:.80}")
        t = self._new(None, (), {}, TensorType(desc.shape, desc.dtype))
        self.inputs.append(t)
        return t

    def matmul(self, a, b) -> GraphTensor:
        """``a @ b`` (numpy matmul semantics)."""
        return self._op("matmul", (a, b), {})

    def unary(self, x, op: str, param: float = 0.0) -> GraphTensor:
        """An elementwise unary operator by name (``UNARY_OPS``); ``param`` is its scalar
        parameter (see the module docstring)."""
        if not isinstance(op, str) or op not in UNARY_OPS:
            raise EinsError(f"unary: unknown operator {op!r}; known: {sorted(UNARY_OPS)}")
        try:
            param = float(param)
        except (TypeError, ValueError):
            raise EinsError(f"unary {op!r}: the parameter must be a number, got {param!r}") from None
        if op not in _PARAM_UNARY and param != 0.0:
            raise EinsError(f"unary {op!r} takes no parameter; got {param!r} (pass 0.0)")
        return self._op("unary", (x,), {"op": op, "param": param})

    def binary(self, a, b, op: str) -> GraphTensor:
        """An elementwise binary operator by name (``BINARY_OPS``), numpy broadcasting."""
        if not isinstance(op, str) or op not in BINARY_OPS:
            raise EinsError(f"binary: unknown operator {op!r}; known: {list(BINARY_OPS)}")
        return self._op("binary", (a, b), {"op": op})

    def einsum(self, subscripts: str, *operands) -> GraphTensor:
        """``eins.einsum(subscripts, *operands)``."""
        if not isinstance(subscripts, str):
            raise EinsError(f"einsum: subscripts must be a string, got {subscripts!r}")
        return self._op("einsum", operands, {"subscripts": subscripts})

    def save(self, t: GraphTensor) -> GraphTensor:
        """Mark ``t`` as an output that remains available after execution (``offload``)."""
        self._own(t, "save")
        if t not in self.saved:
            self.saved.append(t)
        return t

    # ------------------------------------------------------------------ internals
    def _own(self, t, what):
        if not isinstance(t, GraphTensor):
            raise EinsError(f"{what}: expected a tensor of this graph, got "
                            f"{type(t).__name__}: {t!r:.80}")
        if t.graph is not self:
            raise EinsError(f"{what}: {t!r} belongs to another graph")

    def _new(self, op, ins, params, type_):
        t = GraphTensor(self, len(self._tensors), type_)
        self._nodes.append((op, tuple(i.index for i in ins), params))
        self._tensors.append(t)
        return t

    def _op(self, op, ins, params):
        for t in ins:
            self._own(t, op)
        # Type the new tensor by tracing this one operator on its inputs' types: shape and
        # dtype errors surface here, naming the user's line.
        sds = [ShapeDtype(t.shape, t.dtype) for t in ins]
        prog, _, _ = trace(lambda *xs: _apply(op, params, xs), sds)
        return self._new(op, ins, params, prog.outputs[0].type)

    def function(self):
        """A Python function of the inserted tensors (in insertion order) returning the saved
        tensors (a tuple, in save order): the graph as an eins-traceable function."""
        if not self.saved:
            raise EinsError("the graph saves no tensor; call graph.save(t) on its results")
        nodes, saved = list(self._nodes), list(self.saved)

        def graph(*args):
            vals = {}
            it = iter(args)
            for i, (op, ins, params) in enumerate(nodes):
                if op is None:
                    vals[i] = next(it)
                else:
                    vals[i] = _apply(op, params, [vals[j] for j in ins])
            return tuple(vals[t.index] for t in saved)

        graph.__name__ = "graph"
        return graph

    def __repr__(self):
        return (f"Graph({len(self.inputs)} inputs, {len(self._nodes) - len(self.inputs)} "
                f"operators, {len(self.saved)} saved)")


def _apply(op, params, xs):
    """One graph operator on traced values, written with the eins operators themselves."""
    if op == "matmul":
        return eins.matmul(*xs)
    if op == "einsum":
        return eins.einsum(params["subscripts"], *xs)
    if op == "binary":
        return bind(BINARY_OPS[params["op"]][0], *xs)
    # unary
    name, p = params["op"], params["param"]
    (x,) = xs
    if name == "relu" and p != 0.0:
        return eins.where(x > 0, x, x * p)
    if name == "pow":
        return x ** p
    if name == "scale":
        return x * p
    prim, static = UNARY_OPS[name]
    return bind(prim, x, **static)


def createGraph() -> Graph:
    """An empty graph (paper Section 2)."""
    return Graph()


def _devices(device):
    """The paper's ``device`` argument: a list of ids or one id (not a count, unlike
    ``eins.distribute``'s ``devices``); None is every visible GPU, else 8 virtual devices."""
    if device is None:
        return tuple(range(default_device_count()))
    if isinstance(device, (bool, np.bool_)):
        raise PlanError(f"compileGraph: device must be a device id or a list of them, got "
                        f"{device!r}")
    if isinstance(device, (int, np.integer)):   # one id (ids[i] of a numpy array too)
        device = [int(device)]
    return device_ids(device)


class CompiledGraph:
    """The result of ``compileGraph``: ``load`` inputs as numpy arrays, ``execute`` (on the
    devices: virtual CPU devices without GPUs), then ``offload`` saved tensors. ``program``
    is the traced IR, ``lowered`` every stage (``lowered.as_text("planned")`` etc.)."""

    def __init__(self, graph: Graph, lowered, devices, schedule_mode):
        self.graph = graph
        self.lowered = lowered
        self.program = lowered.program
        self._compiled = None
        self.devices = devices
        self.schedule_mode = schedule_mode
        # The graph as compiled: tensors inserted or saved later are not part of this program
        # (the user may go on building the graph, then compile it again).
        self.inputs = tuple(graph.inputs)
        self.saved = tuple(graph.saved)
        self._loaded: dict[int, np.ndarray] = {}
        self._results: dict[int, np.ndarray] | None = None

    def load(self, tensor: GraphTensor, array) -> None:
        """Give an inserted tensor its value; the array is converted to the declared dtype
        (same-kind casts only) and must have the declared shape."""
        self.graph._own(tensor, "load")
        if tensor not in self.graph.inputs:
            raise EinsError(f"load: {tensor!r} is an operator's result, not an inserted tensor")
        if tensor not in self.inputs:
            raise EinsError(f"load: {tensor!r} was inserted after compileGraph; this compiled "
                            f"graph has inputs {list(self.inputs)} (call compileGraph again)")
        a = np.asarray(array)
        if tuple(a.shape) != tensor.shape:
            raise ShapeError(f"load: array of shape {tuple(a.shape)} for {tensor!r}, declared "
                             f"shape {tensor.shape}")
        try:
            # a copy: the array may change between load and execute
            a = a.astype(tensor.dtype, casting="same_kind", copy=True)
        except TypeError:
            raise DTypeError(f"load: array of dtype {a.dtype.name} cannot be cast to the "
                             f"declared {dtype_name(tensor.dtype)} of {tensor!r}") from None
        self._loaded[tensor.index] = a
        self._results = None

    def execute(self) -> None:
        """Run the program on the loaded inputs."""
        missing = [t for t in self.inputs if t.index not in self._loaded]
        if missing:
            raise EinsError(f"execute: inputs not loaded: {missing}; call load(tensor, array)")
        if self._compiled is None:
            self._compiled = self.lowered.compile()
        outs = self._compiled(*[self._loaded[t.index] for t in self.inputs])
        outs = outs if isinstance(outs, tuple) else (outs,)
        self._results = {t.index: o for t, o in zip(self.saved, outs)}

    def offload(self, tensor: GraphTensor) -> np.ndarray:
        """The value of a saved tensor after ``execute`` (a numpy array)."""
        self.graph._own(tensor, "offload")
        if tensor not in self.saved:
            late = " (it was added or saved after compileGraph: call compileGraph again)" \
                if tensor in self.graph.saved else ""
            raise EinsError(f"offload: {tensor!r} was not saved{late}; call graph.save(t) "
                            f"before compileGraph")
        if self._results is None:
            raise EinsError("offload: call execute() first (after loading every input)")
        return self._results[tensor.index]

    def __repr__(self):
        return (f"CompiledGraph(devices={list(self.devices)}, "
                f"schedule_mode={self.schedule_mode!r}, {len(self.program.eqns)} eqns)")


def compileGraph(graph: Graph, device=None, schedule_mode: str = "naive",
                 topology=None) -> CompiledGraph:
    """Map the graph onto devices (paper Section 2). ``device``: a list of device ids (or one
    id); by default every visible GPU, or without GPUs ``eins.distribute``'s default number
    of virtual devices (8). ``schedule_mode``: ``"naive"`` or ``"ai"`` exchange programs
    (Section 5.4). ``topology``: the machine planned for, as ``eins.distribute``'s (a preset
    name such as ``"dgx-h100:2x8"``, a Topology, a JSON file; default: by device count)."""
    if not isinstance(graph, Graph):
        raise EinsError(f"compileGraph expects a graph from es.createGraph(), got "
                        f"{type(graph).__name__}")
    if schedule_mode not in SCHEDULE_MODES:
        raise EinsError(f"compileGraph: schedule_mode must be one of {list(SCHEDULE_MODES)}, "
                        f"got {schedule_mode!r}")
    devs = _devices(device)
    fn = graph.function()
    lowered = distribute(fn, devices=devs, schedule=schedule_mode, topology=topology).lower(
        *[ShapeDtype(t.shape, t.dtype) for t in graph.inputs])
    return CompiledGraph(graph, lowered, devs, schedule_mode)
