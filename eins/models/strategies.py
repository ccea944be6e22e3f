"""Hand-written parallelization strategies as forced plans (``plan={eqn: {index: count}}``),
the baselines the optimizer is compared with (benchmarks/bench_plans.py, tests).

Each strategy names the split of the eqns it is about (the projections ``x @ W`` and the
attention of the LLaMA block; every matmul of a chain) and leaves the other eqns (norms,
RoPE, reshapes, elementwise) to the optimizer, as a user writing the strategy would.
Matmul index names: ``i`` rows (tokens), ``j`` the contraction, ``k`` output columns,
``a`` a leading batch dimension. A strategy that the workload cannot express (e.g. batch
parallel on a workload without a batch dimension, or a split into more pieces than an
index has) returns None.
"""
from __future__ import annotations

from eins.ir.program import Program, eqn_indexing

__all__ = ["LLAMA_STRATEGIES", "CHAIN_STRATEGIES", "TRAINING_STRATEGIES", "projection_eqns",
           "attention_eqns", "weight_grads"]


def projection_eqns(prog: Program) -> list[int]:
    """The matmuls whose right operand is a program input (a weight)."""
    inputs = {id(v) for v in prog.inputs}
    return [i for i, e in enumerate(prog.eqns)
            if e.prim == "matmul" and id(e.inputs[1]) in inputs]


def attention_eqns(prog: Program) -> list[int]:
    return [i for i, e in enumerate(prog.eqns) if e.prim == "attention"]


def _shardable(prog, i, name, p) -> bool:
    """Whether index ``name`` of eqn ``i`` splits ``p`` ways. The strategies split matmuls
    and attentions only, whose indices are shardable anywhere (``"any"``, never a tuple of
    allowed cuts)."""
    ix = eqn_indexing(prog.eqns[i])
    return ix.shardable.get(name) == "any" and ix.extents[name] >= p


def _plan(prog, p, proj, att):
    """{eqn: {index: p}} for every projection (index ``proj``) and attention (``att``);
    None if an index cannot be split p ways."""
    plan = {}
    for i in projection_eqns(prog):
        name = proj(prog.eqns[i]) if callable(proj) else proj
        if not _shardable(prog, i, name, p):
            return None
        plan[i] = {name: p}
    for i in attention_eqns(prog):
        if not _shardable(prog, i, att, p):
            return None
        plan[i] = {att: p}
    return plan


def token_parallel(prog, p):
    """Tokens split everywhere: projections by rows with replicated weights; attention by
    sequence (whole packed sequences per device: PyTorch's sequence/context parallelism)."""
    return _plan(prog, p, "i", "sequence")


def ulysses(prog, p):
    """DeepSpeed-Ulysses: projections by tokens, attention by heads (an all-to-all from
    tokens to heads and back)."""
    return _plan(prog, p, "i", "heads_kv")


def megatron(prog, p):
    """Megatron tensor parallelism: column-split wq/wk/wv/w1/w3 (``k``), row-split wo/w2
    (``j``, partial sums ⊕-aggregated), attention by heads."""
    plan = {}
    for i in projection_eqns(prog):
        # wq/wk/wv/w1/w3 read the normalized residual stream (an rms_norm's output); wo and
        # w2 read the attention's (through the head merge) and the FFN product's. By what
        # they read, not by shape: with d_ff == d_model w2's shape is w1's transposed
        name = "j" if _source(prog, prog.eqns[i].inputs[0]) not in _NORMS else "k"
        if not _shardable(prog, i, name, p):
            return None
        plan[i] = {name: p}
    for i in attention_eqns(prog):
        if not _shardable(prog, i, "heads_kv", p):
            return None
        plan[i] = {"heads_kv": p}
    return plan


_NORMS = ("rms_norm", "layer_norm")


def _source(prog, v) -> str | None:
    """The primitive that produced ``v``, looking through reshapes and transposes (None for
    a program input)."""
    producers = prog.producers()
    while True:
        w = producers.get(id(v))
        if w is None:
            return None
        e = prog.eqns[w[0]]
        if e.prim not in ("reshape", "transpose"):
            return e.prim
        v = e.inputs[0]


def context_parallel(prog, p):
    """Ring / context-parallel attention: projections by tokens, attention by key sequence
    (each device attends to its share of the keys; partial outputs combined with the
    log-sum-exp ⊕). None where a projection or the attention cannot be split p ways."""
    return _plan(prog, p, "i", "kv_sequence")


def batch_parallel(prog, p):
    """Whole sequences per device: the batch index of a batched workload."""
    return _plan(prog, p, "a", "batch")


LLAMA_STRATEGIES = {
    "token/sequence parallel": token_parallel,
    "Ulysses": ulysses,
    "Megatron TP": megatron,
    "context parallel": context_parallel,
    "batch parallel": batch_parallel,
}


def row_sharding(prog, p):
    """Every matmul split by rows (JAX/PyTorch row-sharded chains, Section 6)."""
    return {i: {"i": p} for i, e in enumerate(prog.eqns) if e.prim == "matmul"
            and _shardable(prog, i, "i", p)} or None


def matmul_3d(prog, p):
    """The classical 3D algorithm on every matmul: i, j and k each split the cube root of p
    ways (p a cube)."""
    q = round(p ** (1 / 3))
    if q ** 3 != p:
        return None
    out = {}
    for i, e in enumerate(prog.eqns):
        if e.prim == "matmul":
            if not all(_shardable(prog, i, n, q) for n in "ijk"):
                return None
            out[i] = {"i": q, "j": q, "k": q}
    return out or None


CHAIN_STRATEGIES = {"row sharding": row_sharding, "3D matmul": matmul_3d}


# ----------------------------------------------------------------------------- training
# A training step (forward, backward, optimizer) written as the frameworks split it: each
# strategy names the splits of every projection's three matmuls (forward y = x @ W, and the
# backward's dx = dy W^T and dW = x^T dy, with the sum of dW over a batch dimension), and of
# attention's forward and backward, and leaves the rest (norms, elementwise, the loss) to the
# optimizer, as the inference strategies above do. Indices are found by what they index
# (the batch, the tokens, the weight's rows or columns), not by their names, which differ
# between a matmul and the backward's einsums.


_CONTRACTIONS = ("matmul", "einsum")


def _roles(prog, i) -> dict:
    """{role: index name} of matmul/einsum eqn ``i`` of output [(batch,) rows, cols]:
    "batch", "rows", "cols" by output dimension, "sum" the contracted index; {} for any
    other eqn."""
    e = prog.eqns[i]
    ix = eqn_indexing(e)
    if e.prim not in _CONTRACTIONS or not ix.dims:
        return {}
    nd = len(e.outputs[0].shape)
    out = {"sum": next((n for n, d in ix.dims.items() if d is None), None)}
    for n, d in ix.dims.items():
        if d is not None and d[0] == 0:
            out[{nd - 1: "cols", nd - 2: "rows"}.get(d[1], "batch")] = n
    return out


def weight_grads(prog: Program) -> list[dict]:
    """Per forward projection ``x @ W`` (W a 2-D program input): {"w": input position,
    "fwd": eqn, "refwd": its recomputation in the backward (under eins.checkpoint), "dx":
    the backward eqn reading W (dy W^T), "dw": the one reading x (x^T dy), "sum": the eqn
    summing dW over the batch}; entries the program lacks (no backward: inference; no
    checkpoint; no batch) are None."""
    inputs = {id(v): k for k, v in enumerate(prog.inputs)}
    consumers = prog.consumers()
    out = []
    for f in projection_eqns(prog):
        e = prog.eqns[f]
        if e.phase != "fwd":   # a forward recomputed in the backward: its own entry's
            continue
        w, x = e.inputs[1], e.inputs[0]
        entry = {"w": inputs[id(w)], "fwd": f, "refwd": None, "dx": None, "dw": None,
                 "sum": None}
        for c, _ in consumers.get(id(w), ()):
            ce = prog.eqns[c]
            if ce.phase == "bwd" and _roles(prog, c):
                # the forward recomputed in the backward (eins.checkpoint), or dy W^T
                same = ce.prim == e.prim and ce.inputs[1] is w and \
                    ce.outputs[0].shape == e.outputs[0].shape
                entry["refwd" if same else "dx"] = c
        # dW reads x and the same cotangent dy as dx (x alone is shared: q, k, v's x)
        dy = [id(a) for a in prog.eqns[entry["dx"]].inputs if a is not w] \
            if entry["dx"] is not None else []
        for c, _ in consumers.get(id(x), ()):
            ce = prog.eqns[c]
            if ce.phase == "bwd" and c != entry["dx"] and _roles(prog, c) and \
                    any(id(a) in dy for a in ce.inputs):
                entry["dw"] = c
        if entry["dw"] is not None and len(prog.eqns[entry["dw"]].outputs[0].shape) == 3:
            users = consumers.get(id(prog.eqns[entry["dw"]].outputs[0]), ())
            if len(users) == 1:
                entry["sum"] = users[0][0]
        out.append(entry)
    return out


def _attention_all(prog) -> list[int]:
    """The attention eqns of forward and backward (by their heads_kv index)."""
    return [i for i, e in enumerate(prog.eqns) if "heads_kv" in eqn_indexing(e).extents]


def _split(prog, plan, i, name, p) -> bool:
    if i is None:
        return True
    if name is None or not _shardable(prog, i, name, p):
        return False
    plan.setdefault(i, {})[name] = p
    return True


def _train_plan(prog, p, roles, att) -> dict | None:
    """Every projection's fwd/dx/dw split by ``roles(entry) -> {"fwd": role, "dx": role,
    "dw": role}`` (roles of :func:`_roles`) and every attention eqn by ``att``; None when an
    index cannot be split p ways or the program has no backward."""
    plan = {}
    grads = weight_grads(prog)
    if not grads or all(g["dx"] is None for g in grads):
        return None
    for g in grads:
        parts = roles(prog, g)
        parts["refwd"] = parts["fwd"]   # a recomputed forward splits as the forward
        for part, role in parts.items():
            if g[part] is not None and \
                    not _split(prog, plan, g[part], _roles(prog, g[part]).get(role), p):
                return None
    for i in _attention_all(prog):
        if not _split(prog, plan, i, att, p):
            return None
    return plan


def data_parallel(prog, p):
    """DDP: every projection's forward and backward split by the batch (each device its
    sequences, weights replicated, dW summed over the devices by ⊕: the all-reduce),
    attention by batch; the optimizer left to the planner."""
    return _train_plan(prog, p, lambda prog, g: {"fwd": "batch", "dx": "batch", "dw": "batch"},
                       "batch")


def fsdp(prog, p):
    """FSDP / ZeRO-3-like: data parallel's compute, and the weight gradients and optimizer
    state sharded by rows: each dW's sum over the batch split by its rows (the
    reduce-scatter) and every optimizer eqn (those after the backward) by its first
    dimension."""
    plan = data_parallel(prog, p)
    if plan is None:
        return None
    for g in weight_grads(prog):
        if g["sum"] is not None:
            rows = eqn_indexing(prog.eqns[g["sum"]]).dims
            name = next((n for n, d in rows.items() if d == (0, 0)), None) if rows else None
            if not _split(prog, plan, g["sum"], name, p):
                return None
    last_bwd = max(i for i, e in enumerate(prog.eqns) if e.phase == "bwd")
    for i in range(last_bwd + 1, len(prog.eqns)):
        dims = eqn_indexing(prog.eqns[i]).dims or {}
        name = next((n for n, d in dims.items() if d == (0, 0)), None)
        if name is not None and _shardable(prog, i, name, p):
            plan.setdefault(i, {})[name] = p
    return plan


def megatron_training(prog, p):
    """Megatron TP through the backward: column-parallel wq/wk/wv/w1/w3 and head (their
    output columns split in fwd, dx (whose contraction they are: partial sums, the
    backward's all-reduce) and dW), row-parallel wo/w2 (their rows split likewise),
    attention by heads."""
    def roles(prog, g):
        x = prog.eqns[g["fwd"]].inputs[0]
        if _source(prog, x) in _NORMS:   # column-parallel
            return {"fwd": "cols", "dx": "sum", "dw": "cols"}
        return {"fwd": "sum", "dx": "cols", "dw": "rows"}
    return _train_plan(prog, p, roles, "heads_kv")


def sequence_parallel_training(prog, p):
    """Sequence parallel through the backward: every projection split by tokens (dW's
    contraction over tokens: partial sums, the all-reduce), attention by sequence."""
    return _train_plan(prog, p, lambda prog, g: {"fwd": "rows", "dx": "rows", "dw": "sum"},
                       "sequence")


TRAINING_STRATEGIES = {
    "data parallel": data_parallel,
    "FSDP": fsdp,
    "Megatron TP": megatron_training,
    "sequence parallel": sequence_parallel_training,
}
