"""Progress and logging (issue 37): every slow step logs through the ``eins`` logger, on a
terminal a step past a second draws a bar on stderr, and ``verbose=`` / ``EINS_VERBOSE`` /
``eins -v`` set the level."""
from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import eins
from eins import progress
from eins.cli import main
from eins.errors import EinsError


@pytest.fixture(autouse=True)
def default_verbosity():
    yield
    progress.set_verbose(None)


def _steps(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "eins"]


def test_planning_lowering_and_codegen_log_their_steps(caplog):
    caplog.set_level(logging.INFO, logger="eins")
    f = eins.distribute(lambda x, w: eins.relu(x @ w), devices=2, schedule="optimized",
                        verbose=1)
    x = np.ones((8, 4), np.float32)
    f(x, x.T)
    low = f.lower(x, x.T)
    low.generate("numpy")
    msgs = _steps(caplog)
    for what in ["tracing", "enumerate_specs", "cut_trees", "choose_specs",
                 "planning <lambda> for 2 devices", "place", "overlay", "synthesize", "lower",
                 "verify", "lowering <lambda> (exchange programs, device programs)",
                 "codegen (numpy)"]:
        assert any(m.startswith(f"{what}: ") and m.endswith(" s") for m in msgs), (what, msgs)
    # a cached call plans nothing: no new records
    n = len(msgs)
    f(x, x.T)
    assert len(_steps(caplog)) == n
    # debug shows each step's start too; warning (verbose=0) none of them
    caplog.clear()
    caplog.handler.setLevel(logging.DEBUG)
    progress.set_verbose(2)
    eins.distribute(lambda x: x * 2, devices=2).lower(x)
    assert "choose_specs ..." in _steps(caplog)
    caplog.clear()
    eins.distribute(lambda x: x * 3, devices=2, verbose=0).lower(x)
    assert _steps(caplog) == []


def test_verbose_values_are_checked():
    assert progress.verbose_level(True) == logging.INFO
    assert progress.verbose_level("debug") == logging.DEBUG
    assert progress.verbose_level(0) == logging.WARNING
    for bad in ["loud", 3, 1.5, [1]]:
        with pytest.raises(EinsError, match=r"verbose must be 0, 1, 2 \(or False, True, "
                                            r"'warning', 'info', 'debug'\), got "):
            eins.distribute(lambda x: x, devices=2, verbose=bad)


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_step_past_the_threshold_draws_a_bar_on_a_terminal(monkeypatch):
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    monkeypatch.setattr(progress, "BAR_AFTER_S", 0.1)
    with progress.step("planning", total=3, unit="trees") as s:
        s.update(2)
        time.sleep(0.6)
    out = term.getvalue()
    assert "\r\x1b[Keins: planning 2/3 trees 0." in out
    assert out.endswith("\r\x1b[K")            # the line is cleared when the step ends
    # a quick step draws nothing, and neither does one on a pipe or with EINS_PROGRESS=0
    term.truncate(0)
    term.seek(0)
    with progress.step("quick"):
        pass
    assert term.getvalue() == ""
    monkeypatch.setenv("EINS_PROGRESS", "0")
    with progress.step("slow"):
        time.sleep(0.4)
    assert term.getvalue() == ""
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    monkeypatch.delenv("EINS_PROGRESS")
    with progress.step("slow on a pipe"):
        time.sleep(0.4)
    assert sys.stderr.getvalue() == ""


def test_eins_verbose_and_the_cli_flag_log_the_steps(caplog):
    code = ("import numpy as np, eins\n"
            "eins.distribute(lambda x: x + 1, devices=2).lower(np.ones(4, np.float32))\n")
    env = {**os.environ, "EINS_VERBOSE": "1"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "eins: choose_specs: " in r.stderr and "eins: planning <lambda> for 2 devices: " \
        in r.stderr
    caplog.set_level(logging.INFO, logger="eins")
    assert main(["-v", "plan", "1x1K", "--model", "tiny", "--devices", "2"]) == 0
    assert any(m.startswith("choose_specs: ") for m in _steps(caplog))
