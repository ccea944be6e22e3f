"""The one registry of primitives. Everything eins knows about a primitive is a field of
its :class:`Primitive`, declared in its operator family file (``eins/ops/<family>.py``)
beside its other rules, the way JAX keeps ``exp_p``'s rule, JVP and lowering together in
``lax.py``. Codegen, runtimes, cost models and tolerance read these fields; none of them
tests a primitive's name (tests/test_primitive_home.py checks it). docs/adding-a-primitive.md
walks through every field.

It lives below both the IR and the operators (as ``jax._src.core.Primitive`` does): an
:class:`eins.ir.program.Eqn` holds its :class:`Primitive`, the tracer binds primitives by
name, and ``eins.ops`` registers them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from eins.errors import EinsError


def _default_flops(in_types, out_types, **params) -> int:
    return sum(t.size for t in out_types)


# ----------------------------------------------------------------------------- parts
@dataclass(frozen=True)
class Expression:
    """The elementwise expression of a primitive that is a pure map over aligned elements:
    what the kernel library (eins/kernels/expressions.py) renders into every dialect (numpy
    source, Triton) and fuses into chains. It renders whatever it is given: a primitive
    with an expression needs no entry anywhere else.

    - ``operands``: the operand names the expression uses, in operand order (``("x",)``).
    - ``text``: the neutral Python expression over them, with neutral function names
      (``exp``, ``maximum``, ``where``, ...; the dialect tables of eins/kernels/
      expressions.py spell them), or ``text(params) -> str`` where a static parameter picks
      a variant (gelu's ``approximate``).
    - ``variant(params) -> str``: the variant's name (``"approximate=True"``); None: one form.
    - ``integer``: the expression used when the operands are computed as integers or bools
      (pow: ``ipow(a, b)``); None: ``text``.
    - ``compute(in_dtypes, out_dtype) -> tuple``: the dtype each operand is cast to before
      the expression (the result is rounded once to ``out_dtype``); None: the default rule
      (:func:`eins.kernels.expressions.dtypes_for`).
    - ``checked``: the operand whose negative integer values the kernel must refuse
      (pow's exponent); None: no run-time check.
    """

    operands: tuple
    text: str | Callable
    variant: Callable | None = None
    integer: str | None = None
    compute: Callable | None = None
    checked: int | None = None

    def source(self, params=None, integer=False) -> str:
        if integer and self.integer is not None:
            return self.integer
        return self.text(params or {}) if callable(self.text) else self.text


@dataclass(frozen=True)
class Strided:
    """How a primitive's GPU lowering takes strided tensors as they are (no contiguous
    copy): the generated GPU walk (eins/codegen/gpu_walk.py) then folds a layout chain
    (reshape/transpose kernels) into a view passed straight to it.

    - ``operands``: the operand positions read strided.
    - ``unit_last``: whether those views must keep a unit stride in their last axis.
    - ``out_rank``: the lowering also WRITES its output strided, for blocks of at most this
      rank; None: it writes contiguous buffers only."""

    operands: tuple = ()
    unit_last: bool = False
    out_rank: int | None = None


@dataclass(frozen=True)
class Layout:
    """A layout change that is a torch view of its block (reshape, transpose), which the GPU
    walk folds into the strided reader or writer next to it (:class:`Strided`).

    - ``view(fspec, params) -> str``: the view's source suffix applied to the input block
      (``".permute(1, 0, 2)"``).
    - ``inverse(in_shape, params) -> (params, str)``: the inverse view's parameters and
      suffix, applied to the output buffer (the writer writes through it).
    - ``perm(params) -> tuple | None``: the permutation of axes it applies; None for a
      reshape (a view of a contiguous tensor only when it comes first)."""

    view: Callable
    inverse: Callable
    perm: Callable


@dataclass(frozen=True)
class GpuLowering:
    """A primitive's GPU lowering: a kernel launcher, the check of when it applies, and the
    torch fallback used otherwise.

    - ``fn(fspec, outs, ins, **params)`` runs one eqn's blocks on the GPU (the call of
      ``Primitive.run_block``, with outputs): ``ins`` are torch tensors (a literal operand
      as ``("lit", value, dtype)`` or a Python scalar), ``outs`` preallocated torch tensors
      it writes, ``fspec`` the blocks' global boxes (None: whole tensors), ``params`` the
      eqn's. CPU tensors run the same Triton kernels under Triton's interpreter. None: only
      the fallback.
    - ``accepts(outs, ins, params) -> bool``: whether ``fn`` takes these tensors; None:
      always. ``takes``: what it takes, in words, for the error of a forced choice.
    - ``fallback(fspec, *ins, **params) -> tuple``: a torch computation of the block whose
      results the runtime copies into the outputs (cast to the eqn's dtypes); used where
      ``fn`` does not apply or the runtime's kernels are off.
    - ``template``: the Jinja template ``fn`` renders (for inspection).
    - ``partial(fspec, outs, ins, **params)``: the block of a spec whose outputs are ⊕
      partials (``run_block(..., partial=True)``); for attention's ``lse`` ⊕, ``outs`` =
      ``[pairs]``, the device IR's pair buffer (float32, a trailing axis of 2: what the GPU
      runtime passes; its lse ⊕ kernel combines them), or (o, lse) tensors, combined by
      ``eins.kernels.combine_lse``. ``accepts_partial(outs, ins, params)``: when it applies.
    - ``choice``: the keyword of ``fn`` that takes the runtime's kernel choice for this
      primitive (attention's ``impl``: eins.ir.plan.Options.attention). A forced choice
      (not ``"auto"``) is a promise: where ``accepts`` refuses, the launch raises rather
      than run the fallback.
    - ``measured``: the keyword of ``fn`` that takes the runtime's measured kernel table
      for this primitive (the machine profile's ``attention`` rows, when they were
      measured on the GPU it runs on), used with ``choice="auto"``; None: none.
    - ``check_plan(fspec, in_types, out_types, params, choice) -> str | None``: why a
      forced ``choice`` cannot run this block, checked when the program is loaded rather
      than at the first call (None: it can)."""

    fn: Callable | None = None
    accepts: Callable | None = None
    takes: str | None = None
    fallback: Callable | None = None
    template: str | None = None
    partial: Callable | None = None
    accepts_partial: Callable | None = None
    choice: str | None = None
    measured: str | None = None
    check_plan: Callable | None = None


# ----------------------------------------------------------------------------- Primitive
@dataclass(eq=False)
class Primitive:
    """A primitive operator: every rule eins has for it.

    Semantics
      - ``abstract(*in_types, **params) -> tuple[TensorType, ...]``: the shape/dtype rule;
        raises ShapeError / DTypeError naming the offending shapes (the tracer adds the
        line).
      - ``impl(*arrays, **params) -> tuple[np.ndarray, ...]``: the numpy reference kernel on
        whole tensors.
      - ``indexing(in_types, out_types, **params) -> eins.ir.joinagg.Indexing``: named
        indices, shardable ones, and the join-agg spec producer (Section 3.3), whose specs
        name their ⊕ per output. None: never split.
      - ``block_impl(fspec, *blocks, **params) -> tuple``: the concrete operator f[F] on
        blocks; it knows its global boxes through ``fspec``. Default: ``impl`` on the
        blocks, right whenever the kernel does not depend on global positions.
      - ``partial_impl(fspec, *blocks, **params) -> tuple``: f[F] for a function
        specification whose outputs are partials of a ⊕ with its own element type (``lse``:
        (o, lse) pairs, eins.ir.joinagg.lse_pair_dtype); ``run_block(..., partial=True)``
        calls it.

    Cost
      - ``flops(in_types, out_types, **params) -> int``.
      - ``block_flops_fn(fspec, in_types, out_types, **params) -> int``: the FLOPs of one
        function specification (``block_flops``): ``in_types``/``out_types`` are its block
        types, ``fspec`` holds its global boxes. Default: ``flops`` on the block types. A
        primitive with one has a position-dependent cost (attention's segments and causal
        mask): the time model costs each block, not each distinct block shape.
      - ``bytes_fn(in_types, out_types, **params) -> int``: bytes read and written
        (``bytes_accessed``); default: every operand and result once.
      - ``temp_bytes_fn(fspec, **params) -> int``: kernel temporaries of one function
        specification beyond its blocks (``temp_bytes``); default 0, a kernel that streams.
      - ``kernel_class``: which measured efficiencies of a machine profile price its kernels
        (eins.hardware.profile.KERNEL_CLASSES: "matmul", "attention", "elementwise",
        "norm", "rope", "reduction", "view", "copy", "gather", "sort"); default
        "elementwise".
      - ``flops_dtype(in_dtypes) -> dtype``: the dtype its FLOPs run at in the time model;
        None: its float operands' promoted dtype (eins.cost.predict.compute_dtype). For a
        kernel with a float32 side operand that its matmuls do not take (attention_bwd's
        log-sum-exp).

      - ``runtime_params(params, in_types, values)``: for an eqn whose static parameter is
        data on every call (attention's ``segments`` as an int array): with ``values`` None,
        the operand index holding that data (None: the eqn has none); with ``values``
        {operand index: host array}, the params with one call's value written in as the
        static form (the ends tuple), whose indexing, FLOPs and balanced cuts are that
        call's. The per-call rebalance (eins/passes/rebalance.py) re-cuts the eqn with them
        without re-tracing or re-planning; the kernels keep reading the operand.
      - ``capacity(params, in_types, names) -> (params, axis[, reads]) | None``: the eqn's
        capacity form, for a rebalanced eqn whose indices ``names`` are cut per call
        (eins/passes/capacity.py):
        with the returned params the eqn takes one more operand after the others, an int
        table with a row [lo, hi) per function specification (each block reads its own
        row), its blocks span the whole extent of ``names`` (one lowering holds every cut),
        and each block computes only the part [lo, hi) along its output's ``axis`` that this
        call's cut gives it and zeros elsewhere, so that the blocks' copies ⊕-sum to the
        output. It may return ``(params, axis, reads)`` instead: ``reads`` maps operands to
        window pairs (pair 0: the block's rows; pair k: a table column pair 2k, 2k+1 that
        the call fills from that operand's box along ``axis`` in the per-cut plan), so the
        transfers into and out of each block move only its windows (eins/passes/windows.py);
        a pair may be ``(pair, axis)`` for an operand cut on an axis of its own. A fourth
        item ``outs`` windows outputs past the first: {output: axis or (axis, pair)}, each
        zero outside its window. ``axis`` None: no output is cut by the rows (each block's
        first output a partial over every row, ⊕-summed whole: ALiBi slopes' gradient);
        pair 0 is then filled from the first operand reading it, each read naming its axis.
        None (or no field): no capacity form; the GPU backends then lower each new cut
        again.
      - ``capacity_masks``: True where the capacity form's kernel computes its whole
        capacity block and masks the rows outside [lo, hi) instead of skipping them (up
        to p times the cut's work on a GPU, which the cost model does not price); the GPU
        backends then re-cut through the capacity program only when the caller asks
        (``rebalance=True``), keeping the compile-time cuts by default. Or a function
        ``(params, in_types) -> bool`` saying it per eqn (attention_dbias: where its
        operands' dtypes leave it to the torch fallback); :meth:`masks_capacity` asks.
      - ``pipeline(params) -> (operands, axis) | None``: operands cut along a contracted
        index that the eqn's kernel may run in pieces along, each piece a partial of its
        specs' pair ⊕ joined into a running accumulator, exact in any order (attention's
        keys and values along the key rows): a device whose blocks of them arrive from
        other devices computes on each as it arrives (eins/passes/pipeline.py). Its pieces
        are priced per call, so its ``block_flops_fn`` is called with the piece's
        function specification alone (``in_types``/``out_types`` None: the boxes say
        all). None (or no field): its kernels run whole.
      - ``aligned(params, in_types, intervals) -> {operand index: host array} | None``: for
        such an eqn, the runtime value under which blocks cut at ``intervals`` {index:
        intervals} read nothing outside their own cuts (attention: a segment ending at every
        query cut). A family of the per-call choice (eins/passes/families.py) is first
        lowered at it, so that a batch's estimate charges what its boxes read beyond.
        None (or no field): the family's shapes-only boxes, the largest.

    Tolerance
      - ``accumulation(in_types, out_types, **params) -> (steps, longest)``: how many
        chained accumulations one output element takes and the longest one's terms
        (eins.tolerance.accumulation); None: one step of the join work per output element,
        read from ``indexing``.

    Kernels
      - ``expression``: an :class:`Expression` for an elementwise map; the kernel library
        renders and fuses it (numpy source, Triton), and the GPU runtime launches it as a
        fused kernel. None: not elementwise.
      - ``residual_epilogue``: its GPU launch can add a residual of its output's shape and
        dtype as an epilogue (matmul: one addmm); ``residual_add``: it is the add such an
        epilogue absorbs.
      - ``strided``: :class:`Strided`, the operands its GPU lowering reads (and the output
        it writes) strided; ``layout``: :class:`Layout`, for a layout change that is a
        view.
      - ``lowerings``: the GPU lowerings by platform (:func:`register_lowering`).

    Front ends
      - ``attr_hints``: {attribute: hint} for the numpy/torch methods a traced array does
        not have that this primitive replaces (``x.exp()``: "use eins.exp(x)").
      - ``ufuncs``: the numpy ufuncs that mean this primitive (``np.exp(x)`` on a traced
        array, ``ndarray + x``): its public function in ``eins.ops`` runs, or it is bound.
      - ``paper_names``: {name: params}, the names under which the paper's graph API
        (eins/paper.py ``graph.unary``) applies it, with the static parameters each implies.
      - ``samples(arr) -> [(label, fn, args)]``: small programs using it that
        eins.validate_specs brute-forces; ``arr(*shape, dtype="float64", lo=-2.0, hi=2.0)``
        makes its sample arrays.

    Training (issue 34 fills these)
      - ``vjp``: the backward rule; ``transpose``: the linear transpose rule. None for now.
    """

    name: str
    abstract: Callable
    impl: Callable
    flops: Callable = _default_flops
    indexing: Callable | None = None
    block_impl: Callable | None = None
    partial_impl: Callable | None = None
    block_flops_fn: Callable | None = None
    bytes_fn: Callable | None = None
    temp_bytes_fn: Callable | None = None
    kernel_class: str = "elementwise"
    flops_dtype: Callable | None = None
    runtime_params: Callable | None = None
    capacity: Callable | None = None
    capacity_masks: bool | Callable = False
    aligned: Callable | None = None
    pipeline: Callable | None = None
    accumulation: Callable | None = None
    expression: Expression | None = None
    residual_epilogue: bool = False
    residual_add: bool = False
    strided: Strided | None = None
    layout: Layout | None = None
    lowerings: dict = field(default_factory=dict)
    attr_hints: dict = field(default_factory=dict)
    ufuncs: tuple = ()
    paper_names: dict = field(default_factory=dict)
    samples: Callable | None = None
    vjp: Callable | None = None
    transpose: Callable | None = None

    def run_block(self, fspec, *blocks, partial=False, **params):
        if partial:
            if self.partial_impl is None:
                raise EinsError(f"primitive {self.name!r} has no partial kernel (its specs "
                                f"never aggregate with a ⊕ of pairs)")
            return self.partial_impl(fspec, *blocks, **params)
        if self.block_impl is not None:
            return self.block_impl(fspec, *blocks, **params)
        return self.impl(*blocks, **params)

    def block_flops(self, fspec, in_types, out_types, **params) -> int:
        if self.block_flops_fn is not None:
            return self.block_flops_fn(fspec, in_types, out_types, **params)
        return self.flops(in_types, out_types, **params)

    @property
    def position_dependent(self) -> bool:
        """Whether a block's cost depends on where it lies, not only on its shape."""
        return self.block_flops_fn is not None

    def bytes_accessed(self, in_types, out_types, **params) -> int:
        if self.bytes_fn is not None:
            return self.bytes_fn(in_types, out_types, **params)
        return sum(t.nbytes for t in in_types) + sum(t.nbytes for t in out_types)

    def temp_bytes(self, fspec, **params) -> int:
        return 0 if self.temp_bytes_fn is None else self.temp_bytes_fn(fspec, **params)

    @property
    def is_elementwise(self) -> bool:
        return self.expression is not None

    def masks_capacity(self, params, in_types) -> bool:
        """Whether this eqn's capacity-form kernel computes its whole capacity block
        (``capacity_masks``: a bool, or a function of the eqn's params and operand
        types)."""
        m = self.capacity_masks
        return bool(m(params, in_types) if callable(m) else m)

    def lowering(self, platform: str | None = None) -> GpuLowering | None:
        """The GPU lowering for ``platform`` ("cuda", "interpret"): its own override, else
        the one registered for every platform; None when there is none."""
        return self.lowerings.get(platform, self.lowerings.get(None))

    def __repr__(self):
        return f"Primitive({self.name!r})"


PRIMITIVES: dict[str, Primitive] = {}


def register(prim: Primitive) -> Primitive:
    if prim.name in PRIMITIVES:
        raise EinsError(f"primitive {prim.name!r} registered twice")
    PRIMITIVES[prim.name] = prim
    return prim


def unregister(name: str) -> None:
    """Remove primitive ``name`` (a test's toy primitive, registered for one test)."""
    if PRIMITIVES.pop(name, None) is None:
        raise EinsError(f"unknown primitive {name!r}")


def get_primitive(name) -> Primitive:
    """The registered primitive called ``name`` (a Primitive is returned as is)."""
    if isinstance(name, Primitive):
        return name
    try:
        return PRIMITIVES[name]
    except KeyError:
        raise EinsError(f"unknown primitive {name!r}") from None


# ----------------------------------------------------------------------------- GPU lowerings
def register_lowering(prim, lowering: GpuLowering, platform: str | None = None) -> None:
    """Register ``prim``'s GPU lowering (a name or a Primitive) for ``platform``: None for
    every platform, or "cuda" / "interpret" to override it there (JAX's
    ``register_lowering(prim, rule, platform=)``). Each op family file registers its
    primitives' lowerings beside their reference kernels."""
    p = get_primitive(prim)
    if platform in p.lowerings:
        where = "" if platform is None else f" for platform {platform!r}"
        raise EinsError(f"GPU lowering of primitive {p.name!r} registered twice{where}")
    p.lowerings[platform] = lowering


def register_gpu_lowering(prim, fn: Callable, template: str | None = None,
                          partial: Callable | None = None, **rest) -> None:
    """:func:`register_lowering` for every platform from its parts."""
    register_lowering(prim, GpuLowering(fn, template=template, partial=partial, **rest))


def gpu_lowering(prim, platform: str | None = None) -> GpuLowering | None:
    """The GPU lowering of ``prim`` (a name or a Primitive) on ``platform``; None when the
    GPU path has none."""
    return get_primitive(prim).lowering(platform)
