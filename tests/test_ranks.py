"""The rank runtime (issue 13) on CPU with gloo, on 127.0.0.1: torchrun with 2 and 4 ranks
runs the LLaMA tiny block with packed segments and a matmul chain equal to eins.jit, each
rank sending exactly the plan's bytes; ranks started by hand show that a rank that exits or
never sends is named within timeout_s. Launches are few and concurrent (each process pays
seconds to import torch); tests/ranks_script.py holds the checks they run."""
import json
import os
import socket
import subprocess
import sys
import time

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


@pytest.fixture(scope="module")
def torchrun(tmp_path_factory):
    """torchrun --nproc-per-node=2 and =4, concurrently; -> {n: {rank: result}}."""
    runs = {}
    for n in (2, 4):
        out = tmp_path_factory.mktemp(f"torchrun{n}")
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


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("case", ["llama", "chain"])
def test_torchrun_equals_jit_and_sends_the_plans_bytes(torchrun, n, case):
    ranks = torchrun[n]
    for r, res in ranks.items():
        c = res[case]
        assert c["world"] == n and c["rank"] == r
        assert c["err"] <= c["tol"], (r, c)
        # the bytes this rank sent over gloo: its Send instructions' blocks, and what the
        # numpy executor moves from this device for the same program
        assert c["sent"] == c["planned"] == c["numpy"], (r, c)
        assert c["transfers"] >= c["batches"] >= 1
    total = sum(sum(res[case]["sent"].values()) for res in ranks.values())
    assert total == ranks[0][case]["plan_total"] > 0


@pytest.mark.parametrize("n", [2, 4])
def test_torchrun_loads_only_the_planned_blocks(torchrun, n):
    for r, res in torchrun[n].items():
        assert res["load"]["err"] <= res["load"]["tol"]
        assert res["load"]["calls_match_plan"] and res["load"]["calls"] > 0


@pytest.mark.parametrize("n", [2, 4])
def test_torchrun_local_blocks_tile_the_output(torchrun, n):
    cells = 0
    for r, res in torchrun[n].items():
        assert res["local"]["err"] <= 1e-5
        for lo, hi in res["local"]["boxes"]:
            cells += (hi[0] - lo[0]) * (hi[1] - lo[1])
    assert cells == 16 * 16  # the block's output [16 tokens, d_model 16], each cell once


@pytest.mark.parametrize("n", [2, 4])
def test_torchrun_ranks_that_plan_differently_are_named(torchrun, n):
    for r, res in torchrun[n].items():
        msg = res["mismatch"]
        assert msg and msg.startswith("DistributedError") and "planned" in msg, msg
        # every rank is named in one of the groups
        assert all(f"{q}" in msg.split("differently")[1] for q in range(n)), msg


FAILURE_TIMEOUT = 4.0  # tests/ranks_script.py's timeout_s


@pytest.fixture(scope="module")
def failures(tmp_path_factory):
    """Ranks started by hand, two per scenario, all scenarios at once."""
    runs = {}
    for mode in ("exit-before", "never-sends", "dies"):
        out = tmp_path_factory.mktemp(mode)
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
    return got


def test_a_rank_that_exits_before_the_call_is_named(failures):
    res = failures["exit-before"][0]
    assert res["error"].startswith("DistributedError")
    assert "rank(s) [1] did not reach the plan check" in res["error"]
    assert res["seconds"] < FAILURE_TIMEOUT + 3


def test_a_peer_that_never_sends_is_named_with_the_transfer(failures):
    res = failures["never-sends"][0]
    assert res["error"].startswith("DistributedError")
    assert "from rank 1 (transfer #" in res["error"] and "within 4 s" in res["error"]
    assert res["seconds"] < FAILURE_TIMEOUT + 3


def test_a_rank_that_dies_in_the_call_is_named_with_the_transfer(failures):
    res = failures["dies"][0]
    assert res["error"].startswith("DistributedError")
    assert "from rank 1 (transfer #" in res["error"] and "closed the connection" in \
        res["error"]
    assert res["seconds"] < FAILURE_TIMEOUT + 3


# ----------------------------------------------------------------------------- in process
def test_world_without_a_process_group_or_torchrun_env_names_what_is_missing(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    import torch.distributed as dist
    assert not dist.is_initialized()
    with pytest.raises(DistributedError, match="lacks RANK, WORLD_SIZE, MASTER_ADDR, "
                                               "MASTER_PORT"):
        eins.distribute(lambda x: x, devices="world")


@pytest.mark.parametrize("kw, match", [
    (dict(devices=2, timeout_s=5), "apply to devices='world'"),
    (dict(devices=2, load=lambda k, b: None), "apply to devices='world'"),
    (dict(devices=2, gather=False), "apply to devices='world'"),
    (dict(devices="world", timeout_s=0), "timeout_s must be a positive number"),
    (dict(devices="world", timeout_s="5"), "timeout_s must be a positive number"),
    (dict(devices="world", load=3), "load must be a function"),
    (dict(devices="world", gather="yes"), "gather must be True or False"),
    (dict(devices="galaxy"), "devices must be a device count"),
])
def test_world_options_are_checked(kw, match):
    with pytest.raises(PlanError, match=match):
        eins.distribute(lambda x: x, **kw)


def test_plan_hash_tells_plans_apart():
    import numpy as np
    from eins.runtime.ranks import plan_hash, planned_sends
    x, w = np.ones((8, 4), np.float32), np.ones((4, 8), np.float32)
    f = lambda x, w: x @ w  # noqa: E731
    a = eins.distribute(f, devices=2).lower(x, w).physical.device
    b = eins.distribute(f, devices=2).lower(x, w).physical.device
    c = eins.distribute(f, devices=2, plan={0: {"j": 2}}).lower(x, w).physical.device
    assert plan_hash(a) == plan_hash(b) != plan_hash(c)
    # x @ w split over the contracted index: the partial products are summed across devices
    sent = {d: planned_sends(c, d) for d in (0, 1)}
    g = eins.distribute(f, devices=2, plan={0: {"j": 2}})
    g(x, w)
    moved = g.stats()["bytes_moved"]
    assert {f"{s}->{d}": b for s in (0, 1) for d, b in sent[s].items()} == moved
