"""The code that README.md and docs/*.md show runs as written, on this CPU machine.

Python blocks: every ```python block of a file runs, in the file's order, in one namespace
per file (a fresh one for each file), as a reader who pastes a page's blocks one after
another into one session would: README's later blocks use the ``eins``, ``ffn`` and ``x``
of its first. They run on the default backend (numpy: no GPU here) inside ``tmp_path``, so
a block that writes files (``low.generate("cuda").write("out/")``) writes there. After a
block, ``CHECKS`` asserts what its comments (and the README's "What is measured") claim of
it where that is cheap. A block that cannot run on a CPU machine is not skipped silently:
``NOT_RUN`` names it by its first line and says why and what runs instead, and a test
asserts that ``NOT_RUN`` and ``CHECKS`` name exactly blocks the docs have. The torchrun
block is a script of its own: it runs as one in a subprocess, as rank 0 of a one-rank world
(the environment torchrun would give it).

Commands: every shell line the docs give (``eins ...``, ``make ...``, ``python FILE
--flag``, ``.venv/bin/torchrun ... FILE --flag``, ``pip install -e '.[extra]'``, ``pytest
GLOB``) names a subcommand, flag, target, file or extra that exists; the ``eins`` lines
through the command's own argparse parser, and the literal ones (no placeholders) run.
"""
import glob
import os
import re
import shlex
import socket
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT)
                              for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))


def _text(name):
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return f.read()


def python_blocks(name):
    """[(first line, source)] of the ```python blocks of doc ``name``, in order."""
    return [(src.splitlines()[0].strip(), src) for src in
            re.findall(r"^```python\n(.*?)^```", _text(name), re.S | re.M)]


# ----------------------------------------------------------------------------- python blocks
GPU_BLOCK = "import torch                                   # continues \"Using it\": ffn, x, w1, w2"
WORLD_BLOCK = "import numpy as np, eins                        # one script, started once per rank"

# (doc, first line) -> why it does not run here as written, and what runs instead
NOT_RUN = {
    ("README.md", GPU_BLOCK): "needs a CUDA GPU (backend 'cuda', tensor.cuda()); runs with "
                              "backend 'interpret' on CPU tensors instead "
                              "(test_gpu_block_on_the_interpreter)",
    ("README.md", WORLD_BLOCK): "a torchrun script, one process per rank; runs as rank 0 of "
                                "a one-rank world in a subprocess (test_torchrun_block_runs)",
}


def _readme_using_it(ns, out, tmp_path):
    x, w1, w2 = ns["x"], ns["w1"], ns["w2"]
    want = np.maximum(x @ w1, 0) @ w2
    np.testing.assert_allclose(ns["y"], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ns["y8"], ns["y"], rtol=1e-5, atol=1e-5)  # "equals y"
    stats = ns["f8"].stats()  # "bytes per (src, dst), transfers, peak memory"
    assert {"bytes_moved", "transfers", "peak_bytes"} <= set(stats)
    assert "c:f32[128,32]. let" in out and "= relu" in out      # the traced SSA IR
    low = ns["low"]
    assert "split d0/8" in low.as_text("planned") and "## eqn 1 (relu)" in out
    assert "device 7:" in out and [r["eqn"] for r in low.plan_table()] == [0, 1, 2]
    written = sorted(os.listdir(tmp_path / "out"))  # "per-device GPU host programs"
    assert [f"device_{d}.py" for d in range(8)] == [f for f in written if f.startswith("dev")]


def _readme_paper_block(ns, out, tmp_path):
    low = ns["low"]
    lines = low.as_text("planned").splitlines()
    att = [ln for ln in lines if "= attention[" in ln]
    assert len(att) == 1 and "split heads_kv/8 " in att[0]     # "attention split over heads_kv"
    mm = [ln for ln in lines if "= matmul " in ln]
    assert len(mm) == 7 and all("split d0/8 " in ln for ln in mm)  # "matmuls by tokens"
    t = low.predicted_time()   # README "What is measured": 27.3 ms on dgx-h100:8, 1.54 GB
    assert {"total_ms", "compute_ms", "exchange_ms", "peak_bytes", "fits"} <= set(t)
    assert round(t["total_ms"], 1) == 27.3 and t["fits"] is True
    assert round(max(t["peak_bytes"].values()) / 1e9, 2) == 1.54


def _readme_sequence_split(ns, out, tmp_path):
    from eins.ops.attention import attention_block_flops
    cp, ring, q, kv = ns["cp"], ns["ring"], ns["q"], ns["kv"]
    assert "split sequence/8 " in cp.lower(q, kv, kv).as_text("planned")
    assert "split kv_sequence/8 " in ring.lower(q, kv, kv).as_text("planned")
    assert float(out.split()[-1]) > 0
    # README "What is measured": every sequence block 17.59 TFLOP (min 17.591, max 17.594)
    flops = [attention_block_flops(f, True, None) / 1e12
             for f in cp.lower(q, kv, kv).plan.eqn_plans[0].spec.fspecs]
    assert len(flops) == 8
    assert round(min(flops), 3) == 17.591 and round(max(flops), 3) == 17.594


def _stages_example(ns, out, tmp_path):
    doc, low = _text("docs/stages.md"), ns["low"]
    for stage in ("traced", "exchange"):      # the page shows what the block prints
        assert low.as_text(stage) in doc and low.as_text(stage) in out
    dumped = sorted(os.listdir(tmp_path / "dump"))  # EINS_DUMP_DIR: 01-NAME-traced.txt ...
    assert [d[:3] + d.rsplit("-", 1)[1] for d in dumped] == [
        "01-traced.txt", "02-planned.txt", "03-exchange.txt", "04-device.txt"]


# (doc, first line) -> check(namespace, the block's stdout, tmp_path) run after the block
CHECKS = {
    ("README.md", "import numpy as np, eins"): _readme_using_it,
    ("README.md", "from eins.models import llama"): _readme_paper_block,
    ("README.md", 'q, kv = eins.ShapeDtype((32, 131072, 128), "float16"), '
                  'eins.ShapeDtype((8, 131072, 128), "float16")'): _readme_sequence_split,
    ("docs/stages.md", "import numpy as np, eins"): _stages_example,
}


def test_the_lists_name_blocks_the_docs_have():
    """NOT_RUN and CHECKS cannot rot: each names a python block of its doc (by first line),
    and a block appears once in a doc, so its first line identifies it."""
    blocks = {(d, first) for d in DOCS for first, _ in python_blocks(d)}
    assert set(NOT_RUN) <= blocks, set(NOT_RUN) - blocks
    assert set(CHECKS) <= blocks, set(CHECKS) - blocks
    assert not set(NOT_RUN) & set(CHECKS)
    for d in DOCS:
        firsts = [first for first, _ in python_blocks(d)]
        assert len(firsts) == len(set(firsts)), d
    assert len(blocks) >= 6  # README 5 + stages.md 1: the extraction finds them


@pytest.mark.parametrize("doc", [d for d in DOCS if python_blocks(d)])
def test_python_blocks_run_in_order(doc, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("EINS_DUMP_DIR", str(tmp_path / "dump"))
    ns = {"__name__": "__docs__"}
    ran, not_run = [], []
    for first, src in python_blocks(doc):
        if (doc, first) in NOT_RUN:
            compile(src, f"{doc}: {first}", "exec")  # it parses, at least
            not_run.append(first)
            continue
        capsys.readouterr()
        exec(compile(src, f"{doc}: {first}", "exec"), ns)
        out = capsys.readouterr().out
        if (doc, first) in CHECKS:
            CHECKS[(doc, first)](ns, out, tmp_path)
        ran.append(first)
    assert not_run == [f for (d, f) in NOT_RUN if d == doc]  # exactly the listed ones
    assert ran and all((doc, f) not in NOT_RUN for f in ran)


def _block(doc, first):
    return dict(python_blocks(doc))[first]


def test_gpu_block_on_the_interpreter(tmp_path, monkeypatch, capsys):
    """README's "Running on GPUs" block after its "Using it" block, with backend "cuda"
    replaced by "interpret" (the same generated programs and Triton kernels on the CPU) and
    the tensor left on the CPU: the calls it shows exist and do what the comments say."""
    import torch
    monkeypatch.chdir(tmp_path)
    ns = {}
    exec(_block("README.md", "import numpy as np, eins"), ns)
    src = _block("README.md", GPU_BLOCK)
    assert src.count('"cuda"') == 3 and src.count(".cuda()") == 1
    capsys.readouterr()
    exec(src.replace('"cuda"', '"interpret"').replace(".cuda()", ""), ns)
    out = capsys.readouterr().out
    c, y = ns["c"], ns["y"]
    assert isinstance(y, torch.Tensor)       # torch in -> torch out
    np.testing.assert_allclose(y.numpy(), np.maximum(ns["x"] @ ns["w1"], 0) @ ns["w2"],
                               rtol=1e-5, atol=1e-5)
    st = c.stats()
    for key in ("h2d_bytes", "d2h_bytes", "peer_bytes", "local_copy_bytes"):
        assert key in st and key in out
    assert set(st["device_map"].values()) == {0}           # 8 logical devices on GPU 0
    assert st["loads_skipped"] > 0                         # the placed weights stayed


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_block_runs(tmp_path):
    """README's torchrun block as the script it is, rank 0 of a one-rank world (RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT as torchrun sets them); its output equals
    eins.jit's on the weights ``load`` gives."""
    check = (
        "\nfrom eins.ir.types import Box\n"
        "w = {n: load(k + 1, Box.full(weights[n].shape)) for k, n in enumerate(names)}\n"
        "want = eins.jit(llama.block_fn(cfg))(x, w, cos, sin)\n"
        "assert y.shape == x.shape and f.rank == 0 and f.world_size == 1\n"
        "np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-5)\n"
        "print('CHECKED')\n")
    script = tmp_path / "world.py"
    script.write_text(_block("README.md", WORLD_BLOCK) + check)
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "'total_bytes_sent': 0" in r.stdout and "CHECKED" in r.stdout
