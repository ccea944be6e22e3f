"""The device session (benchmarks/device_session.sh) and its harness
(benchmarks/device_harness.py), tested on the CPU: a later session with ONE H200 for 15
minutes runs the script once, so it must finish within its budgets, keep results when a case
hangs, and say plainly when the machine lacks what it needs."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "device_session.sh")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import gpu_check  # noqa: E402
import gpu_packed  # noqa: E402
from device_harness import Budget, Results, run_cases, table  # noqa: E402


def test_dry_run_runs_every_step_within_budgets_and_writes_the_files(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    env = dict(os.environ, OUT=str(tmp_path), EINS_PYTHON=sys.executable,
               DRY_BUDGET_S="100", DRY_MAX_CASES="1", DRY_KERNELS_BUDGET_S="0",
               SESSION_BUDGET_S="200")
    p = subprocess.run(["bash", SCRIPT, "--dry-run"], env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    files = sorted(os.listdir(tmp_path))
    assert files == ["calibrate_rows.json", "env.txt", "gpu_check.json", "gpu_kernels.json",
                     "gpu_tune.json", "session.log", "summary.txt"]
    assert len(files) <= 8   # what the device tool brings back
    gc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert gc["finished"] and gc["backend"] == "interpret" and gc["running"] is None
    ran = [r for r in gc["rows"] if "ok" in r]
    assert ran and all(r["ok"] for r in ran)
    assert {r["section"] for r in ran} == {"inputs", "correctness", "speed", "train",
                                           "packed", "anchors"}
    (inp,) = [r for r in ran if r["section"] == "inputs"]   # the CPU's part of it
    assert inp["numpy"]["ok"] and inp["torch"]["zero_copy"] and inp["placed"]["ok"]
    assert gc["summary"]["inputs_ok"] is True
    # a cap of one case a section cuts both (a time budget would make what runs depend on
    # the machine's load: 0.5 s once let both speed cases start)
    # the packed step has no case cap: its stream, then its 3 batches alone (spread order)
    packed = [f"packed/{k}/float32/1x128/p8" for k in ("stream", "alone")]
    assert [r["case"] for r in ran] == ["inputs/ffn/p2", "ffn/p1/naive/eager",
                                        "block/float32/1x16/p1/graphs",
                                        "train/float32/1x16/p1", packed[0],
                                        packed[1] + "/b0", packed[1] + "/b1",
                                        packed[1] + "/b2",
                                        "compile/float32/1x16/max-autotune-no-cudagraphs"]
    check_packed_rows([r for r in ran if r["section"] == "packed"])
    skipped = [r for r in gc["rows"] if "skipped" in r]
    assert {r["section"]: r["skipped"] for r in skipped} == {
        "correctness": [c for c, _, _ in gpu_check.correctness_cases("interpret", True)][1:],
        "speed": ["block/float32/1x16/p2/graphs"],
        "train": ["train/float32/1x16/p2", "adamw/float32/1x16/p2"]}
    assert all("cap of 1 case" in r["reason"] for r in skipped)
    gk = json.loads((tmp_path / "gpu_kernels.json").read_text())   # its smoke run is
    assert gk[-1]["skipped"][0] == "matmul/float32/tiny"   # tests/test_triton_bench.py's
    tune = json.loads((tmp_path / "gpu_tune.json").read_text())   # likewise
    assert tune[-1]["skipped"][0] == "attention/float16/sdpa"
    summary = (tmp_path / "summary.txt").read_text()
    assert "gpu_check: finished=True" in summary and "correct: " in summary
    assert "gpu_tune: 1 rows" in summary
    assert gc["summary"]["issue36_packed_stream_1x32K_p8"]["state"] == \
        "not run on a GPU (backend interpret: the path only, whole)"
    assert "issue36 GPU target (50 packed batches at 1x32K, p=8, one program, graphs on): " \
        "not run on a GPU (backend interpret: the path only, whole): 3/3 batches equal" in summary
    assert "torch: " in (tmp_path / "env.txt").read_text()
    assert "session done" in (tmp_path / "session.log").read_text()


def check_packed_rows(rows):
    """Issue 36's step on the interpreter: every batch of the stream equal to the torch
    reference (per-document SDPA), the counters flat after batch 1 while each call was
    re-cut, the program really split over the 8 devices, and 3 batches compiled alone, each
    equal to the reference, with a ratio."""
    st, *alone = rows
    assert st["backend"] == "interpret" and st["batches"] == st["equal"] == 3
    assert [b["batch"] for b in st["per_batch"]] == [0, 1, 2]
    assert all(b["ok"] and b["rel_err"] <= 1e-4 for b in st["per_batch"])
    assert st["worst_rel_err"] <= 1e-4 and st["flat"] is True
    first, last = st["counters_after_batch_1"], st["counters_after_last"]
    assert {k: last[k] for k in gpu_packed.FLAT} == {k: first[k] for k in gpu_packed.FLAT}
    assert (last["traces"], last["plans"], last["graph_captures"]) == (1, 1, 1)
    assert last["kernel_compiles"] >= 1 and last["rebalances"] > first["rebalances"]
    assert st["rebalance"] is True and st["capacity_program"] is True
    assert st["attention_splits"] == [{"sequence": 8}]
    docs = [b["docs"] for b in st["per_batch"]]
    assert len(set(docs)) > 1   # the boundaries really changed from batch to batch
    assert [r["batch"] for r in alone] == [0, 1, 2]
    for r in alone:
        assert r["docs"] == docs[r["batch"]] and r["rel_err"] <= 1e-4 and r["ok"]
        assert r["alone_ms"] > 0 and r["stream_ms"] > 0 and r["stream_ms_from"] == "this case"
        assert r["ratio"] == pytest.approx(r["stream_ms"] / r["alone_ms"], abs=1e-3)


def test_a_machine_without_torch_is_reported_not_run(tmp_path):
    """Every Python the script tries lacks torch: it says which lacks what and exits 3."""
    fake = tmp_path / "bin"
    fake.mkdir()
    for name in ("python3", "python"):
        f = fake / name
        f.write_text("#!/bin/sh\ncat >/dev/null\necho torch triton\n")
        f.chmod(0o755)
    env = dict(os.environ, OUT=str(tmp_path / "out"), PATH=f"{fake}:/usr/bin:/bin")
    env.pop("EINS_PYTHON", None)
    p = subprocess.run(["bash", SCRIPT], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 3, p.stdout + p.stderr
    assert "NO USABLE PYTHON" in p.stdout and "python3 lacks: torch triton" in p.stdout


def test_watchdog_kills_a_hung_case_and_resume_records_it(tmp_path):
    """A case past its watchdog ends the process with the case marked running in the JSON;
    a rerun with resume records it as killed and runs the rest."""
    out = tmp_path / "r.json"
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {os.path.join(ROOT, "benchmarks")!r})
        from device_harness import Budget, Results, run_cases
        res = Results({str(out)!r}, {{"backend": "test"}}, resume="--resume" in sys.argv)
        cases = [("fast", {{}}, lambda: {{"ok": True}}),
                 ("hangs", {{}}, lambda: time.sleep(60) or {{"ok": True}}),
                 ("after", {{}}, lambda: {{"ok": True}})]
        run_cases(res, "s", cases, Budget(100), case_timeout=1)
        res.finish()
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode != 0 and "hangs" not in p.stdout
    assert "Timeout" in p.stderr          # faulthandler dumped the stacks
    doc = json.loads(out.read_text())
    assert not doc["finished"] and doc["running"]["case"] == "hangs"
    assert [r["case"] for r in doc["rows"]] == ["fast"]
    p = subprocess.run([sys.executable, "-c", code, "--resume"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    assert doc["finished"]
    assert [(r["case"], r["ok"]) for r in doc["rows"]] == [("fast", True), ("hangs", False),
                                                           ("after", True)]
    assert doc["rows"][1]["error"].startswith("killed")


def test_budget_lists_what_it_skips_and_errors_are_rows(tmp_path, capsys):
    res = Results(str(tmp_path / "x.json"), {}, as_list=True)
    run_cases(res, "s", [("boom", {}, lambda: 1 / 0)], Budget(100), case_timeout=0)
    run_cases(res, "s", [("late", {}, lambda: {"ok": True})], Budget(0), case_timeout=0)
    rows = json.loads((tmp_path / "x.json").read_text())
    assert rows[0]["case"] == "boom" and rows[0]["ok"] is False
    assert rows[0]["error"].startswith("ZeroDivisionError")
    assert rows[1]["skipped"] == ["late"]
    assert "NOTE: s: 1 case(s) skipped" in capsys.readouterr().out
    assert table([{"a": 1.5, "b": "x"}, {"a": 1e-5}], ["a", "b"]).splitlines() == [
        "a      b", "1.5    x", "1e-05"]


def test_a_case_cap_cuts_by_count_whatever_the_time(tmp_path, capsys):
    """Budget(seconds, max_cases): only the first max_cases cases start, however much time
    is left; the rest are one "skipped" row that names the cap."""
    res = Results(str(tmp_path / "x.json"), {}, as_list=True)
    cases = [(c, {}, lambda: {"ok": True}) for c in ("a", "b", "c")]
    assert run_cases(res, "s", cases, Budget(1e9, max_cases=2), case_timeout=0) == ["c"]
    rows = json.loads((tmp_path / "x.json").read_text())
    assert [r["case"] for r in rows] == ["a", "b", "s:skipped"]
    assert rows[2]["skipped"] == ["c"] and "cap of 2 case(s)" in rows[2]["reason"]
    assert "skipped (the section's cap of 2 case(s) was reached): c" in capsys.readouterr().out
    assert run_cases(Results(None, {}), "s", cases, Budget(1e9, max_cases=0), 0) == [
        "a", "b", "c"]
    with pytest.raises(ValueError, match="max_cases must be None or >= 0, got -1"):
        Budget(1, max_cases=-1)


def test_gpu_check_refuses_a_negative_case_cap(capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--interpret", "--max-cases-per-section", "-2"])
    assert "--max-cases-per-section must be >= 0, got -2" in capsys.readouterr().err


def test_speed_row_without_a_pytorch_reference_still_times_eins(monkeypatch):
    """Where the PyTorch block does not fit (it may not at 128K), eins still runs: the row
    has the reference's error, no ratio, and ok means a finite output."""
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "gpu_check", os.path.join(ROOT, "benchmarks", "gpu_check.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def oom(*a, **k):
        raise RuntimeError("CUDA out of memory (planted)")
    monkeypatch.setattr(mod, "torch_block", oom)
    (cid, desc, thunk), _ = mod.speed_cases("interpret", True, 1)
    row = thunk()
    assert row["torch_error"].startswith("RuntimeError: CUDA out of memory")
    assert row["torch_ms"] is None and row["ratio"] is None and row["ok"] is True
    s = mod.summary([dict(row, section="speed", **desc)])
    assert s["issue8_1x4K_p1_within_1.5x"] is None and s["all_correct"] is False


def test_resume_does_not_retry_cases_skipped_for_time(tmp_path):
    path = str(tmp_path / "y.json")
    run_cases(Results(path, {}), "s", [("late", {}, lambda: {"ok": True})], Budget(0), 0)
    res = Results(path, {}, resume=True)
    ran = []
    run_cases(res, "s", [("late", {}, lambda: ran.append(1) or {"ok": True}),
                         ("new", {}, lambda: {"ok": True})], Budget(100), 0)
    assert not ran and [r.get("case") for r in res.rows] == ["s:skipped", "new"]


def test_an_error_row_carries_a_short_traceback_with_its_chained_cause(tmp_path):
    """A failed CUDA graph capture raises from the capture's end; the error that broke it
    is the chained one, so the row's traceback shows both (the summary keeps one line)."""
    def capture_fails():
        try:
            raise KeyError("the real cause")
        except KeyError:
            raise RuntimeError("operation failed due to a previous error during capture")
    res = Results(str(tmp_path / "x.json"), {})
    run_cases(res, "s", [("boom", {}, capture_fails), ("next", {}, lambda: {"ok": True})],
              Budget(100), case_timeout=0)
    rows = json.loads((tmp_path / "x.json").read_text())["rows"]
    assert rows[0]["error"].startswith("RuntimeError: operation failed")
    tb = rows[0]["traceback"]
    assert "the real cause" in tb and "capture_fails" in tb and len(tb) <= 1503
    assert rows[0]["cuda_context_lost"] is False     # no CUDA here: nothing lost
    assert rows[1] == dict(rows[1], case="next", ok=True)


class _StandInCuda:
    """torch.cuda as the harness sees it, with a fault that surfaces at the next sync and
    then sticks (as an illegal memory access does)."""

    def __init__(self):
        self.broken = False

    def is_initialized(self):
        return True

    def synchronize(self):
        if self.broken:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_case_that_breaks_the_cuda_context_is_charged_and_the_process_ends(
        tmp_path, monkeypatch):
    """The fault of an asynchronous kernel surfaces at the case's closing sync, so it is
    that case's row; the context being lost (every later case would fail the same way),
    the process exits with CONTEXT_LOST after writing the row, and a resumed run (a fresh
    process: device_session.sh) does the rest."""
    import types
    import device_harness
    cuda = _StandInCuda()
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))

    class Exited(Exception):
        pass

    def fake_exit(code):
        raise Exited(code)
    monkeypatch.setattr(os, "_exit", fake_exit)   # device_harness calls os._exit
    out = str(tmp_path / "x.json")
    res = Results(out, {})

    def faults():
        cuda.broken = True   # a launch that will fault; the thunk itself returns
        return {"ok": True}
    cases = [("fine", {}, lambda: {"ok": True}), ("faults", {}, faults),
             ("after", {}, lambda: {"ok": True})]
    with pytest.raises(Exited) as ex:
        run_cases(res, "s", cases, Budget(100), case_timeout=0)
    assert ex.value.args == (device_harness.CONTEXT_LOST,)
    doc = json.loads((tmp_path / "x.json").read_text())
    assert [r["case"] for r in doc["rows"]] == ["fine", "faults"] and doc["running"] is None
    bad = doc["rows"][1]
    assert bad["ok"] is False and "illegal memory access" in bad["error"]
    assert bad["cuda_context_lost"] is True
    cuda.broken = False   # the fresh process
    res = Results(out, {}, resume=True)
    run_cases(res, "s", cases, Budget(100), case_timeout=0)
    assert [(r["case"], r["ok"]) for r in res.rows] == [("fine", True), ("faults", False),
                                                        ("after", True)]


def test_a_session_cut_before_gpu_check_finished_still_reports_its_targets(tmp_path):
    """gpu_check writes its summary only when it finishes; a step cut by its time limit
    left rows but no summary. summary.txt then computes the targets from those rows and
    names the case that was cut."""
    from session_summary import summary_lines
    speed = {"section": "speed", "case": "block/float16/1x4096/p1/graphs", "dtype": "float16",
             "tokens": 4096, "p": 1, "graphs": True, "ratio": 1.05, "ok": True}
    doc = {"backend": "cuda", "finished": False, "rows": [
        {"section": "correctness", "case": "ffn/p1/naive/eager", "ok": True},
        {"section": "correctness", "case": "ffn/p2/naive/graphs", "ok": False,
         "error": "RuntimeError: boom", "traceback": "..."}, speed],
        "running": {"section": "speed", "case": "block/float16/1x131072/p1/graphs"}}
    (tmp_path / "gpu_check.json").write_text(json.dumps(doc))
    (tmp_path / "gpu_kernels.json").write_text(json.dumps(
        [{"kernel": "matmul", "job": "matmul/float16/down", "running": True}]))
    text = "\n".join(summary_lines(str(tmp_path)))
    assert "finished=False" in text and "targets from the rows written" in text
    assert "correct: 1/2" in text and "issue9_1x4K_p1_fp16_within_1.1x: True" in text
    assert "CUT while running: block/float16/1x131072/p1/graphs" in text
    assert "FAILED ffn/p2/naive/graphs: RuntimeError: boom" in text
    assert "CUT while running: matmul/float16/down" in text


def test_the_pytorch_reference_block_runs_sdpa_on_a_fused_backend(monkeypatch):
    """The speed rows' baseline is a PyTorch block on SDPA's fused (flash) kernels. Every
    fused SDPA backend takes 4-D q/k/v only ([B, H, S, D]; torch's sdp_utils
    check_tensor_shapes): the block's [H, S, D] heads went to the S x S math backend,
    which made the baseline slow at 4K and 8K (every ratio flattering) and made it run out
    of memory at 128K. The block must pass 4-D q, k and v (torch's private
    _fused_sdp_choice, asked by hand on the CPU, then picks flash, not math), and the result
    is still the block's."""
    torch = pytest.importorskip("torch")
    import numpy as np
    import torch.nn.functional as F
    from eins.models import llama
    cfg, s = llama.SMALL, 32
    rng = np.random.default_rng(0)
    w = llama.init_weights(cfg, rng)
    x = rng.standard_normal((s, cfg.d_model)).astype(np.float32)
    cos, sin = llama.rope_tables(s, cfg.head_dim, None)
    real, picks = F.scaled_dot_product_attention, []

    def spy(q, k, v, *a, **kw):
        picks.append((q.dim(), k.dim(), v.dim()))
        return real(q, k, v, *a, **kw)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    got = gpu_check.torch_block(torch.from_numpy(x), {k: torch.from_numpy(v) for k, v in
                                                       w.items()},
                                torch.from_numpy(cos), torch.from_numpy(sin), cfg)
    assert picks and all(p == (4, 4, 4) for p in picks), picks
    want = llama.reference_block(x, w, cos, sin, cfg)
    assert tuple(got.shape) == want.shape
    assert np.abs(got.numpy() - want).max() <= 1e-4 * np.abs(want).max()


def _packed_rows(backend="cuda", equal=50, flat=True, ratios=(1.02, 1.05, 0.99), extra=()):
    """The packed section's rows as a finished step writes them (planted numbers)."""
    counts = {"traces": 1, "plans": 1, "kernel_compiles": 9, "graph_captures": 8,
              "lowerings": 1, "rebalances": 3}
    after = dict(counts, rebalances=150, graph_captures=8 if flat else 9)
    st = {"section": "packed", "case": "packed/stream/bfloat16/1x32768/p8", "batches": 50,
          "equal": equal, "worst_rel_err": 0.01, "flat": flat, "median_ms": 40.0,
          "counters_after_batch_1": counts, "counters_after_last": after,
          "backend": backend, "per_batch": [{"batch": b, "ms": 40.0} for b in range(50)],
          "ok": flat and equal == 50}
    alone = [{"section": "packed", "case": f"packed/alone/bfloat16/1x32768/p8/b{b}",
              "batch": b, "alone_ms": 40.0, "stream_ms": 40.0 * x, "ratio": x, "equal": True,
              "ok": True}
             for b, x in zip((0, 25, 12, 37), ratios)]
    return [st] + alone + list(extra)


def test_issue36_target_is_met_only_on_a_gpu_with_every_part_measured():
    """summary.txt's issue 36 line: met needs the stream on cuda, every batch equal, the
    counters flat, at least 3 batches compiled alone within 1.1x; anything short of it
    says which part failed; no stream row is "not run"; a cut alone case is not a failure."""
    t = gpu_packed.packed_target
    assert t(_packed_rows())["state"] == "met"
    assert t(_packed_rows())["worst_ratio"] == 1.05
    slow = t(_packed_rows(ratios=(1.02, 1.12, 0.99)))
    assert slow["state"] == "not met" and slow["why"] == "worst ratio 1.12 > 1.1"
    assert t(_packed_rows(equal=49))["why"] == "1 batch(es) differ from the reference"
    grew = t(_packed_rows(flat=False))
    assert grew["state"] == "not met" and grew["why"].startswith("counters grew")
    few = t(_packed_rows(ratios=(1.0, 1.0)))
    assert few["state"] == "not met" and few["why"] == "2 batch(es) timed alone, 3 needed"
    killed = {"section": "packed", "case": "packed/alone/bfloat16/1x32768/p8/b6",
              "ok": False, "error": "killed: the case ran past its watchdog or the process died"}
    cut = t(_packed_rows(extra=[killed]))
    assert cut["state"] == "met" and cut["alone_cut"] == 1
    broke = dict(killed, error="RuntimeError: CUDA out of memory")
    assert "b6: RuntimeError: CUDA out of memory" in t(_packed_rows(extra=[broke]))["why"]
    # an alone batch whose stream time was not found is untimed, not unequal
    untimed = {"section": "packed", "case": "packed/alone/bfloat16/1x32768/p8/b6",
               "batch": 6, "alone_ms": 40.0, "stream_ms": None, "ratio": None,
               "equal": True, "ok": False}
    assert "differs" not in t(_packed_rows(ratios=(1.0, 1.0), extra=[untimed]))["why"]
    wrong = dict(untimed, stream_ms=40.0, ratio=1.0, equal=False)
    assert "an alone program differs from the reference" in t(_packed_rows(
        extra=[wrong]))["why"]
    cpu = t(_packed_rows(backend="interpret", ratios=(3.0, 2.0, 2.5)))
    assert cpu["state"] == "not run on a GPU (backend interpret: the path only, whole)"
    assert t(_packed_rows(backend="interpret", equal=2))["state"].endswith("broken)")
    none = t([dict(killed, case="packed/stream/bfloat16/1x32768/p8")])
    assert none["state"] == "not run" and none["why"].startswith("killed")
    assert t([])["state"] == "not run"
    line = gpu_packed.target_line(t(_packed_rows(ratios=(1.02, 1.12, 0.99))))
    assert line.startswith("issue36 GPU target (50 packed batches at 1x32K, p=8, one "
                           "program, graphs on): not met: 50/50 batches equal")
    assert "worst ratio x1.12 (target <= 1.1); why: worst ratio 1.12 > 1.1" in line


def test_issue36_reference_rope_is_independent_and_restarts_per_document():
    """The packed step's reference builds its RoPE tables in torch from the ends: equal to
    llama.rope_tables on the padded ends (two implementations), and not to the tables of
    one unbroken sequence (a reference that ignored the ends would pass wrong outputs)."""
    torch = pytest.importorskip("torch")
    from eins.models import llama
    ends, s, dh = (5, 17, 40), 40, 8
    cos, sin = gpu_packed.torch_rope(s, dh, ends, torch.float32, "cpu")
    want = llama.rope_tables(s, dh, llama.padded_ends(ends, 8, s))
    for got, w in zip((cos, sin), want):
        assert got.shape == w.shape and float((got - torch.from_numpy(w)).abs().max()) < 1e-6
    whole = llama.rope_tables(s, dh, None)[1]
    assert float((sin - torch.from_numpy(whole)).abs().max()) > 0.1
    assert gpu_packed.spread(8) == [0, 4, 2, 6, 1, 3, 5, 7]
    assert gpu_packed.spread(50)[:5] == [0, 25, 12, 37, 6]
    assert sorted(gpu_packed.spread(50)) == list(range(50))
