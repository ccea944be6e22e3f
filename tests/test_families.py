"""Plan families per bucket of the length distribution (issue 36, eins/passes/families.py):
the bucket rule, and a compiled program that keeps one family per bucket seen, each planned
once for the first batch of its bucket, every batch equal to eins.jit on its ends."""
import numpy as np
import pytest

import eins
from eins.errors import EinsError
from eins.models import llama
from eins.passes.families import bucket
from helpers import SPREAD

S = 48


@pytest.mark.parametrize("ends,p,want", [
    ((12, 24, 36, 48), 4, 0),            # longest 12 = one device's share of 48
    ((6, 12, 18, 24, 30, 36, 42, 48), 4, 0),
    ((13, 24, 36, 48), 4, 1),            # 13 * 4 = 52 > 48, <= 96
    ((24, 48), 4, 1),                    # 24 * 4 = 96 = 48 * 2
    ((25, 48), 4, 2),                    # 100 > 96, <= 192
    ((48,), 4, 2),                       # one document: log2(p)
    ((48,), 8, 3),
    ((48,), 1, 0),                       # one device holds everything
])
def test_bucket_is_the_longest_documents_shares(ends, p, want):
    assert bucket(llama.padded_ends(ends, 8, S), p) == want


def attn(q, k, v, e):
    return eins.attention(q, k, v, segments=e)


def qkv(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((4, S, 8)), rng.standard_normal((2, S, 8)),
            rng.standard_normal((2, S, 8)))


# buckets 0, 2, 2, 0, 2, 1 at p=4
STREAM = [(6, 12, 18, 24, 30, 36, 42, 48), (40, 48), (5, 10, 48), (12, 24, 36, 48), (3, 48),
          (24, 48)]


@pytest.mark.parametrize("backend", ["numpy", "interpret"])
def test_a_family_per_bucket(backend):
    """Each bucket's first batch plans its family (a plan, no trace); a later batch of a
    bucket seen before plans nothing. On interpret each family is one capacity program,
    captured once."""
    if backend == "interpret":
        pytest.importorskip("triton")
    q, k, v = qkv()
    d = eins.distribute(attn, devices=4, backend=backend, families=True, tuning=SPREAD)
    ref = eins.jit(attn)
    seen, splits = set(), {}
    for n, ends in enumerate(STREAM, 1):
        e = llama.padded_ends(ends, 8, S)
        dt = np.float32 if backend == "interpret" else np.float64
        got = d(q.astype(dt), k.astype(dt), v.astype(dt), e)
        tol = 1e-5 if backend == "interpret" else 1e-12
        np.testing.assert_allclose(got, ref(q, k, v, e), rtol=tol, atol=tol)
        seen.add(bucket(e, 4))
        st = d.stats()
        assert (st["traces"], st["rebalances"]) == (1, n)
        assert st["families"] == len(seen) and st["plans"] == 1 + len(seen)
        if backend == "interpret":
            assert st["graph_captures"] == len(seen) and st["lowerings"] == len(seen)
        splits.setdefault(bucket(e, 4), d.last.capacity)
    assert seen == {0, 1, 2}
    if backend == "interpret":   # every family here has a capacity form
        assert all(c is not None for c in splits.values())


def test_families_plan_for_their_bucket():
    """The short-document bucket's family cuts attention by query sequence alone (whole
    documents per device); the one-document bucket's family is another plan."""
    q, k, v = qkv(1)
    d = eins.distribute(attn, devices=4, families=True, tuning=SPREAD)
    for ends in ((12, 24, 36, 48), (48,), (6, 12, 24, 36, 48)):
        d(q, k, v, llama.padded_ends(ends, 8, S))
    fams = d.last.families
    assert sorted(fams) == [0, 2] and d.stats()["families"] == 2
    assert fams[0].eqn_plans[0].splits == {"sequence": 4}
    assert fams[2].eqn_plans[0].splits != {"sequence": 4}
    for plan in fams.values():
        assert any(r["splits"] for r in plan.table())


def test_families_need_the_rebalance_and_runtime_ends():
    q, k, v = qkv(2)
    e = llama.padded_ends((12, 48), 8, S)
    with pytest.raises(EinsError, match="families=True.*rebalance=False"):
        eins.distribute(attn, devices=4, families=True, rebalance=False)(q, k, v, e)
    static = eins.distribute(lambda q, k, v: eins.attention(q, k, v, segments=(12, 48)),
                             devices=4, families=True)
    with pytest.raises(EinsError, match="no runtime operand"):
        static(q, k, v)
    with pytest.raises(EinsError, match="families must be True or False"):
        eins.distribute(attn, devices=4, families="yes")
