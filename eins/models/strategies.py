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

__all__ = ["LLAMA_STRATEGIES", "CHAIN_STRATEGIES", "projection_eqns", "attention_eqns"]


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
