"""Speedups of planning under the time cost (issue 10, parts 6-7) must not change the plans:
the chosen splits per eqn and both costs of a few workloads, recorded as literals from
main at 5ad2acc (before the speedups), must come out the same."""
import pytest

import eins
from eins.models import llama

# (workload, p, topology, cost): (splits per eqn as "index count" joined by ".", one eqn per
# word, "-" for one piece; cost_bytes; cost_s)
EXPECTED = {
    ('1x128K', 8, None, 'time'):
        ("a8 i8 a8 a8 b8 i8 a8 a8 b8 i8 a8 a8 heads_kv8 a8 b8 i8 a8 a8 i8 a8 i8 a8 i8 a8",
         42547150848, 0.0837832610996587),
    ('1x128K', 8, None, 'proxy'):
        ("a8 i8 a8 a8 b8 i8 a8 a8 b8 i8 b8 b8 heads_kv8 b8 a8 i8 a8 a8 i8 a8 i8 a8 i8 a8",
         42547150848, 0.08378326109965868),
    ('8x1K', 8, 'dgx-h100:8', 'time'):
        ("a8 i8 a8 a8 b8 i8 a8 a8 b8 i8 a8 a8 sequence8 b8 a8 i8 a8 a8 i8 a8 i8 a8 i8 a8",
         5763104768, 0.0005795207523648493),
    ('1x8K', 72, 'gb200-nvl72', 'time'):
        ("a72 i36.k2 a36.b2 a36.b2 a8.b9 i72 a72 a72 b72 i72 a72 a72 heads_kv8.sequence9 "
         "a8.b9 a36.b2 i36.k2 a36.b2 a72 i24.k3 a24.b3 i24.k3 a24.b3 i24.j3 a36.b2",
         15807332352, 5.9535074896355555e-05),
}


def _splits(plan) -> str:
    return " ".join(".".join(f"{n}{c}" for n, c in sorted(ep.splits.items())) or "-"
                    for ep in plan.eqn_plans)


@pytest.mark.parametrize("case", list(EXPECTED), ids=lambda c: f"{c[0]}-p{c[1]}-{c[3]}")
def test_plan_unchanged(case):
    name, p, topo, cost = case
    wl = llama.WORKLOADS[name]
    kw = {"topology": topo} if topo else {}
    plan = eins.distribute(wl.function(llama.PAPER), devices=p, cost=cost,
                           **kw).lower(*wl(llama.PAPER)).plan
    splits, cost_bytes, cost_s = EXPECTED[case]
    assert _splits(plan) == splits
    assert plan.cost_bytes == cost_bytes
    assert plan.cost_s == pytest.approx(cost_s, rel=1e-12)
