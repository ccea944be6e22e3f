"""Distributed gradients on torchrun ranks (devices="world", gloo on CPU) equal eins.jit's:
2 ranks with the naive schedule, 4 with the optimized one (each process pays seconds to
import torch)."""
import json
import os
import socket
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("ranks, schedule", [(2, "naive"), (4, "optimized")])
def test_gradients_on_ranks_equal_jit(tmp_path, ranks, schedule):
    pytest.importorskip("torch")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}",
           os.path.join(HERE, "autodiff_ranks_script.py"), str(tmp_path), schedule]
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       timeout=180)
    log = p.stdout.decode(errors="replace")[-3000:]
    assert p.returncode == 0, log
    for r in range(ranks):
        with open(tmp_path / f"rank{r}.json") as f:
            res = json.load(f)
        assert (res["rank"], res["world"]) == (r, ranks)
        assert res["close"] == "ok", res
        assert res["bwd_eqns"] > 0
    # the ranks exchanged blocks: the plan is distributed, not one rank doing everything
    assert sum(json.load(open(tmp_path / f"rank{r}.json"))["sent"] for r in range(ranks)) > 0
