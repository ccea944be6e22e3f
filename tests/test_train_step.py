"""State that stays on the devices across calls (issue 34, part 3): ``outputs="devices"``
returns Sharded arrays in the blocks the plan stored; passed back, each device reads its
own blocks in place and receives the rest from the devices holding them, with no bytes
from the host (numpy virtual devices and the interpret backend here; the ranks in
tests/test_train_llama.py); ``donate_argnums`` releases the consumed state."""
import numpy as np
import pytest

import eins
from eins.errors import EinsError, LoweringError, PlanError, TraceError
from eins.ir.device import Load
from eins.ir.types import Box
from eins.runtime.sharded import Sharded, cover
from helpers import SPREAD, assert_close, assert_splits


def sgd(w, x):
    """A training step in miniature: the loss and the updated weight."""
    y = x @ w
    return np.sum(y * y), w - 0.01 * (x.T @ y)


RNG = np.random.default_rng(0)
W = RNG.standard_normal((16, 8)).astype(np.float32)
X = RNG.standard_normal((32, 16)).astype(np.float32)


def loaded_bytes(compiled, k) -> int:
    """What the device program loads of input ``k``, over every device: the bytes each
    call must find somewhere (host, own block or another device's)."""
    dp = compiled.lowered.physical.device
    item = dp.program.inputs[k].dtype.itemsize
    return sum(ins.box.size * item for code in dp.code.values() for ins in code
               if isinstance(ins, Load) and ins.source == ("in", k))


@pytest.mark.parametrize("backend", ["numpy", "interpret"])
def test_state_stays_on_the_devices_across_steps(backend):
    f = eins.distribute(sgd, devices=4, backend=backend, outputs="devices", donate_argnums=0,
                        tuning=SPREAD)
    step = eins.jit(sgd)
    w, want = W, W
    for t in range(3):
        loss, w = f(w, X)
        want_loss, want = step(want, X)
        assert isinstance(w, Sharded) and isinstance(loss, Sharded)
        assert w.where == backend and w.shape == (16, 8) and w.dtype == np.float32
        assert_close(np.asarray(w), want, n=32, depth=2 * (t + 1))
        assert_close(float(loss), want_loss, n=512, depth=2 * (t + 1))
        st = f.stats()
        compiled = f.last
        assert_splits(compiled.lowered)
        if t == 0:   # the first step loads the weight from the host
            assert st["h2d_inputs"][0] == loaded_bytes(compiled, 0)
        else:        # then only the batch: the weight's loads are all on the devices
            assert 0 not in st["h2d_inputs"]
            assert st["resident_bytes"] + st["relayout_bytes"] == loaded_bytes(compiled, 0)
        assert st["h2d_inputs"][1] == loaded_bytes(compiled, 1)


def test_each_device_reads_its_own_block_in_place_when_the_layouts_agree():
    """An elementwise step keeps every block where it was: no byte moves between steps."""
    f = eins.distribute(lambda a: a * 0.5 + 1.0, devices=4, outputs="devices",
                        plan={0: {"d0": 4}, 1: {"d0": 4}})
    a = f(W)
    b = f(a)
    st = f.stats()
    assert st["relayout_bytes"] == 0 and st["h2d_bytes"] == 0
    assert st["resident_bytes"] == W.nbytes and st["total_bytes"] == 0
    assert_close(np.asarray(b), (W * 0.5 + 1.0) * 0.5 + 1.0)
    assert sorted(d for d, _ in a.layout) == [0, 1, 2, 3]


def test_another_layout_is_re_laid_out_device_to_device():
    """A Sharded array from a 2-device program read by a 4-device one with another split:
    the parts move between devices (counted as bytes moved), still none from the host."""
    two = eins.distribute(lambda a: a + 1.0, devices=2, outputs="devices",
                          plan={0: {"d0": 2}})
    four = eins.distribute(lambda a: a * 2.0, devices=4, plan={0: {"d1": 4}})
    a = two(W)
    got = four(a)
    st = four.stats()
    assert st["h2d_bytes"] == 0
    assert st["relayout_bytes"] > 0 and st["relayout_bytes"] + st["resident_bytes"] == W.nbytes
    assert sum(st["bytes_moved"].values()) >= st["relayout_bytes"]
    assert_close(got, (W + 1.0) * 2.0)


def test_donated_state_is_released_and_refused_by_name():
    f = eins.distribute(sgd, devices=2, outputs="devices", donate_argnums=(0,))
    _, w1 = f(W, X)
    _, w2 = f(w1, X)
    assert w1.donated and not w2.donated
    with pytest.raises(EinsError, match=r"argument 0 was donated"):
        f(w1, X)
    with pytest.raises(EinsError, match="donated"):
        np.asarray(w1)
    keep = eins.distribute(sgd, devices=2, outputs="devices")   # not donated: reusable
    _, v = keep(W, X)
    keep(v, X)
    keep(v, X)
    assert not v.donated


def test_sharded_arrays_go_anywhere_an_array_does():
    f = eins.distribute(sgd, devices=2, outputs="devices")
    loss, w = f(W, X)
    want_loss, want = eins.jit(sgd)(W, X)
    assert_close(eins.jit(lambda a: a * 3.0)(w), want * 3.0, n=32, depth=3)  # on the host
    assert np.asarray(w, np.float64).dtype == np.float64
    assert_close(np.asarray(w, np.float64), want, n=32, depth=2, dtype=np.float32)
    assert_close(loss.item(), want_loss, n=512, depth=2)
    assert len(w) == 16 and w.ndim == 2 and w.nbytes == W.nbytes
    low = eins.distribute(sgd, devices=2).lower(w, X)          # traced as its shape
    assert low.program.inputs[0].shape == (16, 8)
    interp = eins.distribute(lambda a: a + 1.0, devices=2, backend="interpret")
    assert_close(interp(w), want + 1.0, n=32, depth=3)   # another memory: through the host, counted so
    assert interp.stats()["h2d_bytes"] == W.nbytes


def test_compile_takes_the_same_options():
    low = eins.distribute(sgd, devices=2).lower(W, X)
    c = low.compile(outputs="devices", donate_argnums=0)
    loss, w = c(W, X)
    _, w2 = c(w, X)
    assert w.donated and isinstance(w2, Sharded)
    assert 0 not in c.stats()["h2d_inputs"]


@pytest.mark.parametrize("kw, match", [
    ({"outputs": "gpu"}, r"unknown outputs 'gpu'"),
    ({"outputs": None}, r"unknown outputs None"),
    ({"donate_argnums": -1}, r"-1 in -1 is not a non-negative"),
    ({"donate_argnums": "0"}, r"'0' in '0' is not a non-negative"),
    ({"donate_argnums": 1.5}, r"donate_argnums must be an int or a sequence"),
    ({"donate_argnums": (0, True)}, r"True in \(0, True\)"),
])
def test_options_are_checked(kw, match):
    with pytest.raises(PlanError, match=match):
        eins.distribute(sgd, devices=2, **kw)


def test_donating_an_argument_the_call_lacks_is_named():
    f = eins.distribute(sgd, devices=2, outputs="devices", donate_argnums=(0, 2))
    with pytest.raises(TraceError, match=r"donate_argnums=\(0, 2\): the call has 2 positional"):
        f(W, X)


def test_cover_tiles_a_box_from_the_blocks_and_names_a_gap():
    layout = [(0, Box((0, 0), (2, 4))), (1, Box((2, 0), (4, 4)))]
    pieces = cover(layout, Box((1, 1), (3, 3)))
    assert [(p.holder, p.box) for p in pieces] == [(0, Box((1, 1), (2, 3))),
                                                   (1, Box((2, 1), (3, 3)))]
    with pytest.raises(LoweringError, match="do not cover"):
        cover(layout[:1], Box((1, 1), (3, 3)))
    assert cover([(0, Box((), ()))], Box((), ()))[0].holder == 0   # a 0-d array
