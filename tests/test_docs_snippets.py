"""The code that README.md and docs/*.md show runs as written, on this CPU machine, and
every fenced block of them is either run or checked, or says why not.

Python blocks: every ```python block runs on its own, in a fresh namespace (blocks are
self-contained: a reader pastes one and it runs), in the file's order, on the default
backend (numpy: no GPU here) inside ``tmp_path``, so a block that writes files
(``low.generate("cuda").write("out/")``) writes there. After a block, ``CHECKS`` asserts
what its comments (and docs/measured.md's figures) claim of it. A block that cannot run on
a CPU machine is not skipped silently: ``NOT_RUN`` names it by its first line and says why
and what runs instead. The torchrun block is a script of its own: it runs as one in a
subprocess, as rank 0 of a one-rank world (the environment torchrun would give it).

Plain blocks: shell lines (below) are checked command by command; a block showing output
must be what the doc's python blocks printed (lines ``...`` elide, a line ending in ``...``
is a prefix); anything else is in ``OTHER`` with the reason. A test asserts that every block
of every doc falls in exactly one of these, and that the lists name blocks the docs have.

Commands: every shell line the docs give (``eins ...``, ``make ...``, ``python FILE
--flag``, ``.venv/bin/torchrun ... FILE --flag``, ``pip install -e '.[extra]'``, ``pytest
GLOB``) names a subcommand, flag, target, file or extra that exists; the ``eins`` lines
through the command's own argparse parser, and the literal ones (no placeholders) run.
"""
import glob
import json
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


def fenced_blocks(name):
    """[(language, source)] of the fenced blocks of doc ``name``, in order (an opening
    fence names its language or none; the next ``` line closes it)."""
    blocks, lang, lines = [], None, []
    for ln in _text(name).splitlines():
        if lang is None and ln.startswith("```"):
            lang, lines = ln[3:].strip(), []
        elif lang is not None and ln.strip() == "```":
            blocks.append((lang, "".join(x + "\n" for x in lines)))
            lang = None
        elif lang is not None:
            lines.append(ln)
    assert lang is None, f"{name}: a ``` block is not closed"
    return blocks


def python_blocks(name):
    """[(first line, source)] of the ```python blocks of doc ``name``, in order."""
    return [(src.splitlines()[0].strip(), src) for lang, src in fenced_blocks(name)
            if lang == "python"]


def _first(src):
    return src.splitlines()[0].strip() if src.strip() else ""


# ----------------------------------------------------------------------------- python blocks
GPU_BLOCK = 'import numpy as np, eins, torch                # the FFN of "Using it"'
WORLD_BLOCK = "import numpy as np, eins                        # one script, started once per rank"

# (doc, first line) -> why it does not run here as written, and what runs instead
NOT_RUN = {
    ("README.md", GPU_BLOCK): "needs a CUDA GPU (backend 'cuda', tensor.cuda()); runs with "
                              "backend 'interpret' on CPU tensors instead "
                              "(test_gpu_block_on_the_interpreter)",
    ("README.md", WORLD_BLOCK): "a torchrun script, one process per rank; runs as rank 0 of "
                                "a one-rank world in a subprocess (test_torchrun_block_runs)",
}

# (doc, first line) of a plain block that is neither shell lines nor output -> what checks it
OTHER = {
    ("README.md", "eins/api.py          jit, make_ir, distribute (entry points)"):
        "a file layout, not code (test_named_files_and_python_names_exist checks the paths "
        "the docs name)",
    ("docs/exprog.md", "# comments run to the end of the line"):
        "an ExProg program, not Python: test_exprog_syntax_example_is_a_valid_program runs "
        "`eins exprog check` on it",
}


def _measured():
    return _text("docs/measured.md")


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
    # "Plans and costs": `low.plan.cost_s` equals predicted_time()["total_ms"] (naive)
    assert low.plan.cost_s * 1e3 == pytest.approx(low.predicted_time()["total_ms"], rel=1e-9)
    assert low.cost_bytes == sum(r["cost_bytes"] for r in low.plan_table())
    written = sorted(os.listdir(tmp_path / "out"))  # "per-device GPU host programs"
    assert [f"device_{d}.py" for d in range(8)] == [f for f in written if f.startswith("dev")]


def _readme_paper_block(ns, out, tmp_path):
    low = ns["low"]
    lines = low.as_text("planned").splitlines()
    att = [ln for ln in lines if "= attention[" in ln]
    assert len(att) == 1 and "split heads_kv/8 " in att[0]     # "attention split over heads_kv"
    mm = [ln for ln in lines if "= matmul " in ln]
    assert len(mm) == 7 and all("split d0/8 " in ln for ln in mm)  # "matmuls by tokens"
    t = low.predicted_time()   # "kernels + simulated exchanges, in ms, and peak memory per GPU"
    assert {"total_ms", "compute_ms", "exchange_ms", "peak_bytes", "fits"} <= set(t)
    assert f"  total{t['total_ms']:>16.3f} ms" in out and "peak memory per device" in out
    # docs/measured.md's figures: 27.3 ms on dgx-h100:8, 1.54 GB peak per GPU
    assert round(t["total_ms"], 1) == 27.3 and t["fits"] is True
    assert round(max(t["peak_bytes"].values()) / 1e9, 2) == 1.54
    assert "27.3 ms on dgx-h100:8, 1.54 GB peak per GPU" in _measured()


def _readme_explain(ns, out, tmp_path):
    """The explanation adds up to the plan's figures; the page and the trace were written
    and hold them."""
    low = ns["low"]
    x = low.explain(5)
    row = low.plan_table()[5]
    assert x.chosen.compute_s + x.chosen.exchange_s == pytest.approx(row["seconds"],
                                                                    rel=1e-12)
    assert x.chosen.total_s == pytest.approx(low.plan.cost_s, rel=1e-12)
    page = (tmp_path / "plan.html").read_text(encoding="utf-8")
    data = json.loads(re.search(r'id="eins-data">(.*?)</script>', page, re.S).group(1))
    assert data["plan_table"] == json.loads(json.dumps(low.plan_table()))
    events = json.loads((tmp_path / "plan.json").read_text())["traceEvents"]
    compute = sum(e["dur"] for e in events if e.get("cat") == "compute")
    assert compute / 1e3 == pytest.approx(low.predicted_time()["compute_ms"], rel=1e-12)


def _readme_sequence_split(ns, out, tmp_path):
    from eins.ops.attention import attention_block_flops
    cp, ring, q, kv = ns["cp"], ns["ring"], ns["q"], ns["kv"]
    assert "split sequence/8 " in cp.lower(q, kv, kv).as_text("planned")
    assert "split kv_sequence/8 " in ring.lower(q, kv, kv).as_text("planned")
    assert float(out.split()[-1]) > 0
    # docs/measured.md: every sequence block 17.59 TFLOP (min 17.591, max 17.594)
    flops = [attention_block_flops(f, True, None) / 1e12
             for f in cp.lower(q, kv, kv).plan.eqn_plans[0].spec.fspecs]
    assert len(flops) == 8
    assert round(min(flops), 3) == 17.591 and round(max(flops), 3) == 17.594
    assert "computes 17.59 TFLOP (min 17.591, max 17.594)" in _measured()


def _stages_example(ns, out, tmp_path):
    doc, low = _text("docs/stages.md"), ns["low"]
    for stage in ("traced", "planned", "exchange"):  # the page shows what the block prints
        assert low.as_text(stage) in doc and low.as_text(stage) in out
    device0 = low.as_text("device").split("device 0:\n")[1].split("device 1:")[0]
    assert "device 0:\n" + device0 + "...\n" in doc   # device 0 in full, the rest elided
    dumped = sorted(os.listdir(tmp_path / "dump"))  # EINS_DUMP_DIR: 01-NAME-traced.txt ...
    assert [d[:3] + d.rsplit("-", 1)[1] for d in dumped] == [
        "01-traced.txt", "02-planned.txt", "03-exchange.txt", "04-device.txt"]


# (doc, first line) -> check(namespace, the block's stdout, tmp_path) run after the block
CHECKS = {
    ("README.md", "import numpy as np, eins"): _readme_using_it,
    ("README.md", "import eins                                    # the paper-sized block, planned without data"): _readme_paper_block,
    ("README.md", "import eins                                    # why each eqn got its split"): _readme_explain,
    ("README.md", "import eins                                    # attention split along the sequence"): _readme_sequence_split,
    ("docs/stages.md", "import numpy as np, eins"): _stages_example,
}


def _is_shell(src):
    """A block of shell lines: every line a command (COMMAND), a comment, or the
    continuation of one (after a trailing backslash, or indented)."""
    lines = [ln for ln in src.splitlines() if ln.strip()]
    return bool(lines) and all(re.match(COMMAND, ln) or ln.startswith((" ", "#"))
                               for ln in lines) and bool(re.match(COMMAND, lines[0]))


def _kind(doc, lang, src):
    """How a block is covered: "python", "not run", "shell", "other" or "output"."""
    if lang == "python":
        return "not run" if (doc, _first(src)) in NOT_RUN else "python"
    if lang:
        return "other"
    if (doc, _first(src)) in OTHER:
        return "other"
    return "shell" if _is_shell(src) else "output"


def shows(block, out) -> bool:
    """Whether ``out`` shows ``block``: its runs of lines between elisions (a line "..."),
    in order, each run contiguous; a line ending in "..." is a prefix of its output line."""
    have = out.splitlines()
    runs, run = [], []
    for ln in block.splitlines():
        if ln.strip() == "...":
            runs, run = runs + [run] if run else runs, []
        elif ln.endswith("..."):
            runs, run = runs + [run + [(ln[:-3].rstrip(), True)]], []
        else:
            run.append((ln, False))
    runs += [run] if run else []
    pos = 0
    for run in runs:
        for j in range(pos, len(have) - len(run) + 1):
            if all(have[j + t].startswith(w) if prefix else have[j + t] == w
                   for t, (w, prefix) in enumerate(run)):
                pos = j + len(run)
                break
        else:
            return False
    return True


def test_every_block_is_run_checked_or_says_why():
    """No block is left out silently: each is run (python), checked (shell lines, output
    against what the doc's python printed) or listed with its reason; the lists name blocks
    the docs have, and a block's first line identifies it."""
    kinds = {}
    for d in DOCS:
        for lang, src in fenced_blocks(d):
            kinds.setdefault(_kind(d, lang, src), []).append((d, _first(src)))
    assert set(kinds) <= {"python", "not run", "shell", "other", "output"}
    assert sorted(kinds["not run"]) == sorted(NOT_RUN)
    assert sorted(kinds["other"]) == sorted(OTHER)
    assert all(NOT_RUN.values()) and all(OTHER.values())
    outputs = kinds.get("output", [])
    assert all(python_blocks(d) for d, _ in outputs), outputs   # output of a doc's python
    assert len(outputs) >= 5 and len(kinds["python"]) >= 5 and len(kinds["shell"]) >= 6
    for d in DOCS:
        firsts = [first for first, _ in python_blocks(d)]
        assert len(firsts) == len(set(firsts)), d
    assert set(CHECKS) <= {(d, f) for d in DOCS for f, _ in python_blocks(d)}
    assert not set(CHECKS) & set(NOT_RUN)


def test_shows_elides_and_can_fail():
    out = "a\nb\nc\nd\nlong line here\n"
    assert shows("a\nb\n...\nd\nlong...\n", out)
    assert not shows("b\na\n", out) and not shows("a\nc\n", out)
    assert not shows("d\n...\na\n", out)


@pytest.mark.parametrize("doc", [d for d in DOCS if python_blocks(d)])
def test_python_blocks_run_in_order(doc, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    if doc == "docs/stages.md":  # its text says what EINS_DUMP_DIR writes: _stages_example
        monkeypatch.setenv("EINS_DUMP_DIR", str(tmp_path / "dump"))
    ran, not_run, printed = [], [], []
    for first, src in python_blocks(doc):
        if (doc, first) in NOT_RUN:
            compile(src, f"{doc}: {first}", "exec")  # it parses, at least
            not_run.append(first)
            continue
        capsys.readouterr()
        ns = {"__name__": "__docs__"}       # a fresh namespace: the block stands alone
        exec(compile(src, f"{doc}: {first}", "exec"), ns)
        out = capsys.readouterr().out
        if (doc, first) in CHECKS:
            CHECKS[(doc, first)](ns, out, tmp_path)
        ran.append(first)
        printed.append(out)
    assert not_run == [f for (d, f) in NOT_RUN if d == doc]  # exactly the listed ones
    assert ran and all((doc, f) not in NOT_RUN for f in ran)
    for lang, src in fenced_blocks(doc):    # what the page shows is what the blocks print
        if _kind(doc, lang, src) == "output":
            assert shows(src, "".join(printed)), f"{doc}: output block {_first(src)!r}"


def _block(doc, first):
    return dict(python_blocks(doc))[first]


def test_gpu_block_on_the_interpreter(tmp_path, monkeypatch, capsys):
    """README's "Running on GPUs" block, self-contained, with backend "cuda" replaced by
    "interpret" (the same generated programs and Triton kernels on the CPU) and the tensor
    left on the CPU: the calls it shows exist and do what the comments say."""
    import torch
    monkeypatch.chdir(tmp_path)
    src = _block("README.md", GPU_BLOCK)
    assert src.count('"cuda"') == 3 and src.count(".cuda()") == 1
    capsys.readouterr()
    ns = {}
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
    assert isinstance(ns["f"](ns["x"], ns["w1"], ns["w2"]), np.ndarray)  # numpy in, out
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


# ----------------------------------------------------------------------------- commands
COMMAND = r"(eins|make|python3?|\.venv/bin/python|\.venv/bin/torchrun|pip|pytest|bash) "


def shell_lines(name):
    """[(command, literal)] of doc ``name``: the lines of its plain ``` blocks and of its
    4-space indented blocks that start with a command (a trailing backslash or an indented
    ``[--flag ...]`` line continues one), and its inline `...` spans that start with one.
    ``literal``: a whole command line from a block (inline spans may be partial)."""
    text, out = _text(name), []
    blocks = [src for lang, src in fenced_blocks(name) if not lang]
    blocks += ["\n".join(ln[4:] for ln in b.splitlines())
               for b in re.findall(r"(?:^ {4,}\S.*\n)+", text, re.M)]
    for b in blocks:
        lines = []
        for ln in b.replace("\\\n", " ").splitlines():
            if lines and re.match(r"\s+\[--", ln):
                lines[-1] += " " + ln.strip()
            else:
                lines.append(ln)
        out += [(ln.strip(), True) for ln in lines if re.match(COMMAND, ln.strip())]
    out += [(t, False) for t in re.findall(r"`([^`\n]+)`", text) if re.match(COMMAND, t)]
    return out


def _tokens(cmd):
    """The words of a command: comments, `> file` and a trailing `(see ...)` cut, the
    brackets of optional parts and `...` dropped."""
    cmd = re.sub(r"\s{2,}(#|\().*$", "", cmd)
    cmd = cmd.split(" > ")[0]
    return [t for t in shlex.split(cmd.replace("[", " ").replace("]", " ")) if t != "..."]


def _placeholder(tok):
    return bool(re.fullmatch(r"[A-Z][A-Z0-9_]*(:\d+)?", tok)) or "|" in tok


def _eins_paths(words, tree):
    """Every (leaf command's flags, remaining words) a tokenized ``eins`` line names; a
    ``a|b`` word at a subcommand position stands for each alternative."""
    flags, subs = tree
    if words and subs and not words[0].startswith("-"):
        for alt in words[0].split("|"):
            assert alt in subs, f"`eins ... {alt}`: no such subcommand (has {sorted(subs)})"
            yield from _eins_paths(words[1:], subs[alt])
    else:
        yield flags, words


def _check_eins(cmd, literal):
    from eins.cli import command_tree, main
    words = _tokens(cmd)[1:]
    for flags, rest in _eins_paths(words, command_tree()):
        for tok in rest:
            if tok.startswith("-"):
                assert tok.split("=")[0] in flags, \
                    f"{cmd!r}: `eins {' '.join(words)}` has no {tok}"
    if not literal or any(_placeholder(t) for t in words):
        return
    if "--help" in words or words == ["demo"]:  # prints help / runs the demo (test_models)
        return
    for t in words:  # the files it reads exist
        if t.endswith(".exprog"):
            assert os.path.exists(os.path.join(ROOT, t)), f"{cmd!r}: no file {t}"
    assert main(words) == 0, cmd


def _check_script(cmd):
    """``python FILE --flag``, ``python -m MODULE --flag``, ``torchrun ... FILE --flag``:
    the file exists and defines each flag given after it."""
    words = _tokens(cmd)[1:]
    if words[:1] == ["-m"]:
        words = [words[1].replace(".", "/") + ".py"] + words[2:]
    files = [k for k, t in enumerate(words) if re.search(r"\.(py|sh)$", t)]
    if not files:  # `python` alone, `python examples/...`
        return
    k = files[0]
    path = os.path.join(ROOT, words[k])
    assert os.path.isfile(path), f"{cmd!r}: no file {words[k]}"
    src = _text(words[k])
    # options a script takes from a module beside it (benchmarks/device_harness.py's
    # add_job_options) count as its own
    here = os.path.dirname(words[k])
    for mod in re.findall(r"^\s*from (\w+) import", src, re.M):
        if os.path.isfile(os.path.join(ROOT, here, mod + ".py")):
            src += _text(os.path.join(here, mod + ".py"))
    for tok in words[k + 1:]:
        if tok.startswith("--"):
            assert f'"{tok.split("=")[0]}"' in src, f"{cmd!r}: {words[k]} has no {tok}"


def _check_command(cmd, literal):
    word = cmd.split()[0]
    if word == "eins":
        _check_eins(cmd, literal)
    elif word == "make":
        targets = re.findall(r"^([\w-]+):", _text("Makefile"), re.M)
        assert _tokens(cmd)[1] in targets, f"{cmd!r}: no such make target ({targets})"
    elif word == "pip":
        extras = re.findall(r"'\.\[([\w-]+)\]'", cmd)
        section = _text("pyproject.toml").split("[project.optional-dependencies]")[1]
        for e in extras:
            assert re.search(rf"^{e} = ", section, re.M), f"{cmd!r}: no extra {e}"
    elif word == "pytest":
        for pattern in _tokens(cmd)[1:]:
            assert glob.glob(os.path.join(ROOT, pattern)), f"{cmd!r}: {pattern} matches nothing"
    else:
        _check_script(cmd)


@pytest.mark.parametrize("doc", DOCS)
def test_shell_commands_name_what_exists(doc, tmp_path, monkeypatch, capsys):
    """Every command line of the doc: subcommands and flags of ``eins`` exist in its parser
    and the literal lines run (in tmp_path, the repository's examples/ beside them); make
    targets, script files and their flags, pip extras and pytest globs exist."""
    monkeypatch.chdir(tmp_path)
    os.symlink(os.path.join(ROOT, "examples"), tmp_path / "examples")
    lines = shell_lines(doc)
    for cmd, literal in lines:
        _check_command(cmd, literal)
    if doc == "README.md":
        cmds = [c for c, _ in lines]
        assert "eins topology show dgx-h100:8" in cmds and len(cmds) >= 20
        out = capsys.readouterr().out  # the literal ones ran: check, simulate, synthesize, show
        assert "example_5_3.exprog: valid (18 actions)" in out
        assert "trace written to t.json" in out and (tmp_path / "t.json").exists()
        assert "naive" in out and "topology dgx-h100: 8 GPUs (H100)" in out


@pytest.mark.parametrize("doc", DOCS)
def test_named_files_and_python_names_exist(doc):
    """`eins/...`, `tests/...`, `benchmarks/...`, `examples/...` paths the doc names exist
    (globs match), and every dotted ``eins.name.name`` it writes resolves."""
    import importlib
    text = _text(doc)
    for path in re.findall(r"`((?:eins|tests|benchmarks|examples|docs)/[^`\s]*)`", text):
        assert glob.glob(os.path.join(ROOT, path)), f"{doc}: `{path}` does not exist"
    for dotted in sorted(set(re.findall(r"\beins(?:\.[A-Za-z_]\w*)+", text))):
        obj, parts = importlib.import_module("eins"), dotted.split(".")[1:]
        for k, part in enumerate(parts):  # a module first: eins.ops.attention is both
            try:
                obj = importlib.import_module(".".join(["eins"] + parts[:k + 1]))
            except ModuleNotFoundError:
                assert hasattr(obj, part), f"{doc}: {dotted}: no {part}"
                obj = getattr(obj, part)


def test_a_wrong_flag_or_subcommand_is_caught():
    """The checks above can fail: a flag, subcommand or file the code lacks is named."""
    with pytest.raises(AssertionError, match="has no --trace"):
        _check_eins("eins exprog check FILE --trace t.json", True)
    with pytest.raises(AssertionError, match="no such subcommand"):
        _check_eins("eins topology list", False)
    with pytest.raises(AssertionError, match="has no --fast"):
        _check_script(".venv/bin/python benchmarks/bench_plans.py --fast")
    with pytest.raises(AssertionError, match="no file examples/gone.py"):
        _check_script(".venv/bin/python examples/gone.py")
    with pytest.raises(AssertionError, match="no such make target"):
        _check_command("make docs", True)


# ----------------------------------------------------------------------------- prose facts
def test_prose_facts_the_code_decides():
    """Facts the README and docs/machines.md state in prose that the code fixes: the pass
    pipeline's order, validate_specs' device counts, the 128-device default's error."""
    import eins
    from eins.errors import TopologyError
    from eins.passes import PIPELINE
    from eins.validate_specs import PS
    readme, machines = _text("README.md"), _text("docs/machines.md")
    names = ", ".join(getattr(p, "__name__", p) for p in PIPELINE)
    assert re.search(r"PIPELINE = ([\w, ]+)", " ".join(readme.split())).group(1) == names
    assert PS == (1, 2, 3, 4, 6, 8) and "at p = 1, 2, 3, 4,\n  6 and 8" in readme
    assert "(`devices=10000` is a `TopologyError` at once)" in machines
    with pytest.raises(TopologyError, match="device ids up to 9999"):
        eins.distribute(lambda x: x, devices=10000)


def test_exprog_syntax_example_is_a_valid_program(tmp_path, capsys):
    """docs/exprog.md's syntax block is a whole program: `eins exprog check` accepts it
    (G1 {size 4} gets the four sites A reaches that G2 does not hold), and the one-line
    sections it mentions parse."""
    from eins.cli import main
    from eins.ir import exprog
    src = [s for lang, s in fenced_blocks("docs/exprog.md") if not lang][0]
    assert src.startswith("# comments run")
    members = exprog.check(exprog.parse(src))
    assert members == {"G1": (0, 1, 4, 5), "G2": (2, 3, 6, 7)}
    (tmp_path / "syntax.exprog").write_text(src)
    assert main(["exprog", "check", str(tmp_path / "syntax.exprog")]) == 0
    assert "valid (6 actions)" in capsys.readouterr().out
    assert "`IN: A @ 0; B @ 1 OUT: A+B @ 0`" in _text("docs/exprog.md")
    assert exprog.check(exprog.parse("IN: A @ 0; B @ 1 OUT: A+B @ 0\nB @ 1 -> 0\nA+B @ 0")) == {}


def test_machines_preset_table_is_what_topology_show_says(capsys):
    """docs/machines.md's preset table: every preset named, each row's GPU count and model
    and a switch preset's GB/s per GPU as `eins topology show` prints them."""
    from eins.cli import main
    from eins.hardware.presets import PRESETS
    rows = re.findall(r"^\| `([\w-]+)(?:\[:N\])?` \| (\d+) (\w+) \| (.*) \|$",
                      _text("docs/machines.md"), re.M)
    assert sorted(r[0] for r in rows) == sorted(PRESETS)
    for name, count, model, fabric in rows:
        assert main(["topology", "show", name]) == 0
        out = capsys.readouterr().out
        assert f"topology {name}: {count} GPUs ({model})" in out, (name, out[:200])
        gbs = re.search(r"(\d+) GB/s per GPU", fabric)
        if gbs:
            assert f"{gbs.group(1)} GB/s egress" in out, name


def test_readme_compare_plans_row_is_what_the_example_prints():
    """docs/measured.md's compare_plans table, its 1 x 1K row (the one cheap to run: ~3 s),
    is the predicted ms that `.venv/bin/python examples/compare_plans.py 1x1K` prints."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "compare_plans.py"),
                        "1x1K"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    printed = r.stdout.splitlines()[-1].split()
    assert printed[0] == "1x1K"
    predicted = [f"{float(ms):.2f} ms" for ms in printed[2::2]]  # proxy GB, ms pairs
    row = re.search(r"^ *\| 1 x 1K \| (.*) \|$", _measured(), re.M).group(1)
    assert row.split(" | ") == predicted
