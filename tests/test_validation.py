"""Bad input found by trying eins as a newcomer (issue 11): each gets an EinsError subclass
naming the value, at the earliest call that can know it."""
import math
import os
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

import eins
from eins.cli import main
from eins.errors import (EinsError, ExProgError, InputError, OutputError, PlanError,
                         ShapeError, TopologyError)
from eins.ir import exprog
from eins.ir.plan import Options, Tuning
from helpers import assert_close

S = eins.ShapeDtype


def ffn(x, w1, w2):
    return eins.relu(x @ w1) @ w2


RNG = np.random.default_rng(0)
FFN = [RNG.standard_normal(s).astype(np.float32) for s in [(8, 4), (4, 6), (6, 4)]]


# ----------------------------------------------------------------------------- ShapeDtype
@pytest.mark.parametrize("shape,needle", [
    ((2.5, 4), r"got \(2\.5, 4\) \(dimension 2\.5 is a float\)"),
    (("a", 4), r"got \('a', 4\) \(dimension 'a' is a str\)"),
    ((True, 4), r"dimension True is a bool"),
    ((np.float64(3.0),), r"dimension np.float64\(3\.0\) is a float64"),
    (None, r"must be a tuple of ints, got None"),
])
def test_shape_dtype_rejects_non_integer_dimensions(shape, needle):
    with pytest.raises(ShapeError, match=needle):
        S(shape)


@pytest.mark.parametrize("shape", [[True, 3], [2.0, 3], ["2", 3], [2, -1], 4])
def test_tensor_desc_rejects_what_shape_dtype_rejects(shape):
    with pytest.raises(ShapeError, match=r"tensorDesc: shape must be a list of non-negative "
                                         r"ints, got .*\(tensorDesc shape"):
        eins.tensorDesc(shape)
    assert eins.tensorDesc([np.int32(2), 3]).shape == (2, 3)


def test_shape_dtype_without_a_dtype_is_an_error_not_float64():
    with pytest.raises(eins.DTypeError, match=r"ShapeDtype\(2, 3\): dtype is None"):
        S((2, 3), None)


def test_shape_dtype_accepts_numpy_integers():
    assert S((np.int64(3), 4)).shape == (3, 4) and type(S((np.int64(3),)).shape[0]) is int


# ----------------------------------------------------------------------------- Options
@pytest.mark.parametrize("kw,needle", [
    ({"inputs_resident": "no"}, r"inputs_resident must be True or False, got 'no'"),
    ({"inputs_resident": 1}, r"inputs_resident must be True or False, got 1"),
    ({"seed": "abc"}, r"seed must be a non-negative int, got str 'abc'"),
    ({"seed": 1.5}, r"seed must be a non-negative int, got float 1\.5"),
    ({"seed": -1}, r"seed must be a non-negative int, got int -1"),
    ({"synthesis_budget_s": float("nan")}, r"positive, finite number of seconds, got nan"),
    ({"synthesis_budget_s": float("inf")}, r"got inf"),
    ({"synthesis_budget_s": 0}, r"got 0"),
    ({"synthesis_budget_s": "1"}, r"got '1'"),
    ({"selector": "best"}, r"unknown selector 'best'; choose one of \['dp', 'greedy', 'random'\]"),
    # an array compared with the names was numpy's raw 'truth value ... is ambiguous'
    ({"selector": np.array(["dp", "greedy"])}, r"unknown selector array\(\['dp', 'greedy'\]"),
    ({"cost": np.array([1, 2])}, r"unknown cost array\(\[1, 2\]\)"),
    ({"schedule": "fast"}, r"unknown schedule 'fast'"),
    ({"max_specs": 0}, r"max_specs must be a positive int, got 0"),
    ({"plan": [1]}, r"plan must be a dict"),
    ({"plan": {"0": {"i": 2}}}, r"plan: keys are eqn indices \(ints\), got '0'"),
    ({"plan": {0: 2}}, r"plan\[0\] must be a dict \{index: count or intervals\}, got 2"),
    ({"topology": 8}, r"topology must be a preset name, a JSON file path or a Topology, got int 8"),
    ({"tuning": {"patience": 3}}, r"tuning must be an eins.ir.plan.Tuning, got dict \{'patience': 3\}"),
])
def test_every_option_is_checked_where_it_is_given(kw, needle):
    with pytest.raises(PlanError, match=needle):
        Options(**kw)
    with pytest.raises(PlanError, match=needle):
        eins.distribute(ffn, devices=2, **kw)


@pytest.mark.parametrize("kw,needle", [
    ({"patience": -1}, r"Tuning.patience must be a non-negative int, got -1"),
    ({"seeds_revised": 1.0}, r"Tuning.seeds_revised must be a non-negative int, got 1.0"),
    ({"time_fanin": 0}, r"Tuning.time_fanin must be a positive int, got 0"),
    ({"shared_reads": 0}, r"Tuning.shared_reads must be True or False, got 0"),
    ({"relay_move": 1.5}, r"Tuning.relay_move must be a number from 0 to 1, got 1.5"),
    ({"kick_swaps": (3, 2)}, r"Tuning.kick_swaps must be a pair \(fewest, most\) of ints with "
                             r"1 <= fewest <= most, got \(3, 2\)"),
])
def test_every_tuning_switch_is_checked(kw, needle):
    with pytest.raises(PlanError, match=needle):
        Tuning(**kw)


def test_tuning_normalizes_numpy_scalars_and_keeps_its_defaults():
    t = Tuning(patience=np.int64(7), relay_move=np.float32(0.5), stop_at_floor=np.bool_(False))
    assert (type(t.patience), t.patience, type(t.relay_move), t.stop_at_floor) == (
        int, 7, float, False)
    assert Options().tuning == Tuning() and hash(Tuning()) == hash(Tuning())


def test_options_normalize_numpy_scalars():
    o = Options(seed=np.int64(3), inputs_resident=np.bool_(True), synthesis_budget_s=np.float32(1))
    assert (type(o.seed), o.seed, o.inputs_resident, type(o.synthesis_budget_s)) == (
        int, 3, True, float)


@pytest.mark.parametrize("devices,topology,needle", [
    (10000, None, r"device ids up to 9999 need a topology with 10000 GPUs"),
    (129, None, r"device ids up to 128 need a topology with 129 GPUs; the default covers 128"),
    ([0, 9], "dgx-h100:8", r"devices \[9\] are not GPUs of topology 'dgx-h100' \(GPUs \[0, 1, .*, 7\]\)"),
    (4, "no-such-machine", r"unknown topology 'no-such-machine'"),
])
def test_devices_that_do_not_fit_the_topology_fail_in_distribute(devices, topology, needle):
    t = time.perf_counter()
    with pytest.raises(TopologyError, match=needle):
        eins.distribute(ffn, devices=devices, topology=topology)
    assert time.perf_counter() - t < 5  # at once, not after planning


def test_the_default_topology_rule_holds_up_to_128_devices():
    # dgx-a100 up to 8 devices, clusters of dgx-a100 above (issue 13)
    for p in (8, 9):
        f = eins.distribute(ffn, devices=p)
        assert f.lower(*FFN).physical.exchange.topology.name == (
            "dgx-a100" if p == 8 else "dgx-a100:2x8")


# ----------------------------------------------------------------------------- writing files
def test_unwritable_dump_dir_warns_and_the_computation_goes_on(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv("EINS_DUMP_DIR", str(blocker / "dumps"))
    with pytest.warns(RuntimeWarning, match=r"EINS_DUMP_DIR=.*a-file/dumps.*cannot write the "
                                            r"(traced/planned|exchange/device) dump.*goes on without it"):
        y = eins.distribute(ffn, devices=2)(*FFN)
    assert_close(y, eins.jit(ffn)(*FFN), n=6, depth=2)


def test_dump_dir_still_written_when_writable(tmp_path, monkeypatch):
    monkeypatch.setenv("EINS_DUMP_DIR", str(tmp_path / "d"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eins.distribute(ffn, devices=2)(*FFN)
    assert sorted(os.listdir(tmp_path / "d")) == [
        "01-ffn-traced.txt", "02-ffn-planned.txt", "03-ffn-exchange.txt", "04-ffn-device.txt"]


def test_dump_file_names_replace_path_characters(tmp_path, monkeypatch):
    # a NUL in __name__ was a raw "ValueError: embedded null byte"; a '/' a missing folder
    monkeypatch.setenv("EINS_DUMP_DIR", str(tmp_path / "d"))

    def f(x, w):
        return x @ w

    S = eins.ShapeDtype((8, 8), "f32")
    for name in ("a\0b", "c/d"):
        f.__name__ = name
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            eins.distribute(f, devices=2).lower(S, S)
    assert sorted(os.listdir(tmp_path / "d")) == [
        "01-a_b-traced.txt", "01-c_d-traced.txt", "02-a_b-planned.txt", "02-c_d-planned.txt"]


def test_generated_code_written_to_a_file_path_is_an_output_error(tmp_path):
    low = eins.distribute(ffn, devices=2).lower(*FFN)
    blocker = tmp_path / "out"
    blocker.write_text("x")
    for target in ("numpy", "cuda"):
        with pytest.raises(OutputError, match=rf"cannot write the generated {target} package to "
                                              rf"'.*out': it is a file"):
            low.generate(target).write(blocker)
        with pytest.raises(OutputError, match=r"cannot write .* to '.*out/sub'"):
            low.generate(target).write(blocker / "sub")
    assert isinstance(OutputError("x"), OSError)  # still an OSError for callers catching it


# ----------------------------------------------------------------------------- paper API
def test_graph_extended_after_compile_is_a_clear_error():
    g = eins.createGraph()
    x = g.insertTensor(eins.tensorDesc([2, 3]))
    y = g.save(g.unary(x, "exp", 0.0))
    cg = eins.compileGraph(g, device=[0, 1])
    z = g.save(g.unary(y, "neg", 0.0))       # added after compileGraph
    w = g.insertTensor(eins.tensorDesc([3]))
    a = np.ones((2, 3))
    cg.load(x, a)
    cg.execute()                              # the compiled graph runs as compiled
    assert_close(cg.offload(y), np.exp(a), n=4)
    with pytest.raises(EinsError, match=r"offload: GraphTensor\(#2.* was not saved \(it was "
                                        r"added or saved after compileGraph: call compileGraph"):
        cg.offload(z)
    with pytest.raises(EinsError, match=r"load: GraphTensor\(#3.* was inserted after "
                                        r"compileGraph"):
        cg.load(w, np.ones(3))
    again = eins.compileGraph(g, device=[0, 1])
    again.load(x, a)
    again.load(w, np.ones(3))
    again.execute()
    assert_close(again.offload(z), -np.exp(a), n=4)


# ----------------------------------------------------------------------------- CLI
def test_binary_exprog_exits_2_with_a_message(tmp_path, capsys):
    p = tmp_path / "bin.exprog"
    p.write_bytes(bytes(range(128, 256)) * 4)
    for cmd in (["check"], ["simulate", "--topology", "dgx-h100"],
                ["synthesize", "--topology", "dgx-h100"]):
        assert main(["exprog", cmd[0], str(p), *cmd[1:]]) == 2
        err = capsys.readouterr().err
        assert "bin.exprog' is not UTF-8 text (byte 0x80 at offset 0)" in err
    assert issubclass(InputError, EinsError) and main(["topology", "parse", str(p), "--gpu",
                                                       "H100"]) == 2


def test_binary_topology_json_and_unwritable_trace_exit_2(tmp_path, capsys):
    p = tmp_path / "topo.json"
    p.write_bytes(bytes(range(128, 256)))
    assert main(["topology", "show", str(p)]) == 2
    assert "topo.json' is not JSON" in capsys.readouterr().err
    ex = tmp_path / "p.exprog"
    ex.write_text("IN: A @ 0; B @ 1\nOUT: A+B @ 0, 1\nA @ 0 -> 1; B @ 1 -> 0\nA+B @ 0, 1\n")
    assert main(["exprog", "simulate", str(ex), "--topology", "dgx-h100", "--trace",
                 str(tmp_path / "no-dir" / "t.json")]) == 2
    assert "cannot write trace" in capsys.readouterr().err


REPLICATED = "GPUS: 0, 1, 2, 3\nIN: A @ 0; A @ 1; B @ 2\nOUT: A+B @ 1, 3\n"


def test_the_three_commands_agree_on_a_replicated_atom(tmp_path, capsys):
    """Definition 5.5: the initial state is the set {({A}, s) : A @ s in IN}; one atom at two
    sites is two copies of one value. check and simulate accept the program below, and
    synthesize writes a body for it, which check and simulate accept in turn."""
    pre = tmp_path / "pre.exprog"
    pre.write_text(REPLICATED)
    body = tmp_path / "body.exprog"
    body.write_text(REPLICATED + "B @ 2 -> 1; A @ 0 -> 3; B @ 2 -> 3\nA+B @ 1, 3\n")
    assert main(["exprog", "check", str(body)]) == 0
    assert main(["exprog", "simulate", str(body), "--topology", "dgx-h100"]) == 0
    capsys.readouterr()
    assert main(["exprog", "synthesize", str(pre), "--topology", "dgx-h100"]) == 0
    out = capsys.readouterr().out
    syn = exprog.parse(out)
    assert [(a.name, a.site) for a in syn.inputs] == [("A", 0), ("A", 1), ("B", 2)]
    exprog.check(syn)                                  # valid under the full preamble
    # the copy of A already at site 1 is used: nothing sends A to 1
    assert not any(a.agg == frozenset("A") and any(1 in hop for hop in a.hops)
                   for a in syn.actions)
    (tmp_path / "syn.exprog").write_text(out)
    assert main(["exprog", "simulate", str(tmp_path / "syn.exprog"), "--topology",
                 "dgx-h100"]) == 0


@pytest.mark.parametrize("text", [
    # B is already at 0: a reduced preamble keeping only B @ 1 sent it there (2.909 ms
    # claimed, 2.222 simulated), slower than the full preamble's naive program (1.353 ms)
    "GPUS: 0, 1\nIN: A @ 0 (size: 0.3 GB); B @ 1; B @ 0\nOUT: B @ 0, 1; A+B @ 0, 1\n",
    REPLICATED,
    "GPUS: 0, 1, 2, 3\nIN: A @ 0; A @ 2; B @ 1; B @ 3; C @ 0\nOUT: A+B+C @ 0, 1, 2, 3\n",
])
def test_replicated_synthesis_is_timed_under_the_full_preamble(text):
    """What synthesize reports is the simulated time of the program it returns, under the
    full preamble, and never more than that preamble's own naive program."""
    from eins.hardware.simulate import simulate
    from eins.passes.synthesize import naive_program, synthesize_program
    prog = exprog.parse(text)
    r = synthesize_program(prog, "dgx-h100:8", steps=40)
    assert simulate(r.program, "dgx-h100:8", r.membership).total_s == r.total_s
    assert r.naive_s == simulate(naive_program(prog), "dgx-h100:8").total_s
    assert r.total_s <= r.naive_s
    exprog.check(r.program)


def test_same_atom_twice_at_one_site_is_refused_by_all_three(tmp_path, capsys):
    p = tmp_path / "p.exprog"
    p.write_text("IN: A @ 0; A @ 0\nOUT: A @ 1\n")
    for cmd in (["check"], ["simulate", "--topology", "dgx-h100"],
                ["synthesize", "--topology", "dgx-h100"]):
        assert main(["exprog", cmd[0], str(p), *cmd[1:]]) == 2
        assert "atom 'A' is declared twice at site 0" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--help"], ["exprog", "simulate", "--help"],
                                  ["exprog", "synthesize", "--help"], ["topology", "--help"],
                                  ["topology", "show", "--help"]])
def test_help_lists_the_topology_presets(argv, capsys):
    assert main(argv) == 0   # main returns argparse's status (it raised SystemExit)
    out = capsys.readouterr().out
    for name in ("dgx-v100-paper", "dgx-a100", "dgx-h100", "hgx-h200", "dgx-b200",
                 "gb200-nvl72"):
        assert name in out
    if argv == ["--help"]:
        assert "dgx-a100 up to 8 devices, clusters of dgx-a100" in out


def test_a_closed_pipe_exits_quietly():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(eins.__file__)))]
        + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    p = subprocess.Popen([sys.executable, "-m", "eins.cli", "topology", "show", "gb200-nvl72"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    p.stdout.close()  # the reader is gone before the first line is written (like `| head`)
    err = p.stderr.read()
    assert p.wait() == 141 and err == b""
    # and through a shell pipe into head: the first line arrives, nothing on stderr
    r = subprocess.run(f"{sys.executable} -m eins.cli topology show gb200-nvl72 | head -n 1",
                       shell=True, capture_output=True, env=env, check=True)
    assert r.stdout.startswith(b"topology gb200-nvl72: 72 GPUs") and r.stderr == b""


def test_math_sanity_of_the_tolerance_helper():
    # the helper itself must fail on a real error and pass on reordering
    x = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    assert_close(np.sum(x[::-1]), np.sum(x.astype(np.float64)), n=x.size)
    with pytest.raises(AssertionError):
        assert_close(np.sum(x) + 1e-3 * math.fsum(abs(x)), np.sum(x), n=x.size)


def test_tolerance_rule_by_hand():
    """The bound of eins.tolerance, written out: depth x eps(dtype) + 2 n depth x eps of
    the accumulation dtype (float32 for 16-bit floats); integers are exact. A looser bound
    would let every equality test built on it pass wrong results."""
    from eins.tolerance import accumulation, tolerance
    e16, e32, e64, ebf = 2.0 ** -10, 2.0 ** -23, 2.0 ** -52, 2.0 ** -7
    assert tolerance(np.float32, n=1000, depth=2) == 2 * e32 + 2 * 1000 * 2 * e32
    assert tolerance(np.float16) == e16 + 2 * e32
    assert tolerance("bfloat16", n=8) == ebf + 2 * 8 * e32
    assert tolerance(np.float64, n=10) == e64 + 20 * e64
    assert tolerance(np.int32, n=100, depth=3) == 0.0 == tolerance(np.bool_)
    S = eins.ShapeDtype
    f32 = "float32"
    # a matmul accumulates its contracted 16, the rms_norm its 32-element rows: 2 steps
    prog = eins.make_ir(lambda x, w, g: eins.rms_norm(x @ w, g))(
        S((4, 16), f32), S((16, 32), f32), S((32,), f32))
    assert accumulation(prog) == (32, 2)
    # attention chains three accumulations over its 32 keys, then a matmul over D = 4
    prog = eins.make_ir(lambda q, k, v: eins.attention(q, k, v) @ np.ones((4, 4), np.float32))(
        S((2, 32, 4), f32), S((2, 32, 4), f32), S((2, 32, 4), f32))
    assert accumulation(prog) == (32, 4)
    assert accumulation(eins.make_ir(lambda x: x + 1.0)(S((4, 16), f32))) == (1, 1)
