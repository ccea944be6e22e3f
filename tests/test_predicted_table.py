"""``predicted_time()`` prints as a short table and still reads like the dict it was."""
import json

import numpy as np

import eins
from eins.cost.predicted import PredictedTime
from eins.ir.text import format_bytes


def ffn(x, w1, w2):
    return eins.relu(x @ w1) @ w2


def lowered():
    x, w1, w2 = (eins.ShapeDtype(s, "float32") for s in [(4096, 1024), (1024, 4096),
                                                        (4096, 1024)])
    return eins.distribute(ffn, devices=8, topology="dgx-h100:8").lower(x, w1, w2)


def test_prints_as_a_table_of_its_own_figures():
    t = lowered().predicted_time()
    assert isinstance(t, dict) and isinstance(t, PredictedTime)
    text = str(t)
    assert text == repr(t) and len(text.splitlines()) == 6
    lines = text.splitlines()
    assert lines[0] == "predicted on dgx-h100 (fits in memory)"
    for line, key in zip(lines[1:4], ("compute_ms", "exchange_ms", "total_ms")):
        assert float(line.split()[1]) == round(t[key], 3)
    peaks = t["peak_bytes"]
    assert len(set(peaks.values())) == 1    # even pieces: one figure for devices 0-7
    assert lines[4] == f"  peak memory per device: {format_bytes(peaks[0])} on 0-7"
    # the weights held for the whole call: a figure of its own, above the peak
    placed = t["placed_peak_bytes"]
    assert len(set(placed.values())) == 1 and placed[0] > peaks[0]
    assert lines[5] == f"  with the inputs held on the devices: {format_bytes(placed[0])} on 0-7"


def test_still_reads_like_the_dict():
    t = lowered().predicted_time()
    assert t["total_ms"] == t["compute_ms"] + t["exchange_ms"]
    back = json.loads(json.dumps(t))
    assert back["total_ms"] == t["total_ms"] and len(back["per_eqn"]) == 3
    assert dict(t) == t and set(t) >= {"total_ms", "compute_ms", "exchange_ms", "gather_ms",
                                       "per_eqn", "topology", "peak_bytes", "fits"}


def test_uneven_peaks_are_grouped_by_device():
    t = PredictedTime({"topology": "x", "compute_ms": 1.0, "exchange_ms": 0.5,
                       "gather_ms": 0.25, "total_ms": 1.5, "fits": False,
                       "peak_bytes": {0: 2048, 1: 1024, 2: 2048, 3: 2048, 5: 1024}})
    lines = str(t).splitlines()
    assert lines[0] == "predicted on x (does NOT fit in memory)"
    assert lines[2].endswith("0.500 ms  output gathers 0.250 ms")
    assert lines[4] == "  peak memory per device: 2 KiB on 0,2-3; 1 KiB on 1,5"
    assert np.isclose(t["total_ms"], 1.5)
