"""Join-agg specs (Definitions 3.5-3.7) from signatures: the paper's Examples 3.8 and 3.9."""
import numpy as np
import pytest

from eins.errors import EinsError
from eins.ir import joinagg
from eins.ir.joinagg import Signature, signature_indexing
from eins.ir.types import Box


def test_example_3_9_matmul_four_function_specs():
    """i = k = 256, j = 512; i and j split in halves, k whole: F_mn multiplies rows m of A
    (columns n) by rows n of B; F_m1 and F_m2 share the output block C_m, summed by ⊕."""
    ix = signature_indexing("ij,jk->ik | sum(j)", [(256, 512), (512, 256)], [(256, 256)])
    assert ix.extents == {"i": 256, "j": 512, "k": 256}
    spec = ix.spec({"i": ((0, 128), (128, 256)), "j": ((0, 256), (256, 512))})
    assert len(spec) == 4 and spec.aggs == ("sum",)
    f11, f12, f21, f22 = spec.fspecs
    assert f11.inputs == (Box((0, 0), (128, 256)), Box((0, 0), (256, 256)))
    assert f12.inputs == (Box((0, 256), (128, 512)), Box((256, 0), (512, 256)))
    assert f21.outputs == f22.outputs == (Box((128, 0), (256, 256)),)
    assert spec.out_tiling() == (Box((0, 0), (128, 256)), Box((128, 0), (256, 256)))
    assert spec.multiplicity() == {Box((0, 0), (128, 256)): 2, Box((128, 0), (256, 256)): 2}
    spec.check_tiling([(256, 256)])


def test_example_3_8_contraction_split_only():
    ix = signature_indexing("ij,jk->ik | sum(j)", [(256, 512), (512, 256)], [(256, 256)])
    spec = ix.spec({"j": ((0, 256), (256, 512))})
    assert [f.outputs for f in spec.fspecs] == [(Box((0, 0), (256, 256)),)] * 2
    assert spec.aggs == ("sum",)
    assert ix.spec({"i": ((0, 128), (128, 256))}).aggs == (None,)  # nothing to aggregate


def test_signature_errors_name_the_text():
    with pytest.raises(EinsError, match="malformed signature 'ij'"):
        Signature.parse("ij")
    with pytest.raises(EinsError, match="malformed aggregation"):
        Signature.parse("ij->i | avg(j)")
    with pytest.raises(EinsError, match=r"aggregates over 'k', but its contracted indices "
                                        r"are 'j'"):
        Signature.parse("ij->i | sum(k)")
    assert Signature.parse("ij->i | max(j)").agg == "max"


def test_sixteen_bit_sums_accumulate_in_float32_on_every_backend():
    """The numpy ⊕ added float16 partials pairwise in float16 (2048 + 1 + 1 + 1 stayed 2048);
    it accumulates in float32 and rounds once, as the one-device kernel and the GPU's ⊕
    kernel do: 2051 rounds to 2052 in float16."""
    import eins
    from eins.ir.joinagg import aggregate
    from eins.ir.types import bfloat16
    for dt in (np.float16, bfloat16):
        parts = [np.array([v], dt) for v in (2048, 1, 1, 1)]
        got = aggregate("sum", parts)
        assert got.dtype == np.dtype(dt) and float(got[0]) == (2052.0 if dt is np.float16
                                                                else 2048.0)
    x = np.array([[2048, 1, 1, 1]], np.float16)
    f = lambda x: eins.sum(x, 1)   # noqa: E731
    plan = {0: {"r0": 4}}
    low = eins.distribute(f, devices=4, plan=plan).lower(x)
    outs = [eins.jit(f)(x), eins.distribute(f, devices=4, plan=plan)(x),
            low.generate("numpy").run([x])[0], low.compile("interpret")(x)]
    assert [float(np.asarray(o)[0]) for o in outs] == [2052.0] * 4


def test_operands_of_one_layout_share_their_boxes():
    """Operands of one layout (an [8, 4] activation cut along its rows, its index named i in
    one eqn and a in another) with equal intervals take the same Box objects; a weight no
    split cuts repeats its one box; where another split index repeats an operand's boxes,
    they follow the function specifications' order; another cut gets its own boxes."""
    mm = signature_indexing("ij,jk->ik", [(8, 4), (4, 2)], [(8, 2)])
    ew = signature_indexing("ab->ab", [(8, 4)], [(8, 4)])
    cut = ((0, 3), (3, 8))
    a, b = mm.spec({"i": cut}), ew.spec({"a": cut})
    rows = [Box((0, 0), (3, 4)), Box((3, 0), (8, 4))]
    assert [f.inputs[0] for f in a.fspecs] == rows
    assert all(x.inputs[0] is y.inputs[0] for x, y in zip(a.fspecs, b.fspecs))
    assert [f.inputs[1] for f in a.fspecs] == [Box((0, 0), (4, 2))] * 2
    both = mm.spec({"i": cut, "k": ((0, 1), (1, 2))})   # i0k0, i0k1, i1k0, i1k1
    assert [f.inputs[0] for f in both.fspecs] == [rows[0], rows[0], rows[1], rows[1]]
    assert [f.inputs[1] for f in both.fspecs] == [Box((0, 0), (4, 1)), Box((0, 1), (4, 2))] * 2
    assert [f.outputs[0] for f in both.fspecs][1] == Box((0, 1), (3, 2))
    assert ew.spec({"a": ((0, 4), (4, 8))}).fspecs[0].inputs[0] == Box((0, 0), (4, 4))


def test_kept_operand_boxes_are_bounded_by_the_boxes_they_hold():
    """The shared lists of boxes are bounded by the boxes they hold in all (2^18), not by
    their count alone (a plan on 512 devices kept ~67 MB after planning): the memo weighs
    each list by its length (tests/test_memo.py checks a weighed memo drops and skips)."""
    boxes = joinagg.OPERAND_BOXES
    assert (boxes.limit, boxes.weight, boxes.room) == (4096, len, 1 << 18)
    ew = signature_indexing("ab->ab", [(4096, 4)], [(4096, 4)])
    cut = {"a": tuple((k, k + 1) for k in range(4096))}
    spec = ew.spec(cut)
    assert boxes.get(next(reversed(boxes.table))) is not None
    assert boxes.held == sum(map(len, boxes.table.values())) <= 1 << 18
    assert ew.spec(cut).fspecs[7].inputs[0] is spec.fspecs[7].inputs[0]   # kept: shared
