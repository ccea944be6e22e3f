"""Readable plans (issue 11): one index naming rule for every operator family (eins.ir.text),
sizes with units, plan= in the printed names, and the marks of every stage explained."""
import re

import numpy as np
import pytest

import eins
from eins.errors import PlanError
from eins.ir.plan import Tuning
from eins.ir.text import format_bytes, format_seconds, sort_key
from eins.models import llama
from helpers import accumulation, assert_close

S = eins.ShapeDtype


@pytest.mark.parametrize("n,text", [(0, "0 B"), (512, "512 B"), (1024, "1 KiB"),
                                    (2560, "2.5 KiB"), (1073807360, "1 GiB"),
                                    (3 * 2 ** 20 + 2 ** 19, "3.5 MiB"), (150 * 2 ** 30, "150 GiB"),
                                    (2 ** 41, "2 TiB"),
                                    # the unit after rounding: never '1024 KiB'
                                    (2 ** 20 - 1, "1 MiB"), (1023, "1023 B")])
def test_sizes_print_in_binary_units(n, text):
    assert format_bytes(n) == text


@pytest.mark.parametrize("t,text", [(0, "0 us"), (0.0011932, "1.193 ms"), (6.87e-06, "6.87 us"),
                                    (2.5, "2.5 s"), (5e-10, "0.5 ns"),
                                    # the unit after rounding: never '1000 ms' or '1000 us'
                                    (0.99996, "1 s"), (0.00099996, "1 ms"), (9.9996e-7, "1 us")])
def test_times_print_with_a_unit_chosen_after_rounding(t, text):
    assert format_seconds(t) == text


def test_printed_names_sort_in_reading_order():
    assert sorted(["r0", "heads_kv", "d1", "d10", "d0", "o1.d0"], key=sort_key) == [
        "d0", "d1", "d10", "heads_kv", "o1.d0", "r0"]


def _planned_names(fn, *args, devices=8, **kw):
    low = eins.distribute(fn, devices=devices, **kw).lower(*args)
    return low, [set(r["splits"]) for r in low.plan_table()]


@pytest.mark.parametrize("name,fn,args", [
    ("rms_norm", lambda x, w: eins.rms_norm(x, w), [S((64, 8)), S((8,))]),
    ("matmul", lambda x, w: x @ w, [S((64, 8)), S((8, 4))]),
    ("rope", lambda x, c, s: eins.rope(x, c, s), [S((64, 8)), S((64, 8)), S((64, 8))]),
    ("add", lambda x, y: x + y, [S((64, 8)), S((64, 8))]),
    ("sum", lambda x: eins.sum(x, 1), [S((64, 8))]),
    ("softmax", lambda x: eins.softmax(x, -1), [S((64, 8))]),
    ("einsum", lambda x, y: eins.einsum("tm,mn->tn", x, y), [S((64, 8)), S((8, 4))]),
    ("transpose", lambda x: x.T.T, [S((64, 8))]),
    ("reshape", lambda x: x.reshape(64, 2, 4), [S((64, 8))]),
    ("slice", lambda x: x[:32], [S((64, 8))]),
])
def test_the_token_axis_has_one_name_in_every_operator_family(name, fn, args):
    """The token axis (dimension 0 of the output, 64 long) is d0 whichever family the eqn
    belongs to: rms_norm's 'a', matmul's 'i' and rope's 'a' used to print as they were."""
    low = eins.distribute(fn, devices=4, plan={0: {"d0": 4}}).lower(*args)
    assert low.plan_table()[0]["splits"] == {"d0": 4}
    assert "split d0/4 -> out 4" in low.as_text("planned")


def test_contracted_and_reduced_indices_are_r_and_kept_words_for_attention():
    low = eins.distribute(lambda a, b: eins.sum(a @ b, 0), devices=4,
                          plan={0: {"r0": 4}, 1: {"r0": 2, "d0": 2}}).lower(S((8, 8)), S((8, 8)))
    rows = low.plan_table()
    assert rows[0]["splits"] == {"r0": 4} and rows[0]["agg"] == 4
    assert rows[1]["splits"] == {"d0": 2, "r0": 2} and rows[1]["agg"] == 2
    text = low.as_text("planned")
    assert "split r0/4 -> out 1x1 blocks, sum of 4 partial copies per block" in text
    q, kv = S((4, 8, 2)), S((2, 8, 2))
    low = eins.distribute(lambda q, k, v: eins.attention(q, k, v), devices=2,
                          plan={0: {"heads_kv": 2}}).lower(q, kv, kv)
    assert low.plan_table()[0]["splits"] == {"heads_kv": 2}


def test_printed_names_never_read_as_variables():
    w = llama.WORKLOADS["1x128K"]
    low = eins.distribute(w.function(llama.PAPER), devices=8).lower(*w(llama.PAPER))
    text = low.as_text("planned")
    variables = set(re.findall(r"\b([a-z]+):f16\[", text))
    splits = re.findall(r"split ((?:\S+/\d+ )+)->", text)
    names = {s.split("/")[0] for line in splits for s in line.split()}
    assert names and not names & variables
    assert names <= {"d0", "d1", "heads_kv"}
    # costs carry units; no bare byte count is left
    assert "cost 39.6 GiB (repartition 2.5 GiB, join 37.1 GiB, aggregation 0 B)" in text
    assert not re.search(r"cost=?\d{4,}", text)


def test_plan_accepts_printed_names_and_the_old_letters():
    def ffn(x, w1, w2):
        return eins.relu(x @ w1) @ w2
    args = [np.random.default_rng(i).standard_normal(s).astype(np.float32)
            for i, s in enumerate([(8, 4), (4, 6), (6, 4)])]
    new = eins.distribute(ffn, devices=4, plan={0: {"d1": 2, "r0": 2}, 2: {"d0": 4}})
    old = eins.distribute(ffn, devices=4, plan={0: {"k": 2, "j": 2}, 2: {"i": 4}})
    assert new.lower(*args).plan_table() == old.lower(*args).plan_table()
    n, depth = accumulation(eins.make_ir(ffn)(*args))
    assert_close(new(*args), eins.jit(ffn)(*args), n=n, depth=depth)


@pytest.mark.parametrize("plan,needle", [
    ({0: {"x": 2}}, r"plan\[0\] \(matmul\): unknown index 'x'; this eqn's indices that can be "
                    r"split are \['d0', 'd1', 'r0'\]"),
    ({0: {"d0": 2, "i": 2}}, r"index 'd0' is given twice \('d0' and 'i'\)"),
    ({1: {"d5": 2}}, r"plan\[1\] \(relu\): unknown index 'd5'.*\['d0', 'd1'\]"),
    ({0: {"d0": 16}}, r"index 'd0' of extent 8 cannot be split into 16 intervals"),
])
def test_plan_errors_name_the_printed_indices(plan, needle):
    def ffn(x, w1, w2):
        return eins.relu(x @ w1) @ w2
    with pytest.raises(PlanError, match=needle):
        eins.distribute(ffn, devices=16, plan=plan).lower(S((8, 4)), S((4, 6)), S((6, 4)))


def test_idle_devices_and_the_device_legend_are_spelled_out():
    low = eins.distribute(lambda x: eins.exp(x), devices=8).lower(S((3, 1)))
    assert "split d0/3 -> out 3x1 blocks, 3 pieces: 5 of 8 devices idle" in low.as_text("planned")
    dev = low.as_text("device")
    assert dev.startswith("# per device") and "name~ is a partial copy" in dev
    assert "#T pair a" in dev and "device 0:" in dev
    assert "B moved" in low.as_text("exchange")
    one = eins.distribute(lambda x: eins.softmax(x, -1), devices=8).lower(S((1, 5)))
    assert "split whole -> out 1x1 blocks, 1 piece: 7 of 8 devices idle" in one.as_text("planned")


def test_attention_plan_errors_list_its_indices_in_one_order():
    """Both plan= errors name attention's splittable words in reading order (the 'not
    shardable' one listed them in the operator's order: heads_kv, sequence, kv_sequence)."""
    q, kv = S((4, 16, 8)), S((2, 16, 8))
    order = r"\['heads_kv', 'kv_sequence', 'sequence'\]"
    for idx in ("head_dim", "heads"):
        with pytest.raises(PlanError, match=order):
            eins.distribute(eins.attention, devices=4, plan={0: {idx: 2}}).lower(q, kv, kv)


def test_counts_of_one_and_scalar_outputs_read_as_english():
    """A scalar output is one block ('-> out - blocks' before), and one cell, one copy or
    one device is singular ('1 cells x up to 1 copies', '<Lowered ... on 1 devices')."""
    # on all three devices (with device subsets a sum this small runs on one)
    low = eins.distribute(lambda a: eins.sum(a), devices=3,
                          tuning=Tuning(device_subsets=False)).lower(S((8, 4)))
    planned = low.as_text("planned")
    assert "split r0/3 -> out 1 block, sum of 3 partial copies per block" in planned
    assert " - blocks" not in planned
    assert "## output 0: b: 1 cell x up to 3 copies, 8 B moved" in low.as_text("exchange")
    one = eins.distribute(lambda a: a * 2, devices=1).lower(S((8, 4)))
    assert "split whole -> out 1x1 blocks |" in one.as_text("planned")
    assert "## output 0: b: 1 cell x up to 1 copy, 0 B moved" in one.as_text("exchange")
    assert repr(one).startswith("<Lowered <lambda> on 1 device, minimized time")
    assert repr(low).startswith("<Lowered <lambda> on 3 devices, minimized time")


def test_stats_peak_bytes_lists_every_device_as_predicted_time_does():
    """stats() left out a device that held nothing (a returned input or a 0-d eqn on 3
    devices), while predicted_time()['peak_bytes'] gives it as 0."""
    x = np.ones((8, 4), np.float32)
    for fn, args in [(lambda a: a, (x,)), (lambda a: a + 1, (np.ones((), np.float32),))]:
        f = eins.distribute(fn, devices=3)
        f(*args)
        want = f.lower(*args).predicted_time()["peak_bytes"]
        assert sorted(want) == [0, 1, 2]
        assert f.stats()["peak_bytes"] == want


# ----------------------------------------------------------------------------- docs
import os  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _doc(name):
    with open(os.path.join(ROOT, "docs", name), encoding="utf-8") as f:
        return f.read()


def test_docs_show_what_eins_prints():
    """docs/stages.md's traced, exchange and device examples are this program's real text
    (the planned lines are shortened there, so their start is compared)."""
    f = eins.distribute(lambda a, b: eins.sum(a @ b, 0), devices=4, cost="proxy")
    low = f.lower(np.ones((8, 8), np.float32), np.ones((8, 8), np.float32))
    doc = _doc("stages.md")
    assert low.as_text("traced") in doc
    assert low.as_text("exchange") in doc
    planned = low.as_text("planned").splitlines()
    assert planned[0] in doc and planned[2] in doc
    assert planned[3].split(" | ")[0] in doc
    device = low.as_text("device").splitlines()
    for line in ("  k3~ = kernel eqn1 k2    # [0:4,0:4] -> [0:4]", "  rx4 = recv dev2 #0",
                 "  ag5 = agg[sum] k3 rx4", "  send k3 -> dev0 #0"):
        assert line in device and line in doc


def test_readme_links_the_docs_and_nothing_outside_the_repository():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert "../" not in readme and "DESIGN.md" not in readme
    for name in ("README.md", "stages.md", "exprog.md", "machines.md"):
        assert f"docs/{name}" in readme and _doc(name)
    assert ".venv/bin/python examples/compare_plans.py" in readme
    machines = _doc("machines.md")
    assert "`dgx-a100:N` for up to 8 devices, beyond that `dgx-a100:Kx8`" in machines
    for dt in eins.ir.types.SUPPORTED_DTYPES:
        assert f"`{eins.ir.types.dtype_name(dt)}`" in machines, dt


def test_readme_states_distributes_signature_as_it_is():
    """The README writes out ``eins.distribute``'s whole signature; every parameter, its
    default and the keyword-only marker must be the function's own (a new option must be
    documented there)."""
    import inspect
    import re
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    m = re.search(r"`eins\.distribute\((.*?)\)`:", readme, re.S)
    assert m, "README lost its eins.distribute(...) signature paragraph"
    written = " ".join(m.group(1).split())
    params = []
    for p in inspect.signature(eins.distribute).parameters.values():
        if p.kind is p.KEYWORD_ONLY and "*" not in params:
            params.append("*")
        params.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    assert written == ", ".join(params).replace("'", '"')
