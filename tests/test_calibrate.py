"""Machine profiles and their fit (eins/hardware/profile.py, eins/cost/calibrate.py): the
kernel model priced by a profile, the fit's arithmetic on hand-made rows, profile files
and their errors, logical devices sharing a GPU, and ``eins calibrate``."""
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

import eins
from eins.cli import main as cli
from eins.cost import calibrate as cal
from eins.cost.microbench import graph_replay_seconds
from eins.cost.predict import B_HALF, W_HALF, kernel_seconds
from eins.errors import PlanError, TopologyError
from eins.hardware.presets import get_topology
from eins.hardware.profile import ClassProfile, Profile, load_profile
from helpers import SPREAD, assert_splits

H200_F, H200_BW = 989e12, 4800e9


def _matmul_eqn(m, k, n, dt="float16"):
    prog = eins.make_ir(lambda a, b: a @ b)(eins.ShapeDtype((m, k), dt),
                                            eins.ShapeDtype((k, n), dt))
    e = prog.eqns[0]
    spec = eins.distribute(lambda a, b: a @ b, devices=1).lower(
        eins.ShapeDtype((m, k), dt), eins.ShapeDtype((k, n), dt)).plan.eqn_plans[0].spec
    return e, spec.fspecs[0]


def test_a_profile_prices_a_kernel_by_its_class_curve():
    e, f = _matmul_eqn(1024, 1024, 1024)
    w = 2 * 1024 ** 3
    prof = Profile("t", classes={"matmul": ClassProfile(
        flops=((w / 4, 0.4), (w * 4, 0.8)), overhead_s=2e-6)})
    topo = get_topology("hgx-h200:1", prof)
    # W sits halfway (in log) between the two points: efficiency 0.6
    want = (w + W_HALF) / (H200_F * 0.6) + 2e-6
    assert kernel_seconds(e, f, topo) == pytest.approx(want, rel=1e-12)
    # the data sheet alone: the roofline of before
    bare = get_topology("hgx-h200:1", "none")
    assert bare.profile is None
    assert kernel_seconds(e, f, bare) == pytest.approx((w + W_HALF) / H200_F, rel=1e-12)


def test_curves_are_flat_beyond_their_points_and_views_fold():
    c = ClassProfile(hbm=((1e6, 0.5), (1e8, 0.9)))
    assert (c.hbm_eff(10.0), c.hbm_eff(1e9), c.hbm_eff(1e7)) == (0.5, 0.9, pytest.approx(0.7))
    assert ClassProfile().flops_eff(123.0) == 1.0
    prog = eins.make_ir(lambda x: eins.transpose(x, (1, 0)))(eins.ShapeDtype((64, 32),
                                                                             "float16"))
    low = eins.distribute(lambda x: eins.transpose(x, (1, 0)), devices=1,
                          topology="hgx-h200:1").lower(eins.ShapeDtype((64, 32), "float16"))
    assert prog.eqns[0].primitive.kernel_class == "view"
    assert low.predicted_time()["compute_ms"] == 0.0   # the shipped H200 profile folds views


def test_fit_inverts_the_model_on_hand_made_rows():
    # a compute-bound shape measured twice (median 2 ms), a memory-bound one, a launch
    w, b = 1e12, 1e6
    rows = [{"what": "mm", "class": "matmul", "work": w, "bytes": b, "seconds": s}
            for s in (1.9e-3, 2.0e-3, 2.5e-3)]
    rows.append({"what": "norm", "class": "norm", "work": 1e3, "bytes": 1e9, "seconds": 5e-4})
    rows.append({"what": "launch", "class": "launch", "work": 0.0, "bytes": 0.0,
                 "seconds": 4e-6})
    rows.append({"what": "copy", "class": "local_copy", "work": 0.0, "bytes": 1e9,
                 "seconds": 1e-3 + 4e-6})
    p = cal.fit(rows, flops=H200_F, hbm_bw=H200_BW, name="t")
    mm = p.entry("matmul")
    assert mm.flops == ((w, round((w + W_HALF) / H200_F / (2.0e-3 - 4e-6), 6)),)
    assert mm.overhead_s == 4e-6
    assert p.entry("norm").hbm == ((1e9, round((1e9 + B_HALF) / H200_BW / (5e-4 - 4e-6), 6)),)
    # never measured: the median of the measured classes; views fold
    assert p.entry("gather").note.startswith("not measured")
    assert p.entry("gather").hbm == ((1.0, p.entry("norm").hbm[0][1]),)
    assert p.entry("view").folded
    assert p.copy_hbm == round(2 * 1e9 / H200_BW / 1e-3, 6)
    # priced by the fit, each shape's median comes back
    for r in (rows[1], rows[3]):
        assert cal.predicted_seconds(p, r, H200_F, H200_BW) == pytest.approx(
            r["seconds"], rel=1e-5)


def test_fit_shared_overhead_and_errors():
    base = [{"what": "mm", "class": "matmul", "work": 1e12, "bytes": 1e6, "seconds": 2e-3}]
    shared = [{"what": "blk", "class": "shared", "seconds": s, "model_seconds": 1e-3,
               "kernels": 100} for s in (1.5e-3, 2e-3, 3e-3)]
    p = cal.fit(base + shared, flops=H200_F, hbm_bw=H200_BW, name="t")
    assert p.shared_overhead_s == pytest.approx(1e-5)   # the median (2 - 1) ms / 100
    with pytest.raises(eins.EinsError, match="unknown class 'matmull'"):
        cal.fit([dict(base[0], **{"class": "matmull"})], flops=1, hbm_bw=1, name="t")
    with pytest.raises(eins.EinsError, match="seconds must be a positive number, got 0"):
        cal.fit([dict(base[0], seconds=0)], flops=1, hbm_bw=1, name="t")
    with pytest.raises(eins.EinsError, match="no kernel measurements"):
        cal.fit([], flops=1, hbm_bw=1, name="t")


@pytest.mark.parametrize("doc,msg", [
    ({"classes": {"matmul": {"flops": [[1, 1.2]]}}}, "efficiency 1.2 above 1"),
    ({"classes": {"matmul": {"flops": [[2, 0.5], [1, 0.6]]}}}, "sizes must increase"),
    ({"classes": {"matmull": {}}}, "unknown kernel class 'matmull'"),
    ({"classes": {"matmul": {"flop": []}}}, r"unknown keys \['flop'\]"),
    ({"bogus": 1}, r"unknown keys \['bogus'\]"),
    ({"copy": {"hbm": -1}}, "copy.hbm must be a positive, finite number, got -1"),
    ({"classes": {"matmul": {"flops": [[1, "x"]]}}}, "an efficiency of classes.matmul.flops"),
])
def test_bad_profiles_name_the_value(doc, msg):
    with pytest.raises(TopologyError, match=msg):
        Profile.from_dict(doc, name="p")


def test_profiles_round_trip_and_load_by_name_or_file(tmp_path):
    h200 = load_profile("h200")
    assert h200.calibrated and h200.gpu_model == "H200"
    path = tmp_path / "p.json"
    h200.to_json(path)
    assert Profile.from_json(path).to_dict() == h200.to_dict()
    assert get_topology("dgx-h100:2", str(path)).profile.to_dict() == h200.to_dict()
    assert get_topology("hgx-h200:2").profile is h200   # the preset ships it
    assert get_topology("dgx-h100:2").profile is None   # uncalibrated: the data sheet
    with pytest.raises(TopologyError, match="unknown profile 'h300'"):
        load_profile("h300")
    with pytest.raises(TopologyError, match="cannot read profile"):
        load_profile(str(tmp_path / "missing.json"))
    with pytest.raises(PlanError, match="profile must be a profile name, a JSON file path"):
        eins.distribute(lambda x: x, devices=1, profile=3.5)


def test_published_profiles_cite_their_sources():
    for name in ("h100-published", "a100-published"):
        p = load_profile(name)
        assert not p.calibrated and "http" in p.source
        assert 0.5 < p.entry("matmul").flops_eff(1e12) < 1


def test_logical_devices_share_one_gpu():
    topo = get_topology("hgx-h200:8/1")
    h200 = topo.profile
    assert topo.gpus == tuple(range(8)) and set(topo.physical) == {0}
    assert topo.memory == pytest.approx(141e9 / 8)
    assert topo.route(0, 5) == ("copy:0",)
    assert topo.capacity["copy:0"] == pytest.approx(4800e9 * h200.copy_hbm / 2)
    # 8 kernels on one GPU add up, each with the shared-GPU overhead; a folded view is free
    got = topo.busy_seconds([1e-3] * 7 + [0.0], range(8))
    assert got == pytest.approx(7e-3 + 7 * h200.shared_overhead_s)
    two = get_topology("hgx-h200:4/2")   # devices 0, 2 on GPU 0; 1, 3 on GPU 1
    assert two.physical == (0, 1, 0, 1) and two.route(0, 1) == ("egress:0", "ingress:1")
    # GPU 0: 1 + 1 ms and two overheads; GPU 1: 3 ms and one (its other device's view is free)
    assert two.busy_seconds([1e-3, 3e-3, 1e-3, 0.0], range(4)) == pytest.approx(
        3e-3 + h200.shared_overhead_s)
    for bad in ("hgx-h200:8/0", "hgx-h200:2/4", "hgx-h200:8/9"):
        with pytest.raises(TopologyError, match="places N logical devices on G GPUs"):
            get_topology(bad)
    with pytest.raises(TopologyError, match="no JSON form"):
        topo.to_dict()


def test_the_dp_and_the_prediction_agree_on_a_shared_gpu():
    x = eins.ShapeDtype((2048, 1024), "float16")
    w = eins.ShapeDtype((1024, 4096), "float16")
    low = eins.distribute(lambda a, b: eins.relu(a @ b), devices=4,
                          topology="hgx-h200:4/1", tuning=SPREAD).lower(x, w)
    assert_splits(low)   # all four share the GPU
    assert low.plan.cost_s * 1e3 == pytest.approx(low.predicted_time()["total_ms"], rel=1e-9)
    one = eins.distribute(lambda a, b: eins.relu(a @ b), devices=1,
                          topology="hgx-h200:1").lower(x, w)
    # sharing one GPU four ways is never predicted faster than the GPU alone
    assert low.predicted_time()["total_ms"] > one.predicted_time()["total_ms"]


def test_eins_calibrate_fits_measurement_folders(tmp_path, capsys):
    out = tmp_path / "h200.json"
    rc = cli(["calibrate", "--from", "benchmarks/results/h200-2026-12-04-b", "--out",
              str(out), "--rows", str(tmp_path / "rows.json")])
    text = capsys.readouterr().out
    assert rc == 0 and "# matmul      matmul q/o proj 4096x4096x4096" in text
    prof = Profile.from_json(out)
    # one run: q/o proj fp16 and bf16 graph-replayed through eins's cuBLAS path
    want = (2 * 4096 ** 3 + W_HALF) / H200_F / (np.median([0.1941, 0.1759]) / 1e3)
    assert prof.entry("matmul").flops[1] == (2 * 4096 ** 3, round(want, 6))
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert len(rows) == 20 and {r["class"] for r in rows} == {
        "matmul", "attention", "norm", "rope", "elementwise"}
    # refitting the written rows gives the same profile
    (tmp_path / "again").mkdir()
    (tmp_path / "again" / "calibrate_rows.json").write_text(
        (tmp_path / "rows.json").read_text())
    rc = cli(["calibrate", "--from", str(tmp_path / "again"), "--gpu", "H200", "--out",
              str(tmp_path / "again.json")])
    assert rc == 0
    again = Profile.from_json(tmp_path / "again.json")
    assert again.classes["matmul"] == prof.classes["matmul"]


def test_eins_calibrate_without_a_gpu_says_so(tmp_path, capsys):
    rc = cli(["calibrate", "--out", str(tmp_path / "p.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "measures on a GPU" in err and "--from DIR" in err
    rc = cli(["calibrate", "--from", str(tmp_path)])
    assert rc == 2 and "pass --gpu" in capsys.readouterr().err


def test_microbench_rows_smoke_on_the_interpreter():
    pytest.importorskip("triton")
    from eins.cost import microbench
    topo = get_topology("hgx-h200:1", "none")
    rows, table = microbench.run(topo, device="cpu", reps=1, dtypes=("float16",))
    assert {r["class"] for r in rows} >= {"matmul", "attention", "norm", "rope",
                                           "elementwise", "launch", "local_copy"}
    assert all(r["seconds"] > 0 and math.isfinite(r["work"]) for r in rows)
    assert "triton" in table
    assert cal.fit(rows, flops=topo.flops, hbm_bw=topo.hbm_bw, name="cpu").calibrated


def test_the_shared_gpu_measurement_runs_and_counts_its_kernels():
    pytest.importorskip("triton")
    from eins.commands import SHARED_P, shared_rows
    topo = get_topology("hgx-h200:1", "none")
    prof = Profile("k", classes={"matmul": ClassProfile(flops=((1e9, 0.5),))})
    (row,) = shared_rows(topo, prof, backend="interpret", tokens=32, d=16, f=24, reps=1,
                         dtype="float32")
    assert row["class"] == "shared" and row["seconds"] > 0 and row["model_seconds"] > 0
    # matmul, silu, matmul: each split SHARED_P ways on the one GPU
    assert row["kernels"] == 3 * SHARED_P
    p = cal.fit([{"what": "mm", "class": "matmul", "work": 1e12, "bytes": 1e6,
                  "seconds": 2e-3}, row], flops=H200_F, hbm_bw=H200_BW, name="t")
    # the fit keeps whole nanoseconds (round(.., 9)): equal to that rounding
    assert p.shared_overhead_s == round(
        max(0.0, (row["seconds"] - row["model_seconds"]) / row["kernels"]), 9)


class _FakeCuda:
    """Just enough of torch.cuda for graph_replay_seconds: events whose elapsed times (ms)
    come from a list, a graph that counts replays, streams that are context managers."""
    def __init__(self, elapsed_ms):
        self.elapsed, self.replays, self.captured = list(elapsed_ms), 0, False
        cuda = self

        class Stream:
            def wait_stream(self, other):
                pass

        class Event:
            def __init__(self, enable_timing):
                assert enable_timing

            def record(self):
                pass

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                return cuda.elapsed.pop(0)

        class CUDAGraph:
            def replay(self):
                cuda.replays += 1

        class _Ctx:
            def __init__(self, *a, **k):
                pass

            def __enter__(self):
                cuda.captured = isinstance(self, cuda.graph)

            def __exit__(self, *exc):
                cuda.captured = False

        self.Stream, self.Event, self.CUDAGraph = Stream, Event, CUDAGraph
        self.stream = type("stream", (_Ctx,), {})
        self.graph = type("graph", (_Ctx,), {})
        self.current_stream = Stream
        self.synchronize = lambda: None


def test_graph_replay_seconds_is_the_median_replay_over_its_calls():
    cuda = _FakeCuda([4.0, 9.0, 5.0, 6.0, 5.5])   # ms per replay of 10 captured calls
    calls = []
    fn = lambda: calls.append(cuda.captured)   # noqa: E731
    s = graph_replay_seconds(SimpleNamespace(cuda=cuda), fn, reps=5, calls=10)
    assert s == pytest.approx(5.5e-3 / 10)        # the median 5.5 ms, per call, in seconds
    assert calls == [False] * 2 + [True] * 10      # two warm-up calls, ten in the capture
    assert cuda.replays == 1 + 5                   # one warm replay, then the timed ones
