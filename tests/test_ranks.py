"""The rank runtime (issue 13) on CPU with gloo, on 127.0.0.1: torchrun with 2 and 4 ranks
runs the LLaMA tiny block with packed segments and a matmul chain equal to eins.jit, each
rank sending exactly the plan's bytes, and a packed stream whose segment ends are data
(issue 36), each batch re-cut on every rank, forward and training (value_and_grad, an SGD
loop with its weights on the ranks); ranks started by hand show that a rank that exits or
never sends is named within timeout_s. Launches are few and concurrent (each process pays
seconds to import torch); tests/ranks_script.py holds the checks they run."""
import json
import os
import socket
import subprocess
import sys

import pytest

import eins
from eins.errors import DistributedError, PlanError

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "ranks_script.py")
ROOT = os.path.dirname(HERE)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**kw):
    e = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             OMP_NUM_THREADS="1", **{k: str(v) for k, v in kw.items()})
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        if k not in kw:
            e.pop(k, None)
    return e


def results(out, n):
    got = {}
    for r in range(n):
        path = os.path.join(out, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                got[r] = json.load(f)
    return got


def wait_all(procs, limit=90):
    logs = []
    for p in procs:
        try:
            o, _ = p.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            p.kill()
            o, _ = p.communicate()
        logs.append(o.decode(errors="replace")[-3000:])
    return logs


def launch_torchrun(tmp_path):
    """torchrun --nproc-per-node=2 and =4, concurrently; -> {n: {rank: result}}."""
    runs = {}
    for n in (2, 4):
        out = tmp_path / f"torchrun{n}"
        out.mkdir()
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", SCRIPT, str(out), "ok"]
        runs[n] = (out, subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT))
    logs = wait_all([p for _, p in runs.values()])
    got = {}
    for (n, (out, p)), log in zip(runs.items(), logs):
        assert p.returncode == 0, log
        got[n] = results(out, n)
        assert sorted(got[n]) == list(range(n)), log
    return got


# One test per launch: pytest-xdist would otherwise launch a module fixture once per worker.
def test_torchrun_2_and_4_ranks(tmp_path):
    for n, ranks in launch_torchrun(tmp_path).items():
        for case in ("llama", "chain", "optimized", "kvsplit"):
            for r, res in ranks.items():
                c = res[case]
                assert c["world"] == n and c["rank"] == r
                # the LLaMA tiny block with packed segments and chain B equal eins.jit
                assert c["close"] == "ok", (n, r, case, c)
                # the bytes this rank sent over gloo: its Send instructions' blocks, and what
                # the numpy executor moves from this device for the same program
                assert c["sent"] == c["planned"] == c["numpy"], (n, r, case, c)
                assert c["compiles"] == 0   # the numpy kernel set builds no Triton kernel
                # a batch may hold receives only, so a rank can post more batches than it
                # sends (it does under the time cost's plans)
                assert c["batches"] >= 1
            total = sum(sum(res[case]["sent"].values()) for res in ranks.values())
            assert total == ranks[0][case]["plan_total"] > 0
        cells = 0
        for r, res in ranks.items():
            # weights through load(input_index, box): exactly the blocks the plan loads here
            assert res["load"]["close"] == "ok", res["load"]
            assert res["load"]["calls_match_plan"] and res["load"]["calls"] > 0
            # gather=False: this rank's blocks only, each exactly its part of the gathered
            # result of the same plan (the load callback's call above)
            assert res["local"]["exact"]
            for lo, hi in res["local"]["boxes"]:
                cells += (hi[0] - lo[0]) * (hi[1] - lo[1])
            # ranks that plan differently are named, every one of them, in groups
            msg = res["mismatch"]
            assert msg and msg.startswith("DistributedError") and "planned" in msg, msg
            assert all(f"{q}" in msg.split("differently")[1] for q in range(n)), msg
            msg = res["gather_mismatch"]
            assert msg and "gather=True" in msg and "gather=False" in msg, msg
            msg = res["dtype_mismatch"]
            assert msg and msg.startswith("DistributedError") and "planned" in msg, msg
        assert cells == 16 * 16  # the block's output [16 tokens, d_model 16], each cell once
        for r, res in ranks.items():
            # checked on every call: ranks that switched signatures after both were checked
            msg = res["later_mismatch"]
            assert msg and msg.startswith("DistributedError") and "planned" in msg, msg
            # a closed-over constant that differs per rank is part of the plan
            msg = res["const_mismatch"]
            assert msg and msg.startswith("DistributedError") and "planned" in msg, msg
            assert res["torch_args"]
            assert res["torch_load"]
            assert res["zero_size"] == [0, 8]
        check_packed_stream(n, ranks)


def check_packed_stream(n, ranks):
    """A packed stream with the segment ends as an int array (issue 36): every batch equals
    eins.jit on its own ends; no rank traced or planned again; each rank re-cut every batch
    and lowered its own program once per new cut (a repeated cut is kept); and its gloo bytes
    per peer are the per-cut program's, not the compile-time cuts'."""
    for r, res in ranks.items():
        check_packed_batches(n, r, res["packed"])
        ref = res["packed_refusals"]
        # ranks handed different batches would run different cuts: named, not a hang
        msg = ref["ends_mismatch"]
        assert msg.startswith("DistributedError") and "ends=" in msg, msg
        assert all(f"{q}" in msg.split("differently")[1] for q in range(n)), msg
        msg = ref["ends_kept"]   # a Sharded kept on the ranks: named, every rank refuses
        assert msg.startswith("TraceError") and "argument 4" in msg \
            and "every rank holds" in msg and "Sharded" in msg, msg
        msg = ref["ends_loaded"]
        assert msg.startswith("TraceError") and "argument 4" in msg \
            and "segment ends" in msg and "ShapeDtype" in msg, msg
        # rebalance=False: the compile-time cuts for every batch, still equal to eins.jit
        assert ref["fixed"] == {"close": "ok", "counts": [0, 1]}, ref
        # packed attention's output kept on the ranks and fed back as the next queries:
        # each batch re-cut, equal to eins.jit chained on the host, its queries read from
        # the ranks in the re-cut program's blocks (the host's only at the first call)
        res_ = res["packed_resident"]
        assert [b["close"] for b in res_] == ["ok"] * 3, (r, res_)
        assert all(b["sharded"] == "Sharded" for b in res_), res_
        assert res_[0]["host_q"] == res_[0]["loaded"] > 0 and res_[0]["found"] == 0, res_
        assert all(b["host_q"] == 0 and b["found"] == b["loaded"] for b in res_[1:]), res_
        assert [b["rebalances"] for b in res_] == [1, 2, 3], res_
        # the optimized schedule: each new cut synthesized whole for this rank (no naive
        # first lowering to re-lower from), its bytes still the per-cut program's
        check_packed_batches(n, r, res["packed_optimized"], first=0)
        check_block_resident(r, res["packed_block_resident"])
    # gather=False and load=: each rank's blocks and loads are those of the batch's cut
    rows = []
    for r, res in ranks.items():
        for k, b in enumerate(res["packed_local_load"]):
            (lo, hi, ok), = b["blocks"]   # one query block per rank, its part of eins.jit
            assert ok == "ok" and b["loaded"] == "ok", (r, b)
            assert b["asked"] == [[0, lo, hi]], (r, b)   # its queries: its rows, loaded once
            rows.append((k, lo[1], hi[1]))
    for k in range(3):   # the ranks' rows tile the sequence, at this batch's cuts
        got = sorted((lo, hi) for j, lo, hi in rows if j == k)
        assert got[0][0] == 0 and got[-1][1] == 32, got
        assert [a for a, _ in got[1:]] == [b for _, b in got[:-1]], got
    assert len({tuple(lo for j, lo, _ in sorted(rows) if j == k) for k in range(3)}) > 1
    # the cuts moved the queries between ranks on some batch (the re-layout ran)
    assert sum(b["moved"] for res in ranks.values() for b in res["packed_resident"]) > 0
    totals = [sum(sum(res["packed"][k]["sent"].values()) for res in ranks.values())
              for k in range(len(res["packed"]))]
    assert len(set(totals)) > 1, totals   # the bytes follow each batch's cut


def check_block_resident(r, blk):
    """Rank ``r``'s record of the packed block's output kept on the ranks and donated as
    the next batch's input (tests/ranks_script.py's packed_block_resident)."""
    assert [b["close"] for b in blk] == ["ok"] * len(blk), (r, blk)
    assert all(b["sharded"] == "Sharded" for b in blk), blk
    assert blk[0]["host_x"] > 0 and all(b["host_x"] == 0 for b in blk[1:]), blk
    assert [b["released"] for b in blk] == [None] + [True] * (len(blk) - 1), blk
    assert [b["counts"][:3] for b in blk] == [[1, 1, k] for k in range(1, 6)], blk


def check_packed_batches(n, r, batches, first=1):
    """Rank ``r``'s record of tests/ranks_script.py's packed stream (``first``: the family's
    first lowerings it counts, none under the optimized schedule)."""
    for k, b in enumerate(batches, 1):
        assert b["close"] == "ok", (n, r, k, b)
        assert b["sent"] == b["planned"] == b["numpy"], (n, r, k, b)
        # traces, plans, rebalances, lowerings: the signature's rank program, the family's
        # first lowering of this rank, one per distinct cut
        assert b["counts"] == [1, 1, k, 1 + first + b["distinct_cuts"]], (n, r, k, b)
        assert b["ms"] > 0
        # no kernel built for a new batch's ends
        assert b["compiles"] == batches[0]["compiles"], (n, r, k, b)
    assert [b["distinct_cuts"] for b in batches] == [1, 2, 3, 3, 4]
    assert all(b["moved"] for b in batches)   # cut for each batch, not at equal tokens


def test_torchrun_2_ranks_on_the_gpu_runtimes_kernels(tmp_path):
    """backend="interpret": each rank runs the GPU runtime's kernel set (Triton elementwise
    and ⊕ kernels under Triton's interpreter, the GPU launchers / torch lowerings) on CPU
    tensors, transfers over gloo; the LLaMA tiny block and chain B equal eins.jit, and a
    packed stream re-cut per batch (as the 2 and 4 rank test checks on numpy kernels), also
    as a donated resident loop."""
    out = tmp_path / "interpret"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", SCRIPT, str(out),
           "interpret"]
    p = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    log = wait_all([p])[0]
    assert p.returncode == 0, log
    ranks = results(out, 2)
    assert sorted(ranks) == [0, 1], log
    aggs = 0
    for case in ("llama", "chain", "agg", "kvsplit"):
        for r, res in ranks.items():
            c = res[case]
            assert c["kernel_set"] == "interpret" and c["world"] == 2 and c["rank"] == r
            assert c["close"] == "ok", (r, case, c)
            assert c["sent"] == c["planned"] == c["numpy"], (r, case, c)
            # every Kernel and Agg instruction of this rank went through the torch kernels
            assert c["launches"] == c["kernels"] + c["aggs"] > 0, c
            aggs += c["aggs"]
        total = sum(sum(res[case]["sent"].values()) for res in ranks.values())
        assert total == ranks[0][case]["plan_total"] > 0
    assert aggs > 0  # the Triton ⊕ kernel ran too
    # the Triton kernels this process built, counted by the first call that built them
    assert all(res["llama"]["compiles"] > 0 for res in ranks.values()), ranks
    for r, res in ranks.items():
        # the key-split partial of each rank ran the Triton kernel (pairs), not a torch
        # fallback; the lse ⊕ of the two partials is among the aggs counted above
        assert res["kvsplit"]["triton_partials"] == res["kvsplit"]["kernels"] == 1, res
    assert sum(res["kvsplit"]["aggs"] for res in ranks.values()) > 0
    for r, res in ranks.items():   # a packed stream re-cut per batch on these kernels
        check_packed_batches(2, r, res["packed"])
        check_block_resident(r, res["packed_block_resident"])


def test_torchrun_packed_training(tmp_path):
    """Packed training on the ranks (issue 36): eins.value_and_grad of the packed TINY block's
    loss, attention_fwd and attention_bwd forced to a query split over every rank, on 2 and 4
    ranks (numpy kernels) and 2 (the GPU runtime's kernels, the Triton backward under the
    interpreter), concurrently; tests/ranks_script.py's packed-grad mode."""
    runs = {}
    for n, backend in ((2, None), (4, None), (2, "interpret")):
        out = tmp_path / f"grad{n}{backend or ''}"
        out.mkdir()
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", SCRIPT, str(out),
               "packed-grad"] + ([backend] if backend else [])
        runs[(n, backend)] = (out, subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE,
                                                    stderr=subprocess.STDOUT))
    logs = wait_all([p for _, p in runs.values()], limit=240)
    for ((n, backend), (out, p)), log in zip(runs.items(), logs):
        assert p.returncode == 0, log
        ranks = results(out, n)
        assert sorted(ranks) == list(range(n)), log
        check_packed_training(n, backend, ranks)


def check_packed_training(n, backend, ranks):
    """One launch's records: every batch's gathered loss and gradients equal eins.jit's on
    its static ends on every rank; one trace and one plan, a re-cut per batch, a lowering per
    new cut only; the attention cuts moved with the documents (alike on every rank, the
    forward's and the backward's the same); each rank's gloo bytes per peer are the per-cut
    program's; and the SGD loop on the ranks equals the host's."""
    cuts = []
    for r, res in ranks.items():
        *stream, refused = res["stream"]
        msg = refused["ends_mismatch"]   # rank 1 handed other ends than its peers
        assert msg.startswith("DistributedError") and "ends=" in msg, msg
        assert all(f"{q}" in msg.split("differently")[1] for q in range(n)), msg
        for k, b in enumerate(stream, 1):
            assert b["close"] == "ok", (n, backend, r, k, b)
            # traces, plans, rebalances, lowerings: the signature's, the family's first,
            # one per distinct cut (the fourth batch repeats the first's)
            assert b["counts"] == [1, 1, k, 2 + b["distinct_cuts"]], (n, backend, r, k, b)
            assert b["splits"] == {i: {"sequence": n} for i in b["splits"]}, b
            assert len(b["cuts"]) == 2 and len({str(c) for c in b["cuts"].values()}) == 1, b
            assert b["sent"] == b["planned"] == b["numpy"], (n, backend, r, k, b)
            assert b["compiles"] == stream[0]["compiles"] and b["ms"] > 0, b
        # three batches, three cuts (their boxes: at 2 ranks the second's and the third's
        # query rows agree, not the keys their blocks see); the fourth repeats the first's
        assert [b["distinct_cuts"] for b in stream] == [1, 2, 3, 3], stream
        # the first batch's cut is not the compile-time equal one; later batches move it
        first = stream[0]
        assert first["cuts"] != first["compile_time"], first
        cuts.append([b["cuts"] for b in stream])
        assert len({str(c) for c in cuts[-1]}) == (3 if n == 4 else 2), cuts[-1]
        assert stream[0]["cuts"] == stream[3]["cuts"]
        if backend == "interpret":   # the Triton backward ran on every rank
            assert res["triton_bwd"] > 0, res
        else:
            assert res["triton_bwd"] == 0 and stream[0]["compiles"] == 0, res
        sgd = res["sgd"]
        # the loop on the ranks equals the host's; its weights stay there, each donated
        assert [s["close"] for s in sgd] == ["ok"] * 4, (n, backend, r, sgd)
        assert all(s["sharded"] == ["Sharded"] for s in sgd), sgd
        assert [s["released"] for s in sgd] == [["None"]] + [["True"]] * 3, sgd
        assert sgd[0]["host_w"] > 0 and all(s["host_w"] == 0 for s in sgd[1:]), sgd
        assert [s["counts"] for s in sgd] == [[1, 1, k] for k in range(1, 5)], sgd
    assert all(c == cuts[0] for c in cuts), cuts   # every rank re-cut alike
    totals = [sum(sum(res["stream"][k]["sent"].values()) for res in ranks.values())
              for k in range(4)]   # (the fifth record is the refused call)
    assert len(set(totals)) > 1, totals   # the bytes follow each batch's cut


FAILURE_TIMEOUT = 4.0  # tests/ranks_script.py's timeout_s


def test_failures_are_named_within_timeout(tmp_path):
    """Ranks started by hand (RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT), two per
    scenario, all scenarios at once; rank 0's error and how long it waited."""
    runs = {}
    for mode in ("exit-before", "never-sends", "dies", "late-gather"):
        out = tmp_path / mode
        out.mkdir()
        port = free_port()
        runs[mode] = (out, [subprocess.Popen(
            [sys.executable, SCRIPT, str(out), mode], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, env=env(RANK=r, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1",
                                              MASTER_PORT=port)) for r in (0, 1)])
    logs = wait_all([p for _, ps in runs.values() for p in ps])
    got = {}
    for i, (mode, (out, ps)) in enumerate(runs.items()):
        got[mode] = results(out, 2)
        assert 0 in got[mode], logs[2 * i]
        if mode == "late-gather":
            # the gather waits timeout_s (30 s), not the process group's 1.5 s: both ranks
            # finish, rank 0 after rank 1's 3 s
            for r in (0, 1):
                assert got[mode][r]["error"] is None and got[mode][r]["ok"], got[mode]
            assert got[mode][0]["seconds"] >= 2.5, got[mode]
            continue
        assert got[mode][0]["error"].startswith("DistributedError"), got[mode]
        assert got[mode][0]["seconds"] < FAILURE_TIMEOUT + 3, got[mode]
    # rank 1 exited before the call: the plan check names it
    assert "rank(s) [1] did not reach the plan check" in got["exit-before"][0]["error"]
    # rank 1 alive but stuck before its first send: the receive names it and the transfer
    err = got["never-sends"][0]["error"]
    assert "from rank 1 (transfer #" in err and "within 4 s" in err, err
    # rank 1 exits inside the call: its closed connection names it and the transfer
    err = got["dies"][0]["error"]
    assert "from rank 1 (transfer #" in err and "closed the connection" in err, err


# ----------------------------------------------------------------------------- in process
@pytest.mark.parametrize("envs, match", [
    (dict(RANK="2", WORLD_SIZE="2", MASTER_PORT="29500"), r"RANK=2 must be below WORLD_SIZE=2"),
    (dict(RANK="0", WORLD_SIZE="2", MASTER_PORT="abc"), r"MASTER_PORT='abc' is not a "
                                                       r"non-negative integer"),
    (dict(RANK="-1", WORLD_SIZE="2", MASTER_PORT="29500"), r"RANK='-1' is not"),
    (dict(RANK="0", WORLD_SIZE="2", MASTER_PORT="70000"), r"MASTER_PORT=70000 is not a TCP "
                                                         r"port"),
])
def test_world_names_a_torchrun_environment_it_cannot_join(monkeypatch, envs, match):
    # these were reported as a rendezvous that timed out ("a rank exited or never started?")
    import torch.distributed as dist
    assert not dist.is_initialized()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    for k, v in envs.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(DistributedError, match=match):
        eins.distribute(lambda x: x, devices="world", timeout_s=2)


def test_world_without_a_process_group_or_torchrun_env_names_what_is_missing(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    import torch.distributed as dist
    assert not dist.is_initialized()
    with pytest.raises(DistributedError, match="lacks RANK, WORLD_SIZE, MASTER_ADDR, "
                                               "MASTER_PORT"):
        eins.distribute(lambda x: x, devices="world")


def test_a_group_eins_joined_is_destroyed_at_exit(tmp_path):
    """A one-rank world from torchrun's environment: eins joins it, and at exit it destroys
    the group it created (left to teardown, gloo's threads once aborted a finished rank)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = (
        "import atexit, numpy as np, eins, torch.distributed as dist\n"
        "f = eins.distribute(lambda x: x + 1, devices='world', timeout_s=30)\n"
        "print('sum', float(f(np.ones(4, np.float32)).sum()), dist.is_initialized())\n"
        "atexit._run_exitfuncs()\n"
        "print('after exit', dist.is_initialized())\n")
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "sum 8.0 True" in p.stdout and "after exit False" in p.stdout, p.stdout


@pytest.mark.parametrize("kw, match", [
    (dict(devices=2, timeout_s=5), "apply to devices='world'"),
    (dict(devices=2, load=lambda k, b: None), "apply to devices='world'"),
    (dict(devices=2, gather=False), "apply to devices='world'"),
    (dict(devices="world", timeout_s=0), "timeout_s must be a positive number"),
    (dict(devices="world", timeout_s="5"), "timeout_s must be a positive number"),
    # inf and 1e20 reached torch.distributed and were reported as a rank that did not join
    (dict(devices="world", timeout_s=float("inf")), r"timeout_s must be a positive number of "
                                                    r"seconds, at most 2,592,000 \(30 days\), "
                                                    r"got inf"),
    (dict(devices="world", timeout_s=1e20), "at most 2,592,000 .* got 1e"),
    (dict(devices="world", load=3), "load must be a function"),
    (dict(devices="world", gather="yes"), "gather must be True or False"),
    (dict(devices="galaxy"), "devices must be a device count"),
    # a rank re-cuts the DP's plan per batch; a per-call family choice is not there
    (dict(devices="world", families=True), "families=True is not available with "
                                           "devices='world'"),
    (dict(devices="world", families="block"), "families='block' is not available with "
                                              "devices='world'"),
    (dict(devices="world", rebalance="yes"), "rebalance must be True or False, got 'yes'"),
])
def test_world_options_are_checked(kw, match):
    with pytest.raises(PlanError, match=match):
        eins.distribute(lambda x: x, **kw)


def test_gather_takes_numpys_bools():
    import numpy as np
    from eins.errors import DistributedError
    eins.distribute(lambda x: x, devices=2, gather=np.True_)   # the default, as a numpy bool
    with pytest.raises(PlanError, match="apply to devices='world'"):
        eins.distribute(lambda x: x, devices=2, gather=np.False_)
    # accepted: what fails next is the missing process group, not the option
    with pytest.raises(DistributedError, match="no torch.distributed process group"):
        eins.distribute(lambda x: x, devices="world", gather=np.False_)


def test_plan_hash_tells_plans_apart():
    import numpy as np
    from eins.runtime.ranks import plan_hash, planned_sends
    x, w = np.ones((8, 4), np.float32), np.ones((4, 8), np.float32)
    f = lambda x, w: x @ w  # noqa: E731
    a = eins.distribute(f, devices=2).lower(x, w).physical.device
    b = eins.distribute(f, devices=2).lower(x, w).physical.device
    c = eins.distribute(f, devices=2, plan={0: {"j": 2}}).lower(x, w).physical.device
    assert plan_hash(a) == plan_hash(b) != plan_hash(c)
    # the same instructions on other dtypes, or with another literal (a static scalar),
    # are other programs
    for other in [(x.astype(np.float64), w.astype(np.float64)),
                  (x.astype(np.float16), w.astype(np.float16))]:
        assert plan_hash(eins.distribute(f, devices=2).lower(*other).physical.device) != \
            plan_hash(a)
    s2, s3 = (eins.distribute(lambda x, w, s: x @ w * s, devices=2, static_argnums=2)
              .lower(x, w, v).physical.device for v in (2.0, 3.0))
    assert plan_hash(s2) != plan_hash(s3)
    # a traced scalar (the default) is an input: one program for every value
    t2, t3 = (eins.distribute(lambda x, w, s: x @ w * s, devices=2).lower(x, w, v)
              .physical.device for v in (2.0, 3.0))
    assert plan_hash(t2) == plan_hash(t3)
    # x @ w split over the contracted index: the partial products are summed across devices
    sent = {d: planned_sends(c, d) for d in (0, 1)}
    g = eins.distribute(f, devices=2, plan={0: {"j": 2}})
    g(x, w)
    moved = g.stats()["bytes_moved"]
    assert {f"{s}->{d}": b for s in (0, 1) for d, b in sent[s].items()} == moved


def test_kernel_sets_a_cuda_backend_plugs_in(monkeypatch):
    """The GPU hook's contract: a registered factory gets the rank's local device index and
    the wire ("cpu" when ranks share a GPU, as here with 2 ranks on at most one)."""
    from eins.runtime import ranks as R
    with pytest.raises(eins.EinsError, match="unknown kernel set 'tpu'.*'cuda', 'interpret'"):
        R.make_kernels("tpu")
    assert R.make_kernels("auto").name == "cpu"  # no CUDA here
    assert R.make_kernels("numpy").name == "cpu"
    # the GPU runtime's sets are registered on first use
    assert R.make_kernels("interpret").name == "interpret"
    if not torch_cuda():
        with pytest.raises(eins.GpuError, match="torch sees no GPU"):
            R.make_kernels("cuda")
    calls = []
    monkeypatch.setitem(R.KERNELS, "fake", lambda dev, wire: calls.append((dev, wire)) or
                        R.NumpyKernels())
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert isinstance(R.make_kernels("fake"), R.NumpyKernels)
    assert calls == [(0, "cpu")]


def torch_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def test_world_backend_combinations_are_checked():
    with pytest.raises(PlanError, match="unknown backend 'tpu'"):
        eins.distribute(lambda x: x, devices="world", backend="tpu")
    with pytest.raises(PlanError, match="device_map=.0, 1. does not apply to devices='world'"):
        eins.distribute(lambda x: x, devices="world", backend="interpret", device_map=[0, 1])
    if not torch_cuda():
        with pytest.raises(eins.GpuError, match="backend 'cuda': torch sees no GPU"):
            eins.distribute(lambda x: x, devices="world", backend="cuda")


def test_interpret_kernels_wire_round_trip():
    import numpy as np
    import torch
    from eins.runtime.ranks import make_kernels
    tk = make_kernels("interpret")
    for dt in (np.float32, np.float16, eins.bfloat16):
        a = (np.arange(6).reshape(2, 3) - 2).astype(dt)
        wire = tk.to_wire(tk.load(a, a.dtype))
        assert wire.dtype == torch.uint8 and wire.numel() == a.nbytes
        back = tk.to_host(tk.from_wire(wire.clone(), (2, 3), np.dtype(dt)))
        assert back.dtype == np.dtype(dt) and np.array_equal(back, a)


def test_numpy_kernels_wire_round_trip_keeps_any_dtype():
    import numpy as np
    from eins.runtime.ranks import NumpyKernels
    k = NumpyKernels()
    for dt in (np.float32, np.float16, eins.bfloat16, np.int64):
        a = (np.arange(12).reshape(3, 4) - 5).astype(dt)
        wire = k.to_wire(a)
        assert wire.numel() == a.nbytes
        back = k.from_wire(wire.clone(), (3, 4), np.dtype(dt))
        assert back.dtype == np.dtype(dt) and np.array_equal(back, a)


def test_world_without_torch_says_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # what an absent package looks like
    monkeypatch.setitem(sys.modules, "torch.distributed", None)
    with pytest.raises(DistributedError, match=r"install torch \(pip install torch\)"):
        eins.distribute(lambda x: x, devices="world")


def test_interpret_kernel_set_runs_key_split_attention():
    # the GPU kernel set (interpret: Triton on CPU tensors) runs (o, lse) pair partials with
    # the Triton kernel and combines them with the Triton lse ⊕: into pairs, or finalized to
    # the output dtype; both equal the numpy kernel set on the same blocks
    import numpy as np
    import eins
    from eins.ir.joinagg import FunctionSpec, lse_pair_dtype
    from eins.ir.types import Box
    from eins.runtime.ranks import make_kernels
    rng = np.random.default_rng(4)
    q = rng.standard_normal((4, 12, 8)).astype(np.float32)
    k, v = (rng.standard_normal((2, 12, 8)).astype(np.float32) for _ in range(2))
    (eqn,) = eins.make_ir(lambda q, k, v: eins.attention(q, k, v, causal=True))(q, k, v).eqns
    tk, nk = make_kernels("interpret"), make_kernels("numpy")
    pair = lse_pair_dtype(np.float32)
    parts = {"interpret": [], "numpy": []}
    for lo, hi in ((0, 5), (5, 12)):
        f = FunctionSpec((Box((0, 0, 0), (4, 12, 8)), Box((0, lo, 0), (2, hi, 8)),
                          Box((0, lo, 0), (2, hi, 8))), (Box((0, 0, 0), (4, 12, 8)),))
        blocks = [q, k[:, lo:hi], v[:, lo:hi]]
        (t,) = tk.kernel(eqn, f, [tk.load(b, np.float32) for b in blocks], [pair])
        (n,) = nk.kernel(eqn, f, blocks, [pair])
        assert tuple(t.shape) == (4, 12, 8, 2)
        np.testing.assert_allclose(tk.to_host(t)[..., 0], n["o"], atol=1e-5, rtol=0)
        np.testing.assert_allclose(tk.to_host(t)[..., 1], n["lse"], atol=1e-5, rtol=0)
        parts["interpret"].append(t)
        parts["numpy"].append(n)
    want = eins.jit(lambda q, k, v: eins.attention(q, k, v, causal=True))(q, k, v)
    for dt, tol in ((np.float32, 1e-5), (np.float16, 2 ** -10)):
        got = tk.to_host(tk.aggregate("lse", parts["interpret"], np.dtype(dt)))
        assert got.dtype == dt and got.shape == want.shape
        np.testing.assert_allclose(got.astype(np.float32), want, atol=tol, rtol=0)
    both = tk.to_host(tk.aggregate("lse", parts["interpret"], pair))
    ref = nk.aggregate("lse", parts["numpy"], pair)
    np.testing.assert_allclose(both[..., 0], ref["o"], atol=1e-5, rtol=0)
    np.testing.assert_allclose(both[..., 1], ref["lse"], atol=1e-5, rtol=0)