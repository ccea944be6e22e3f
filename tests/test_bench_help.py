"""Every script in benchmarks/ answers ``--help`` with its usage and exit status 0, without
running anything (no JSON report, no missing-folder error), and says what it does in whole
sentences (a description that ends in a full stop, not a first docstring line cut
mid-sentence)."""
import glob
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(p for p in glob.glob(os.path.join(ROOT, "benchmarks", "*.py"))
                 if "__main__" in open(p, encoding="utf-8").read())


def _description(help_text):
    """The paragraph between argparse's usage lines and its first argument section."""
    paragraphs = help_text.split("\n\n")
    assert len(paragraphs) >= 2 and paragraphs[0].startswith("usage: "), help_text[:500]
    first = paragraphs[1]
    if first.startswith(("options:", "positional arguments:")):
        return ""
    return " ".join(first.split())


@pytest.mark.parametrize("path", SCRIPTS, ids=os.path.basename)
def test_help_prints_usage_and_a_whole_description(path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, path, "--help"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    desc = _description(r.stdout)
    assert desc.endswith("."), f"{os.path.basename(path)}: description {desc!r}"
