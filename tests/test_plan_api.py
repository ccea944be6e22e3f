"""eins.distribute -> Distributed.lower -> Lowered: texts, plan table, cost, errors; and the
paper's workloads (LLaMA block, chains A-E) planned shape-only at p = 8."""
from dataclasses import replace

import numpy as np
import pytest

import eins
from eins.errors import EinsError, PlanError, TopologyError, TraceError
from eins.ir.plan import Compilation, Options, Plan
from eins.passes import PIPELINE, PLANNING, run_passes
from eins.passes.choose_specs import choose_specs

S = eins.ShapeDtype


def ffn(x, w1, w2):
    return eins.relu(x @ w1) @ w2


def test_planned_text_is_the_traced_program_with_split_and_cost_comments():
    low = eins.distribute(lambda a, b: a @ b, devices=8, cost="proxy").lower(S((16, 16), "f16"),
                                                                S((16, 16), "f16"))
    assert low.as_text("traced") == eins.make_ir(lambda a, b: a @ b)(
        S((16, 16), "f16"), S((16, 16), "f16")).pretty()
    # wrapped at 100 columns: the eqn keeps its split on its line, its time and cost below
    assert low.as_text("planned") == (
        "# plan: selector=dp minimized=bytes topology=dgx-a100 devices=[0, 1, 2, 3, 4, 5, 6, "
        "7]\n#   time 6.842 us, cost 2.5 KiB (repartition 0 B, join 2 KiB, aggregation 512 "
        "B)\n"
        "{ lambda  ; a:f16[16,16] b:f16[16,16]. let\n"
        "    c:f16[16,16] = matmul a b    # split d0/2 d1/2 r0/2 -> out 2x2 blocks, sum of 2 "
        "partial copies per block |\n"
        "        #   time 6.842 us, cost 2.5 KiB (repartition 0 B, join 2 KiB, aggregation "
        "512 B)\n"
        "  in (c) }")
    assert low.cost_bytes == 2560 == 5 * 16 * 16 * 2
    # one eqn: its time is the plan's, which the header prints to 4 digits: the kernel's
    # 3.442 us and the partial sums' exchange, NVSwitch latency (3.4 us) and 512 B
    assert low.plan.eqn_plans[0].seconds == low.plan.cost_s
    assert f"{low.plan.cost_s * 1e6:.4g}" == "6.842"


def test_plan_table_rows():
    low = eins.distribute(ffn, devices=[3, 5, 7]).lower(S((9, 4)), S((4, 6)), S((6, 4)))
    assert low.devices == (3, 5, 7) and low.plan.devices == (3, 5, 7)
    rows = low.plan_table()
    seconds = [r.pop("seconds") for r in rows]   # each eqn's share of the time cost
    assert sum(seconds) == pytest.approx(low.plan.cost_s, rel=1e-12) and min(seconds) > 0
    assert rows == [
        {"eqn": 0, "op": "matmul", "splits": {"d0": 3}, "out_tiling": (3, 1), "agg": 1,
         "cost_bytes": (9 * 4 + 3 * 4 * 6) * 4},
        {"eqn": 1, "op": "relu", "splits": {"d0": 3}, "out_tiling": (3, 1), "agg": 1,
         "cost_bytes": 9 * 6 * 4},
        {"eqn": 2, "op": "matmul", "splits": {"d0": 3}, "out_tiling": (3, 1), "agg": 1,
         "cost_bytes": (9 * 6 + 3 * 6 * 4) * 4},
    ]
    assert low.cost_bytes == sum(r["cost_bytes"] for r in low.plan_table())
    assert isinstance(low.plan, Plan) and len(low.plan.eqn_plans) == 3


def test_plan_exposes_what_lowering_reads():
    low = eins.distribute(ffn, devices=4).lower(S((8, 4)), S((4, 8)), S((8, 4)))
    plan = low.plan
    prog = plan.program
    ep = plan.eqn_plans[1]
    # the relu input was produced in the first matmul's out tiling, program inputs in none
    assert plan.producer_tiling(prog.eqns[1].inputs[0]) == plan.eqn_plans[0].spec.out_tiling(0)
    assert plan.producer_tiling(prog.inputs[0]) is None
    assert len(ep.spec.fspecs) == 4 and ep.spec.in_blocks(0) and ep.spec.out_tiling(0)
    assert ep.intervals.keys() == {"a", "b"}


def test_lower_accepts_arrays_scalars_and_caches():
    f = eins.distribute(lambda x, s: x * s, devices=2)
    a = f.lower(np.ones((4, 4), np.float32), 3.0)
    assert f.lower(np.zeros((4, 4), np.float32), 3.0) is a       # same signature
    assert f.lower(np.zeros((4, 4), np.float32), 2.0) is a       # a traced scalar's value
    assert f.lower(np.zeros((4, 4), np.float32), 2) is not a     # another kind: int
    # the scalar is a float32 input, read by both devices: 2 x 4 bytes more than the halves
    assert a.plan_table()[0]["cost_bytes"] == 64 + 2 * 4
    g = eins.distribute(lambda x, s: x * s, devices=2, static_argnums=1)
    b = g.lower(np.ones((4, 4), np.float32), 3.0)
    assert g.lower(np.zeros((4, 4), np.float32), 2.0) is not b   # new static value
    assert b.plan_table()[0]["cost_bytes"] == 64                 # the literal is free


def test_options_are_stored_for_the_lowering():
    f = eins.distribute(ffn, devices=2, topology="dgx-a100", schedule="ai", seed=5)
    assert f.options == Options(selector="dp", seed=5, plan=None, topology="dgx-a100",
                                schedule="ai")


@pytest.mark.parametrize("kwargs,err,needle", [
    ({"devices": 0}, PlanError, "devices must be at least 1, got 0"),
    ({"devices": []}, PlanError, "devices is an empty list"),
    ({"devices": "8"}, PlanError, "devices must be a device count or a list of device ids, got '8'"),
    ({"devices": [0, 1, 1]}, PlanError, "devices [0, 1, 1] name a device twice"),
    ({"devices": [0, "gpu1"]}, PlanError, "device id 'gpu1' in [0, 'gpu1'] is not a "
                                          "non-negative int"),
    ({"devices": True}, PlanError, "got True"),
    ({"devices": 2.5}, PlanError, "got 2.5"),
    # checked before a tuple of 10**12 ids is built (a raw MemoryError)
    ({"devices": 10 ** 12}, TopologyError, "device ids up to 999999999999 need a topology "
                                           "with 1000000000000 GPUs; a cluster model holds "
                                           "at most 2048"),
    # bool("no") was True
    ({"graphs": "no"}, EinsError, "graphs must be True or False, got 'no'"),
    ({"graphs": None}, EinsError, "graphs must be True or False, got None"),
    ({"selector": "best"}, PlanError, "unknown selector 'best'"),
    ({"schedule": "fast"}, PlanError, "unknown schedule 'fast'; choose one of ['naive', "
                                      "'optimized', 'ai']"),
    ({"plan": [1]}, PlanError, "plan must be a dict"),
    ({"max_specs": 0}, PlanError, "max_specs must be a positive int, got 0"),
])
def test_distribute_errors(kwargs, err, needle):
    with pytest.raises(err) as ex:
        eins.distribute(ffn, **kwargs)
    assert needle in str(ex.value)


def test_distribute_rejects_non_functions_and_unknown_stages():
    with pytest.raises(TraceError, match="eins.distribute expects a function, got int"):
        eins.distribute(3)
    low = eins.distribute(ffn, devices=2).lower(S((4, 4)), S((4, 4)), S((4, 4)))
    with pytest.raises(EinsError, match=r"unknown stage 'lowered'; stages: \['traced', "
                                        r"'planned', 'exchange', 'device'\]"):
        low.as_text("lowered")


def test_pipeline_starts_with_the_planning_passes():
    assert PIPELINE[:3] == PLANNING
    assert [p.__name__ for p in PLANNING] == ["enumerate_specs", "cut_trees", "choose_specs"]


# ----------------------------------------------------------------------------- the paper's workloads
from eins.models import chains, llama  # noqa: E402


def _costs(prog, p=8, nrandom=20):
    """dp, greedy and ``nrandom`` random plans of one program (enumerated once)."""
    st = run_passes(Compilation(prog, tuple(range(p)), Options(cost="proxy")), PLANNING[:2])
    out = {"dp": choose_specs(st).plan, "greedy": choose_specs(
        replace(st, options=Options(cost="proxy", selector="greedy"))).plan}
    out["random"] = [choose_specs(replace(st, options=Options(cost="proxy", selector="random",
                                                              seed=s)))
                     .plan.cost_bytes for s in range(nrandom)]
    return out


def test_paper_block_128k_tokens_is_planned_ulysses_like():
    w = llama.WORKLOADS["1x128K"]
    low = eins.distribute(w.function(llama.PAPER), devices=8, cost="proxy").lower(*w.args(llama.PAPER))
    prog, plan = low.program, low.plan
    tokens = 131072
    seen = set()
    for e, ep in zip(prog.eqns, plan.eqn_plans):
        seen.add(e.prim)
        if e.prim == "attention":
            assert ep.splits == {"heads_kv": 8}
            assert ep.out_counts(0) == (8, 1, 1)
        elif e.prim in ("rms_norm", "silu", "mul", "add"):
            assert e.outputs[0].shape[0] == tokens
            assert ep.out_counts(0)[0] == 8 and ep.pieces == 8, e.prim
            assert all(c == 1 for c in ep.out_counts(0)[1:]), e.prim
        elif e.prim == "matmul":
            # x @ W: tokens split 8 ways, the weight read whole by every piece (replicated)
            assert ep.splits == {"i": 8}, ep.splits
            w_shape = e.inputs[1].shape
            assert all(f.inputs[1].shape == w_shape for f in ep.spec.fspecs)
            assert ep.cost.aggregation == 0
    assert {"attention", "rms_norm", "matmul", "silu", "mul", "add"} <= seen
    assert sum(e.prim == "matmul" for e in prog.eqns) == 7


@pytest.mark.parametrize("name", list(getattr(llama, "WORKLOADS", {})))
def test_dp_beats_greedy_and_random_on_every_token_workload(name):
    w = llama.WORKLOADS[name]
    prog = eins.make_ir(w.function(llama.PAPER))(*w.args(llama.PAPER))
    c = _costs(prog)
    assert c["dp"].cost_bytes <= c["greedy"].cost_bytes
    assert all(c["dp"].cost_bytes <= r for r in c["random"])


@pytest.mark.parametrize("name", list(getattr(chains, "CHAINS", ())))
def test_dp_beats_greedy_and_random_on_every_chain(name):
    ch = chains.chain(name)
    prog = eins.make_ir(ch.fn)(*ch.shape_args())
    c = _costs(prog)
    assert c["dp"].cost_bytes <= c["greedy"].cost_bytes
    assert all(c["dp"].cost_bytes <= r for r in c["random"])
    # a chain is one tree (every product is used once), on which the DP is exact
    from eins.passes.cut_trees import find_trees
    assert len(find_trees(prog)) == 1


def test_hand_written_strategies_are_costed_like_any_plan():
    w = llama.WORKLOADS["1x8K"]
    fn, args = w.function(llama.PAPER), w.args(llama.PAPER)
    dp = eins.distribute(fn, devices=8, cost="proxy").lower(*args)
    # replaying the dp plan (Ulysses-like) as a forced plan gives the same plan and cost
    ulysses = {i: dict(ep.intervals) for i, ep in enumerate(dp.plan.eqn_plans)}
    forced = eins.distribute(fn, devices=8, plan=ulysses, cost="proxy").lower(*args)
    assert forced.cost_bytes == dp.cost_bytes
    assert forced.plan_table() == dp.plan_table()
    assert forced.plan.selector == "dp+forced"
    # Megatron tensor parallel: column-split wq/wk/wv/w1/w3, row-split wo/w2, heads for
    # attention; the rest is left to the DP
    prog = dp.program
    by_weight = {}
    # program inputs: x, the weights dict flattened in sorted key order, cos, sin
    flat_w = {id(v): k for k, v in zip(sorted(llama.weight_shapes(llama.PAPER)),
                                       prog.inputs[1:10])}
    for i, e in enumerate(prog.eqns):
        if e.prim == "matmul" and id(e.inputs[1]) in flat_w:
            by_weight[flat_w[id(e.inputs[1])]] = i
    assert set(by_weight) == {"wq", "wk", "wv", "wo", "w1", "w2", "w3"}
    # d1: the output's columns; r0: the contracted dimension (the weight's rows)
    megatron = {by_weight[k]: {"d1": 8} for k in ("wq", "wk", "wv", "w1", "w3")}
    megatron.update({by_weight[k]: {"r0": 8} for k in ("wo", "w2")})
    att = next(i for i, e in enumerate(prog.eqns) if e.prim == "attention")
    megatron[att] = {"heads_kv": 8}
    tp = eins.distribute(fn, devices=8, plan=megatron, cost="proxy").lower(*args)
    rows = tp.plan_table()
    assert rows[by_weight["w2"]]["agg"] == 8 and rows[by_weight["w1"]]["splits"] == {"d1": 8}
    assert tp.cost_bytes >= dp.cost_bytes


def test_a_tensor_beyond_2_53_bytes_is_refused_naming_it():
    """It failed in the exchange stage naming an internal atom ("atom 'A0_0' has size
    2417851639229258349412352")."""
    S = eins.ShapeDtype
    with pytest.raises(eins.PlanError, match=r"input 0 float32\[1099511627776,1099511627776\] "
                                             r"holds 4.84e\+24 bytes; .*at most 2\*\*53"):
        eins.distribute(lambda x: x * 2, devices=2).lower(S((2**40, 2**40), "float32"))
    with pytest.raises(eins.PlanError, match=r"eqn 0 \(matmul\) output 0 float32"):
        eins.distribute(lambda a, b: a @ b, devices=2).lower(S((2**27, 1), "float32"),
                                                             S((1, 2**27), "float32"))


# ----------------------------------------------------------------------------- stage objects
def test_jit_lower_is_a_stage_object_that_prints_and_compiles():
    """As JAX's jit(f).lower(x): eins.jit(f).lower returns a stage (as Distributed.lower
    does), not a tuple; its compile() runs what calling the jitted function runs."""
    f = eins.jit(lambda x, s: eins.relu(x) * s)
    x = np.array([[-1.0, 2.0], [3.0, -4.0]], np.float32)
    low = f.lower(x, 2.0)
    assert f.lower(np.zeros((2, 2), np.float32), 2.0) is low     # cached per signature
    assert low.as_text() == eins.make_ir(lambda x, s: eins.relu(x) * s)(x, 2.0).pretty()
    run = low.compile()
    np.testing.assert_array_equal(run(x, 2.0), np.array([[0, 4], [6, 0]], np.float32))
    np.testing.assert_array_equal(run(x, 2.0), f(x, 2.0))
    assert run.as_text() == low.as_text()
    np.testing.assert_array_equal(run(x, 3.0), np.array([[0, 6], [9, 0]], np.float32))
    with pytest.raises(TraceError, match=r"argument 1: compiled for a Python float \(a runtime "
                                         r"input of the program\), called with the Python "
                                         r"int 3"):
        run(x, 3)
    with pytest.raises(TraceError, match=r"argument 0: compiled for float32\[2,2\], got "
                                         r"float32\[3\]"):
        run(np.ones(3, np.float32), 2.0)
    with pytest.raises(EinsError, match=r"unknown stage 'planned' of an eins.jit lowering"):
        low.as_text("planned")


def test_compiled_prints_its_device_program():
    low = eins.distribute(ffn, devices=2).lower(S((4, 4)), S((4, 4)), S((4, 4)))
    c = low.compile()
    assert c.as_text() == low.as_text("device") and c.as_text("planned") == low.as_text()


def test_the_topology_is_resolved_once_and_carried(monkeypatch):
    """distribute resolves the topology once; planning (the time cost, the memory cap) and
    the physical passes read that object from the Compilation."""
    import importlib
    api = importlib.import_module("eins.api")
    calls = []
    real = api.resolve_topology

    def counted(*a):
        calls.append(a)
        return real(*a)

    def refused(*a):
        raise AssertionError(f"resolved again: {a}")
    monkeypatch.setattr(api, "resolve_topology", counted)
    for where in ("eins.passes.choose_specs", "eins.passes.overlay"):
        monkeypatch.setattr(importlib.import_module(where), "resolve_topology", refused)
    f = eins.distribute(ffn, devices=4, schedule="optimized", synthesis_steps=4)
    low = f.lower(S((8, 4)), S((4, 8)), S((8, 4)))
    assert len(calls) == 1 and f.topology.name == "dgx-a100:4"
    assert low.compilation.topology is f.topology
    assert low.physical.topology is f.topology
    assert low.physical.exchange.topology is f.topology


def test_the_ir_never_imports_the_hardware_layer():
    """eins/ir/ holds data and rules only: the machine model sits above it, and a Topology
    reaches the IR as a value (a TYPE_CHECKING import for annotations is fine)."""
    import ast
    import pathlib
    root = pathlib.Path(eins.__file__).parent / "ir"
    bad = []
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for b in ast.walk(tree) if isinstance(b, ast.If)
                       and getattr(b.test, "id", None) == "TYPE_CHECKING"
                       for s in b.body for n in ast.walk(s)}
        for n in ast.walk(tree):
            names = ([n.module or ""] if isinstance(n, ast.ImportFrom) else
                     [a.name for a in n.names] if isinstance(n, ast.Import) else [])
            if id(n) not in typing_only and any(m.startswith("eins.hardware") for m in names):
                bad.append(f"{path.name}:{n.lineno}")
    assert bad == []


@pytest.mark.parametrize("module", ["eins.api", "eins.stages", "eins.arguments",
                                    "eins.ir.plan"])
def test_docstring_examples_run(module):
    """The modules' examples are contracts: each runs as written."""
    import doctest
    import importlib
    failed, tried = doctest.testmod(importlib.import_module(module))
    assert tried > 0 and failed == 0
