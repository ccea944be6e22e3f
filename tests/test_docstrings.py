"""Docstring examples are contracts: each runs as written (``doctest``), as ``pytest
--doctest-modules eins/api.py eins/passes`` runs them. The stage objects, argument
classification and options have examples, and so does every pass of ``PIPELINE``: a new
pass comes with one."""
import doctest
import importlib

import pytest

from eins.passes import PIPELINE

PASS_MODULES = sorted({p.__module__ for p in PIPELINE})


@pytest.mark.parametrize("module", ["eins.api", "eins.stages", "eins.arguments",
                                    "eins.ir.plan", "eins.passes"] + PASS_MODULES)
def test_docstring_examples_run(module):
    failed, tried = doctest.testmod(importlib.import_module(module))
    assert tried > 0 and failed == 0


@pytest.mark.parametrize("p", PIPELINE, ids=lambda p: p.__name__)
def test_every_pass_has_an_example(p):
    assert ">>> " in (p.__doc__ or ""), f"{p.__module__}.{p.__name__} has no example"
