"""eins's plan against hand-designed strategies on the paper's LLaMA block, shape-only at
paper size (d_model 4,096, 32/8 heads, FFN 14,336) on 8 devices: the cost proxy (Section
4.3) and the predicted time on a DGX A100 (kernels by roofline + simulated exchanges).

    .venv/bin/python examples/compare_plans.py           # 4 workloads, the table (~10 s here)
    .venv/bin/python examples/compare_plans.py 1x1K      # only the workloads named

Hand-designed plans are forced plans ({eqn: {index: count}}, in the printed index names of
docs/stages.md: d0, d1 the output's dimensions, r0 the contracted one), costed exactly like
eins's:
- Megatron tensor parallel: column-split q/k/v/w1/w3, row-split wo/w2, attention by heads;
- data/sequence parallel: every projection split by tokens with replicated weights,
  attention by heads (Ulysses-style; attention could also be split by query or key
  sequence, eins.models.strategies has those plans too).
Everything a strategy does not name is left to the optimizer. "eins (dp, resident)" is
eins with ``inputs_resident=True``: weights stay where each spec needs them across steps, so
the proxy stops charging their replication (the paper's proxy charges it).
"""
import sys

import eins
from eins.models import llama

cfg = llama.PAPER
PROJECTIONS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")


def projection_eqns(prog):
    """{weight name: eqn index} of the seven x @ W matmuls."""
    # program inputs: x, the weights dict flattened in sorted key order, cos, sin
    names = {id(v): k for k, v in zip(sorted(llama.weight_shapes(cfg)), prog.inputs[1:10])}
    return {names[id(e.inputs[1])]: i for i, e in enumerate(prog.eqns)
            if e.prim == "matmul" and id(e.inputs[1]) in names}


def attention_eqn(prog):
    return next(i for i, e in enumerate(prog.eqns) if e.prim == "attention")


def dim(prog, i, d):
    """The printed name of dimension ``d`` of eqn ``i``'s output (``d0``, ``d1``, ...;
    negative ``d`` counts from the end, as the rows and columns of a batched matmul)."""
    return f"d{d % len(prog.eqns[i].outputs[0].shape)}"


def megatron(prog):
    w = projection_eqns(prog)
    # columns of x @ W for wq/wk/wv/w1/w3; the contracted rows (r0) of wo/w2
    plan = {w[k]: {dim(prog, w[k], -1): 8} for k in ("wq", "wk", "wv", "w1", "w3")}
    plan.update({w[k]: {"r0": 8} for k in ("wo", "w2")})
    plan[attention_eqn(prog)] = {"heads_kv": 8}
    return plan


def token_parallel(prog):
    # the tokens of each sequence: the rows of every x @ W
    plan = {i: {dim(prog, i, -2): 8} for i in projection_eqns(prog).values()}
    plan[attention_eqn(prog)] = {"heads_kv": 8}
    return plan


STRATEGIES = {"eins (dp)": None, "eins (dp, resident)": "resident", "Megatron TP": megatron,
              "token parallel": token_parallel}

WORKLOADS = ("1x1K", "1x8K", "1x128K", "8x1K-batch")   # the default set (~10 s here)
if any(a in ("-h", "--help") for a in sys.argv[1:]):
    print(__doc__.strip() + f"\n\nworkloads: {list(llama.WORKLOADS)} (default "
          f"{list(WORKLOADS)})")
    sys.exit(0)
unknown = [a for a in sys.argv[1:] if a not in llama.WORKLOADS]
if unknown:   # before the table's header
    sys.exit(f"compare_plans.py: unknown workload {unknown[0]!r}; choose from "
             f"{list(llama.WORKLOADS)}")
print(f"{'workload':14s}" + "".join(f"{s:>26s}" for s in STRATEGIES))
print(f"{'':14s}" + "".join(f"{'proxy GB   predicted ms':>26s}" for _ in STRATEGIES))
for name in sys.argv[1:] or WORKLOADS:
    wl = llama.WORKLOADS[name]
    fn, args = wl.function(cfg), wl(cfg)
    prog = eins.make_ir(fn)(*args)
    cells = []
    for strategy in STRATEGIES.values():
        plan = strategy(prog) if callable(strategy) else None
        low = eins.distribute(fn, devices=8, plan=plan, topology="dgx-a100:8",
                              inputs_resident=strategy == "resident").lower(*args)
        t = low.predicted_time()["total_ms"]
        cells.append(f"{low.cost_bytes / 1e9:12.2f} {t:12.2f}")
    print(f"{name:14s}" + "".join(f"{c:>26s}" for c in cells), flush=True)
