"""The spec checker: every primitive's enumerated specs are right, and the checker itself
catches wrong specs (bad ⊕, position-dependent kernels, missing function specifications)
and missing ones (an index declared unshardable that could be split)."""
import numpy as np
import pytest

import eins
from eins.ir.joinagg import JoinAggSpec, signature_indexing
from eins.ir.types import TensorType
from eins import validate_specs as validate
from eins.ir.primitive import PRIMITIVES, Primitive, register
from eins.tracing import bind
from helpers import assert_close


def test_every_registered_primitive_passes():
    reports = validate.check()
    assert set(reports) == set(PRIMITIVES)
    untested = [n for n, r in reports.items() if r.untested]
    assert not untested, f"add samples for {untested} to eins/validate_specs.py"
    wrong = {n: r.wrong[:3] for n, r in reports.items() if r.wrong}
    assert not wrong
    # the samples reach every p: at least one spec per p per sample of matmul
    assert reports["matmul"].checked >= 4 * len(validate.PS)


def test_kernels_never_return_an_operand_buffer():
    # kernels skip cast copies when dtypes agree; every result must still be its own memory
    # (the runtime may free or reuse an operand's block once the eqn has run)
    from eins.ir.program import Literal
    from eins.ir.primitive import get_primitive
    from eins.tracing import trace
    seen = set()
    for label, fn, args in validate.samples():
        prog = trace(fn, args)[0]
        env = validate.sample_values(prog, args)
        for e in prog.eqns:
            ins = [np.asarray(a.value, a.dtype) if isinstance(a, Literal) else env[id(a)]
                   for a in e.inputs]
            for out in get_primitive(e.prim).impl(*ins, **e.params):
                if e.prim in ("reshape", "transpose", "slice"):
                    continue  # views by design (numpy's semantics)
                seen.add(e.prim)
                assert not any(np.shares_memory(out, x) for x in ins), (label, e.prim)
    assert {"add", "sum", "mean", "softmax", "where", "einsum", "rms_norm", "layer_norm",
            "rope", "attention", "exp"} <= seen


def _sig_prim(name, sig, impl, shardable=None, producer_hook=None):
    def abstract(*ts):
        return (TensorType(ts[0].shape if "k" not in sig else (ts[0].shape[0], ts[1].shape[1]),
                           ts[0].dtype),)

    def indexing(ins, outs):
        ix = signature_indexing(sig, [t.shape for t in ins], [t.shape for t in outs], shardable)
        if producer_hook is None:
            return ix
        return type(ix)(ix.extents, ix.shardable, producer_hook(ix.producer))

    register(Primitive(name, abstract, impl, indexing=indexing))
    return name


def _block_prim(name, impl, block_impl, shardable=None):
    """An elementwise-shaped primitive ("ab->ab") with its own block kernel."""
    register(Primitive(name, lambda t: (TensorType(t.shape, t.dtype),), impl,
                       indexing=lambda ins, outs: signature_indexing(
                           "ab->ab", [ins[0].shape], [outs[0].shape], shardable),
                       block_impl=block_impl))
    return name


@pytest.fixture
def fake_prims():
    names = [
        # contracted index aggregated with max instead of +
        _sig_prim("test_val_badagg", "ij,jk->ik | max(j)", lambda a, b: (a @ b,)),
        # a kernel that depends on global row positions but has no block_impl
        _sig_prim("test_val_iota", "ab->ab",
                  lambda x: (x + np.arange(x.shape[0])[:, None].astype(x.dtype),)),
        # elementwise, but only 'a' declared shardable: 'b' is a missing spec
        _sig_prim("test_val_hidden", "ab->ab", lambda x: (np.maximum(x, 0),),
                  shardable={"a": "any"}),
        # a producer that drops all but one function specification
        _sig_prim("test_val_fewspecs", "ab->ab", lambda x: (x * 2,),
                  producer_hook=lambda prod: lambda iv: JoinAggSpec(prod(iv).fspecs[:1],
                                                                    prod(iv).aggs)),
        # the same with 'b' unshardable: its one-block "split" is no split, so not missing
        _sig_prim("test_val_fewhidden", "ab->ab", lambda x: (x * 2,), shardable={"a": "any"},
                  producer_hook=lambda prod: lambda iv: JoinAggSpec(prod(iv).fspecs[:1],
                                                                    prod(iv).aggs)),
        # block kernels that break the block's contract: a float32 block of a float64
        # output; two outputs for one; a whole kernel one row short of the shape rule
        _sig_prim("test_val_dtype", "ab->ab", lambda x: (x.astype(np.float32),)),
        _block_prim("test_val_twoouts", lambda x: (x,), lambda f, x: (x, x)),
        _block_prim("test_val_short", lambda x: (x[:-1],), lambda f, x: (x,),
                    shardable={"a": "any"}),
    ]
    yield names
    for n in names:
        PRIMITIVES.pop(n, None)


def _check(prim, *arrays):
    prog = eins.make_ir(lambda *xs: bind(prim, *xs))(*arrays)
    e = prog.eqns[0]
    rep = validate.Report(prim)
    wants = list(PRIMITIVES[prim].impl(*arrays))
    validate.check_eqn(e, list(arrays), wants, rep, "test")
    return rep


def test_checker_catches_wrong_aggregation(fake_prims):
    rng = np.random.default_rng(0)
    rep = _check("test_val_badagg", rng.normal(size=(4, 6)), rng.normal(size=(6, 4)))
    assert rep.wrong
    assert all("'j'" in w or "j" in w.split("split")[1] for w in rep.wrong)
    assert any("output 0 differs from the whole result" in w for w in rep.wrong)
    # specs that do not split j are right and not reported
    assert rep.checked > len(rep.wrong)


def test_checker_catches_position_dependent_kernel(fake_prims):
    rep = _check("test_val_iota", np.zeros((6, 4)))
    bad = [w for w in rep.wrong]
    assert bad and all("'a'" in w for w in bad)   # splitting rows shifts the iota
    assert not any("split {'b'" in w for w in bad)


def test_checker_reports_missing_shardable_index(fake_prims):
    rep = _check("test_val_hidden", np.random.default_rng(1).normal(size=(6, 4)))
    assert not rep.wrong
    assert any("index 'b' (extent 4) is not shardable, yet a 2-way split is correct" in m
               for m in rep.missing)
    assert len(rep.missing) == 1
    # the declared-shardable 'a' is never reported
    assert not any("'a'" in m for m in rep.missing)


def test_checker_catches_missing_function_specifications(fake_prims):
    rep = _check("test_val_fewspecs", np.ones((6, 4)))
    assert any("1 function specifications, expected 2" in w for w in rep.wrong)


def test_checker_reports_kernels_that_break_the_block_contract(fake_prims):
    """A spec whose block kernel raises is reported as wrong and the check goes on."""
    x = np.random.default_rng(2).normal(size=(6, 4))
    rep = _check("test_val_dtype", x)
    assert rep.wrong and len(rep.wrong) == rep.checked
    assert all("block kernel output 0 has dtype float32, expected float64" in w
               for w in rep.wrong)
    assert rep.wrong[0].startswith("test: p=1 split whole: EinsError: ")
    rep = _check("test_val_twoouts", x)
    assert rep.wrong and all("block kernel returned 2 outputs, expected 1" in w
                             for w in rep.wrong)


def test_checker_reports_a_whole_kernel_that_breaks_its_shape_rule(fake_prims):
    # its output's shape differs from the shape rule's: reported (the comparison raised a
    # broadcasting ValueError), and the unshardable 'b' is not called missing
    rep = _check("test_val_short", np.ones((6, 4)))
    assert rep.wrong and all("output 0 has shape (6, 4) (the shape rule's), the whole result "
                             "(5, 4)" in w for w in rep.wrong)
    assert not rep.missing


def test_checker_does_not_call_a_one_block_split_missing(fake_prims):
    rep = _check("test_val_fewhidden", np.ones((6, 4)))
    assert any("1 function specifications, expected 2" in w for w in rep.wrong)
    assert not rep.missing


def test_check_of_one_op_skips_the_other_eqns_of_a_sample():
    # getitem traces slice then reshape: checking slice alone leaves the reshape out
    reports = validate.check(["slice"], ps=(2,))
    assert list(reports) == ["slice"] and reports["slice"].checked >= 2
    assert not reports["slice"].wrong


def test_cli_single_op_and_unknown_op(capsys):
    assert validate.main(["--op", "matmul", "--p", "2,3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("matmul") and " ok " in out and "0 wrong" in out
    assert validate.main(["--op", "no_such_op"]) == 2
    assert "unknown primitive 'no_such_op'" in capsys.readouterr().err
    for bad in ("2,x", ""):
        with pytest.raises(SystemExit) as e:
            validate.main(["--op", "matmul", "--p", bad])
        assert e.value.code == 2
        assert f"--p must be comma-separated ints, got {bad!r}" in capsys.readouterr().err
    assert validate.main(["--op", "matmul", "--p", "0"]) == 2
    assert "error: need at least one device, got p=0" in capsys.readouterr().err


def test_cli_reports_wrong_specs_with_exit_status_1(fake_prims, capsys, monkeypatch):
    real = validate.samples

    def more():
        return real() + [("iota", lambda x: bind("test_val_iota", x), (np.zeros((4, 2)),))]

    monkeypatch.setattr(validate, "samples", more)
    assert validate.main(["--op", "test_val_iota", "--p", "2"]) == 1
    out = capsys.readouterr().out
    assert "test_val_iota" in out and "WRONG" in out and "wrong: iota: p=2 split {'a': 2}" in out


def test_cli_verbose_lists_missing_specs(fake_prims, capsys, monkeypatch):
    real = validate.samples
    monkeypatch.setattr(validate, "samples", lambda: real() + [
        ("hidden", lambda x: bind("test_val_hidden", x), (np.ones((4, 2)),))])
    assert validate.main(["--op", "test_val_hidden", "--p", "2"]) == 0
    assert "missing:" not in capsys.readouterr().out
    assert validate.main(["--op", "test_val_hidden", "--p", "2", "-v"]) == 0
    out = capsys.readouterr().out
    assert "test_val_hidden" in out and " ok " in out and "1 missing" in out
    assert ("    missing: hidden: index 'b' (extent 2) is not shardable, yet a 2-way split is "
            "correct") in out


def test_run_spec_names_structural_problems():
    from eins.ir.joinagg import FunctionSpec
    from eins.ir.types import Box
    from eins.errors import EinsError
    a, b = np.ones((4, 6)), np.ones((6, 2))
    e = eins.make_ir(lambda x, y: x @ y)(a, b).eqns[0]
    halves = [FunctionSpec((Box((0, lo), (4, hi)), Box((lo, 0), (hi, 2))), (Box((0, 0), (4, 2)),))
              for lo, hi in ((0, 3), (3, 6))]
    with pytest.raises(EinsError, match=r"box \[0:4,0:2\] appears 2 times but ⊕ is None"):
        validate.run_spec(e, JoinAggSpec(tuple(halves), (None,)), [a, b])
    assert_close(validate.run_spec(e, JoinAggSpec(tuple(halves), ("sum",)), [a, b])[0], a @ b,
                 n=a.shape[1])
    out_of_bounds = FunctionSpec((Box((0, 0), (4, 7)), Box((0, 0), (6, 2))), (Box((0, 0), (4, 2)),))
    with pytest.raises(EinsError, match=r"input box \[0:4,0:7\] is not a projection of "
                                        r"\[0:4,0:6\]"):
        validate.run_spec(e, JoinAggSpec((out_of_bounds,), (None,)), [a, b])
    gap = FunctionSpec((Box((0, 0), (2, 6)), Box((0, 0), (6, 2))), (Box((0, 0), (2, 2)),))
    with pytest.raises(EinsError, match="do not tile"):
        validate.run_spec(e, JoinAggSpec((gap,), (None,)), [a, b])
    one_input = FunctionSpec((Box((0, 0), (4, 6)),), (Box((0, 0), (4, 2)),))
    with pytest.raises(EinsError, match=r"\[0:4,0:6\] -> \[0:4,0:2\]: arity differs from the "
                                        r"eqn's"):
        validate.run_spec(e, JoinAggSpec((one_input,), (None,)), [a, b])
    whole_in = (Box((0, 0), (4, 6)), Box((0, 0), (6, 2)))
    wide = FunctionSpec(whole_in, (Box((0, 0), (4, 3)),))
    with pytest.raises(EinsError, match=r"output box \[0:4,0:3\] is not a projection of "
                                        r"\[0:4,0:2\]"):
        validate.run_spec(e, JoinAggSpec((wide,), (None,)), [a, b])
    small = FunctionSpec(whole_in, (Box((0, 0), (2, 2)),))
    with pytest.raises(EinsError, match=r"block kernel output 0 has shape \(4, 2\), box "
                                        r"\[0:2,0:2\] has \(2, 2\)"):
        validate.run_spec(e, JoinAggSpec((small,), (None,)), [a, b])
