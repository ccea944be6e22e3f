"""A light start: ``backend="auto"`` decides without importing torch where no GPU can be
present (eins/runtime/devices.py ``gpu_possible``: importing torch to ask cost seconds on
every first call of a machine without GPUs), and the base install (numpy, jinja2) runs
without ml_dtypes, naming it when bfloat16 is asked for."""
import os
import re
import subprocess
import sys

import pytest

from eins.runtime import devices
from eins.runtime.gpu import gpu_count, resolve_backend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def linux_without_vars(monkeypatch):
    for var in devices.VISIBLE_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(sys, "platform", "linux")


def test_device_nodes_decide_on_linux(linux_without_vars, monkeypatch, tmp_path):
    monkeypatch.setattr(devices, "GPU_NODES", (str(tmp_path / "nvidia[0-9]*"),))
    assert devices.gpu_possible() is False
    (tmp_path / "nvidiactl").touch()           # the control node alone is no GPU
    assert devices.gpu_possible() is False
    (tmp_path / "nvidia0").touch()
    assert devices.gpu_possible() is True


@pytest.mark.parametrize("var", devices.VISIBLE_VARS)
@pytest.mark.parametrize("value", ["", "-1", " "])
def test_a_variable_hiding_every_gpu_decides(linux_without_vars, monkeypatch, tmp_path, var,
                                             value):
    (tmp_path / "nvidia0").touch()
    monkeypatch.setattr(devices, "GPU_NODES", (str(tmp_path / "nvidia[0-9]*"),))
    monkeypatch.setenv(var, value)
    assert devices.gpu_possible() is False
    assert gpu_count() == 0 and resolve_backend("auto") == "numpy"
    monkeypatch.setenv(var, "0")               # a device named: the nodes decide
    assert devices.gpu_possible() is True


def test_macos_has_no_cuda(linux_without_vars, monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert devices.gpu_possible() is False


def _first_call(env_extra):
    code = ("import sys, numpy as np, eins\n"
            "from eins.runtime.devices import gpu_possible\n"
            "f = lambda x, w: eins.relu(x @ w)\n"
            "x, w = np.ones((16, 8), np.float32), np.ones((8, 4), np.float32)\n"
            "d = eins.distribute(f, devices=8)\n"
            "y = d(x, w)\n"
            "assert np.array_equal(y, np.maximum(x @ w, 0))\n"
            "print(gpu_possible(), 'torch' in sys.modules, d.last.backend)\n")
    env = {k: v for k, v in os.environ.items() if k not in devices.VISIBLE_VARS}
    env.update(env_extra, PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.split()


def test_first_call_imports_torch_only_where_a_gpu_can_be():
    possible, imported, backend = _first_call({"CUDA_VISIBLE_DEVICES": ""})
    assert (possible, imported, backend) == ("False", "False", "numpy")
    possible, imported, backend = _first_call({})
    assert imported == possible                # this machine: torch only if a GPU can be
    if possible == "False":
        assert backend == "numpy"


def test_without_ml_dtypes_bfloat16_names_the_package_and_the_rest_runs():
    code = ("import sys\n"
            "sys.modules['ml_dtypes'] = None   # as in a base install\n"
            "import numpy as np, eins\n"
            "assert eins.bfloat16 is None\n"
            "for name in ('bfloat16', 'bf16'):\n"
            "    try:\n"
            "        eins.ShapeDtype((2, 2), name)\n"
            "    except eins.errors.DTypeError as e:\n"
            "        print(e)\n"
            "x = np.arange(8, dtype=np.float32).reshape(4, 2)\n"
            "y = eins.distribute(lambda x: x * 2, devices=2)(x)\n"
            "assert np.array_equal(y, x * 2)\n"
            "print('ran')\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines == [f"dtype {n!r} needs the ml_dtypes package (numpy has no bfloat16): pip "
                     f"install ml_dtypes, or eins's extra 'eins[bf16]'"
                     for n in ("bfloat16", "bf16")] + ["ran"]


def test_the_base_install_is_numpy_and_jinja2():
    text = open(os.path.join(ROOT, "pyproject.toml")).read()
    deps = re.search(r"^dependencies = \[(.*?)\]", text, re.S | re.M).group(1)
    assert re.findall(r'"([\w-]+)', deps) == ["numpy", "jinja2"]
    make = open(os.path.join(ROOT, "Makefile")).read()
    assert "pip install -q -e .\n" in make and "demo: $(BASE)\n" in make
