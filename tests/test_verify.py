"""The invariant checks of eins.passes.verify, one by one: each test lowers a real program
through eins.distribute, checks that the untouched stage passes, corrupts exactly one thing
in a copy of it and checks that the matching LoweringError fires, naming what is wrong."""
import re
from dataclasses import replace

import numpy as np
import pytest

import eins
from eins.errors import LoweringError
from eins.ir.device import Agg, Concat, Free, Kernel, Load, Recv, Send, Slice, Store
from eins.ir.program import Var
from eins.ir.types import Box, TensorType
from eins.passes.verify import (verify, verify_device, verify_exchanges, verify_plan,
                                verify_program)

S = eins.ShapeDtype
F32 = np.dtype("float32")


def ffn(x, w1, w2):
    return eins.relu(x @ w1) @ w2


@pytest.fixture(scope="module")
def ffn4():
    """ffn on 4 devices under the byte proxy: both matmuls split 2x2 (the second over its
    contraction too), so the output is gathered as a sum of partial copies (sends, receives,
    aggs). The physical Compilation: every stage, already verified once by the pipeline."""
    return eins.distribute(ffn, devices=4, cost="proxy").lower(
        S((8, 4)), S((4, 8)), S((8, 4))).physical


@pytest.fixture(scope="module")
def regrid():
    """relu(x @ w) on 4 devices with the matmul split by rows and columns and the relu by
    rows only: the relu's blocks are cut out of the matmul's (slices) and stitched (concats)."""
    return eins.distribute(lambda x, w: eins.relu(x @ w), devices=4, cost="proxy",
                           plan={0: {"d0": 2, "d1": 2}, 1: {"d0": 4}}).lower(
        S((8, 8)), S((8, 8))).physical


def test_the_stages_pass_untouched(ffn4, regrid):
    """The pipeline's stages satisfy every invariant (the checks below start from these)."""
    for state in (ffn4, regrid):
        verify(state)
        verify_program(state.program)
        verify_plan(state.plan)
        verify_exchanges(state.exchange)
        verify_device(state.device)
    kinds = {ins.kind for code in regrid.device.code.values() for ins in code}
    assert {"slice", "concat", "send", "recv", "kernel", "store"} <= kinds
    assert "agg" in {ins.kind for code in ffn4.device.code.values() for ins in code}


# ------------------------------------------------------------------------------- program
def with_eqn(prog, i, **changes):
    eqns = list(prog.eqns)
    eqns[i] = replace(eqns[i], **changes)
    return replace(prog, eqns=tuple(eqns))


def test_program_reading_an_undefined_variable(ffn4):
    """An eqn reading a variable no earlier eqn (nor an input) defines."""
    prog = ffn4.program
    stray = Var(prog.eqns[1].inputs[0].type)
    with pytest.raises(LoweringError, match=r"^eqn 1 \(relu\) reads an undefined variable$"):
        verify_program(with_eqn(prog, 1, inputs=(stray,)))


def test_program_output_types_off_the_shape_rule(ffn4):
    """An eqn whose output type is not what its primitive's shape rule gives."""
    prog = ffn4.program
    wrong = Var(TensorType((8, 4), np.dtype("float16")))
    bad = replace(with_eqn(prog, 2, outputs=(wrong,)), outputs=(wrong,))
    with pytest.raises(LoweringError, match=re.escape(
            "eqn 2 (matmul): output types [float16[8,4]] differ from the shape rule's "
            "[float32[8,4]]")):
        verify_program(bad)


def test_program_redefining_a_variable(ffn4):
    """SSA: the relu writing the matmul's output again (same type, so only SSA breaks)."""
    prog = ffn4.program
    with pytest.raises(LoweringError, match=r"^eqn 1 \(relu\) redefines a variable$"):
        verify_program(with_eqn(prog, 1, outputs=prog.eqns[0].outputs))


def test_program_output_never_defined(ffn4):
    """A program output that nothing defines."""
    prog = ffn4.program
    with pytest.raises(LoweringError, match="^a program output is never defined$"):
        verify_program(replace(prog, outputs=(Var(prog.outputs[0].type),)))


# ------------------------------------------------------------------------------- plan
def with_spec(plan, i, fspecs):
    eps = list(plan.eqn_plans)
    eps[i] = replace(eps[i], spec=replace(eps[i].spec, fspecs=tuple(fspecs)))
    return replace(plan, eqn_plans=tuple(eps))


def test_plan_eqn_without_a_spec(ffn4):
    """An eqn whose plan entry is missing (None)."""
    plan = ffn4.plan
    eps = list(plan.eqn_plans)
    eps[1] = None
    with pytest.raises(LoweringError, match=r"^eqn 1 \(relu\) has no spec$"):
        verify_plan(replace(plan, eqn_plans=tuple(eps)))


def test_plan_with_fewer_or_more_eqn_plans_than_eqns(ffn4):
    """The last eqn's plan left out (zip once stopped at the shorter list, so the missing
    spec passed), then an extra one."""
    plan = ffn4.plan
    with pytest.raises(LoweringError, match=r"^eqn 2 \(matmul\) has no spec$"):
        verify_plan(replace(plan, eqn_plans=plan.eqn_plans[:-1]))
    with pytest.raises(LoweringError, match="^4 eqn plans for 3 eqns$"):
        verify_plan(replace(plan, eqn_plans=plan.eqn_plans + plan.eqn_plans[:1]))


def test_plan_function_specification_missing_a_block(ffn4):
    """A matmul function specification with one input block (zip once stopped at it, so the
    block never read passed)."""
    plan = ffn4.plan
    fs = list(plan.eqn_plans[0].spec.fspecs)
    fs[2] = replace(fs[2], inputs=fs[2].inputs[:1])
    with pytest.raises(LoweringError, match=re.escape(
            f"eqn 0 (matmul): function specification {fs[2]} has blocks for 1 inputs and 1 "
            f"outputs, the eqn 2 and 1")):
        verify_plan(with_spec(plan, 0, fs))


def test_plan_more_function_specifications_than_devices(ffn4):
    """The 2x2 matmul spec (4 function specifications) on a plan of only 2 devices."""
    with pytest.raises(LoweringError, match=r"^eqn 0 \(matmul\): 4 function specifications "
                                            r"for 2 devices$"):
        verify_plan(replace(ffn4.plan, devices=(0, 1)))


def test_plan_input_block_outside_its_tensor(ffn4):
    """A function specification reading w1[0:4, 0:9] of the (4, 8) weight."""
    plan = ffn4.plan
    fs = list(plan.eqn_plans[0].spec.fspecs)
    fs[1] = replace(fs[1], inputs=(fs[1].inputs[0], Box((0, 0), (4, 9))))
    with pytest.raises(LoweringError, match=re.escape(
            "eqn 0 (matmul) input 1: block [0:4,0:9] is not a projection of shape (4, 8)")):
        verify_plan(with_spec(plan, 0, fs))


def test_plan_outputs_that_do_not_tile(ffn4):
    """Definition 3.6's tiling: an output block missing (two function specifications write
    the same block), then two blocks overlapping (sizes still adding up)."""
    plan = ffn4.plan
    fs = list(plan.eqn_plans[0].spec.fspecs)
    same = fs[:1] + [replace(fs[1], outputs=fs[0].outputs)] + fs[2:]
    with pytest.raises(LoweringError, match=re.escape(
            "eqn 0 (matmul): output 0: blocks ([0:4,0:4], [4:8,0:4], [4:8,4:8]) do not "
            "tile [0:8,0:8]")):
        verify_plan(with_spec(plan, 0, same))
    shifted = fs[:1] + [replace(fs[1], outputs=(Box((0, 3), (4, 7)),))] + fs[2:]
    with pytest.raises(LoweringError, match=re.escape(
            "eqn 0 (matmul): output 0: blocks [0:4,0:4] and [0:4,3:7] overlap")):
        verify_plan(with_spec(plan, 0, shifted))


# ------------------------------------------------------------------------------- exchanges
def with_exchange(xir, n, x, placement=None):
    xs = list(xir.exchanges)
    xs[n] = x
    return replace(xir, exchanges=tuple(xs),
                   placement=xir.placement if placement is None else placement)


def gather(xir):
    """(position, exchange) of the output's gather, the one exchange that moves data."""
    return next((n, x) for n, x in enumerate(xir.exchanges) if x.eqn == -1)


def test_exchange_without_a_program(ffn4):
    """An exchange left with its preamble only (no synthesized body). The verify pass skips
    such a stage (overlay's, before synthesis); verify_exchanges itself refuses it."""
    xir = ffn4.exchange
    x = xir.exchanges[0]
    bad = with_exchange(xir, 0, replace(x, program=None))
    with pytest.raises(LoweringError, match=f"^exchange of {x.var_name} into eqn 1 input 0 "
                                            f"has no program$"):
        verify_exchanges(bad)
    verify(replace(ffn4, exchange=bad))


def test_exchange_copy_off_its_producers_device(ffn4):
    """A copy recorded on another device than the producer's function specification."""
    xir = ffn4.exchange
    n, x = gather(xir)
    cp = x.copies[1]
    moved = replace(cp, device=2)
    bad = replace(x, copies=x.copies[:1] + (moved,) + x.copies[2:])
    with pytest.raises(LoweringError, match=re.escape(
            f"exchange of f into eqn -1 output 0: the copy of block {cp.box} is on device 2 "
            f"but eqn 2's function specification 1 runs on 1")):
        verify_exchanges(with_exchange(xir, n, bad))


def test_exchange_atom_off_its_copy(ffn4):
    """An atom declared at another site than the device holding its copy."""
    xir = ffn4.exchange
    n, x = gather(xir)
    a = x.program.inputs[1]
    prog = replace(x.program, inputs=(x.program.inputs[0], replace(a, site=3))
                   + x.program.inputs[2:])
    with pytest.raises(LoweringError, match=f"atom {a.name} declared at 3 but its copy is on "
                                            f"device {a.site}$"):
        verify_exchanges(with_exchange(xir, n, replace(x, program=prog)))


def test_exchange_program_not_valid(ffn4):
    """Definition 5.5: the gather's body emptied, its OUT requirements are never met."""
    xir = ffn4.exchange
    n, x = gather(xir)
    bad = replace(x, program=replace(x.program, actions=()))
    with pytest.raises(LoweringError, match=r"^exchange of f into eqn -1 output 0: OUT "
                                            r"requirement .* is not met"):
        verify_exchanges(with_exchange(xir, n, bad))


def test_exchange_membership_off_the_consumers_placement(ffn4):
    """The relu's function specifications 0 and 1 swapped between devices 0 and 1 in the
    placement: the exchange into it still delivers block 0 to device 0."""
    xir = ffn4.exchange
    placement = dict(xir.placement)
    placement[1] = (1, 0) + placement[1][2:]
    bad = replace(xir, placement=placement)
    with pytest.raises(LoweringError, match=re.escape(
            "exchange of d into eqn 1 input 0: partition S0 at (0,) but the eqn's function "
            "specification 0 runs on 1")):
        verify_exchanges(bad)


def test_exchange_input_atom_that_is_not_an_atom(ffn4):
    """The program declares an input the exchange has no atom (or copy) for."""
    xir = ffn4.exchange
    n, x = gather(xir)
    a = x.program.inputs[0]
    atoms = {k: v for k, v in x.atoms.items() if k != a.name}
    with pytest.raises(LoweringError, match=f"^exchange of f into eqn -1 output 0: the "
                                            f"program's input atom {a.name} is not one of"):
        verify_exchanges(with_exchange(xir, n, replace(x, atoms=atoms)))
    far = dict(x.atoms)
    far[a.name] = (far[a.name][0], len(x.copies))
    with pytest.raises(LoweringError, match=f"input atom {a.name} is not one of .* with a "
                                            f"copy \\(of {len(x.copies)}\\)$"):
        verify_exchanges(with_exchange(xir, n, replace(x, atoms=far)))


def test_exchange_membership_without_a_needed_partition(ffn4):
    """A consumer's partition missing from the membership."""
    xir = ffn4.exchange
    x = xir.exchanges[0]
    pname = x.needs[0][0]
    members = {k: v for k, v in x.membership.items() if k != pname}
    with pytest.raises(LoweringError, match=re.escape(
            f"exchange of {x.var_name} into eqn 1 input 0: the membership places no partition "
            f"{pname} (function specification 0 needs it)")):
        verify_exchanges(with_exchange(xir, 0, replace(x, membership=members)))


# ------------------------------------------------------------------------------- device
def copy_device(dprog):
    """A copy of the device program whose instruction lists and buffer tables can change."""
    return replace(dprog, code={d: list(c) for d, c in dprog.code.items()},
                   bufs={d: dict(b) for d, b in dprog.bufs.items()})


def find(dprog, kind, pred=lambda d, ins: True):
    """(device, position, instruction) of the first instruction of ``kind``."""
    return next((d, n, ins) for d in dprog.devices for n, ins in enumerate(dprog.code.get(d, []))
                if isinstance(ins, kind) and pred(d, ins))


def test_device_reading_a_buffer_not_live(ffn4):
    """A receive deleted (its buffer never defined), then a buffer freed before its read."""
    dprog = copy_device(ffn4.device)
    d, n, rx = find(dprog, Recv)
    del dprog.code[d][n]
    with pytest.raises(LoweringError, match=rf"^device {d} instruction {n} \(.*\) reads "
                                            rf"{rx.dst}, which is not live$"):
        verify_device(dprog)
    dprog = copy_device(ffn4.device)
    d, n, k = find(dprog, Kernel)
    a = k.ins[0]
    load = next(j for j, ins in enumerate(dprog.code[d]) if a in ins.defs())
    dprog.code[d].insert(load + 1, Free(a))   # the kernel moves to n + 1
    with pytest.raises(LoweringError, match=rf"^device {d} instruction {n + 1} \(.*\) reads "
                                            rf"{a}, which is not live$"):
        verify_device(dprog)


def test_device_slice_outside_its_source(regrid):
    """A slice reaching one row past the block it cuts from."""
    dprog = copy_device(regrid.device)
    d, n, s = find(dprog, Slice)
    src = dprog.bufs[d][s.src].box
    wide = Box(s.box.lo, (src.hi[0] + 1,) + s.box.hi[1:])
    dprog.code[d][n] = replace(s, box=wide)
    with pytest.raises(LoweringError, match=re.escape(f"device {d}: slice {wide} outside "
                                                      f"{src}")):
        verify_device(dprog)


def test_device_concat_parts_not_tiling(regrid):
    """A concat into a block one row larger than its parts."""
    dprog = copy_device(regrid.device)
    d, n, c = find(dprog, Concat)
    big = Box(c.box.lo, (c.box.hi[0] + 1,) + c.box.hi[1:])
    parts = tuple(dprog.bufs[d][s].box for s in c.srcs)
    dprog.code[d][n] = replace(c, box=big)
    with pytest.raises(LoweringError, match=re.escape(
            f"device {d}: concat into {c.dst}: blocks {parts} do not tile {big}")):
        verify_device(dprog)


def test_device_duplicate_send(ffn4):
    """The same transfer (sender, peer, tag) sent twice."""
    dprog = copy_device(ffn4.device)
    d, n, s = find(dprog, Send)
    dprog.code[d].insert(n, s)
    with pytest.raises(LoweringError, match=re.escape(f"duplicate send ({d}, {s.peer}, "
                                                      f"{s.tag})")):
        verify_device(dprog)


def test_device_kernel_input_of_the_wrong_block_or_dtype(ffn4):
    """A kernel input whose buffer holds another dtype, then another block, than the
    function specification needs."""
    dprog = copy_device(ffn4.device)
    d, n, k = find(dprog, Kernel)
    a = k.ins[0]
    info = dprog.bufs[d][a]
    dprog.bufs[d][a] = replace(info, dtype=np.dtype("float16"))
    with pytest.raises(LoweringError, match=re.escape(
            f"device {d}: eqn 0 (matmul) input 0 is {info.box}:float16, needs "
            f"{info.box}:float32")):
        verify_device(dprog)
    dprog.bufs[d][a] = info
    fs = replace(k.fspec, inputs=(Box((0, 0), (4, 3)),) + k.fspec.inputs[1:])
    dprog.code[d][n] = replace(k, fspec=fs)
    with pytest.raises(LoweringError, match=re.escape(
            f"device {d}: eqn 0 (matmul) input 0 is {info.box}:float32, needs "
            f"[0:4,0:3]:float32")):
        verify_device(dprog)


def test_device_kernel_reading_a_partial_block(ffn4):
    """A kernel fed a partial (unaggregated) copy."""
    dprog = copy_device(ffn4.device)
    d, n, k = find(dprog, Kernel)
    dprog.bufs[d][k.ins[1]] = replace(dprog.bufs[d][k.ins[1]], partial=True)
    with pytest.raises(LoweringError, match=rf"^device {d}: eqn 0 input 1 is a partial "
                                            rf"\(unaggregated\) block$"):
        verify_device(dprog)


def test_device_kernel_input_missing(ffn4):
    """A kernel given a literal where its eqn reads a variable."""
    dprog = copy_device(ffn4.device)
    d, n, k = find(dprog, Kernel)
    dprog.code[d][n] = replace(k, ins=(k.ins[0], ("lit", 1.0, F32)))
    with pytest.raises(LoweringError, match=rf"^device {d}: eqn 0 input 1 missing$"):
        verify_device(dprog)


def test_device_storing_a_partial_block(ffn4):
    """A store of a block still partial (its agg marked as a partial copy)."""
    dprog = copy_device(ffn4.device)
    d, n, st = find(dprog, Store)
    dprog.bufs[d][st.src] = replace(dprog.bufs[d][st.src], partial=True)
    with pytest.raises(LoweringError, match=rf"^device {d}: stores a partial block of output "
                                            rf"{st.output}$"):
        verify_device(dprog)


def test_device_sends_and_receives_not_matching(ffn4):
    """A receive waiting on another tag than the send's."""
    dprog = copy_device(ffn4.device)
    d, n, rx = find(dprog, Recv)
    dprog.code[d][n] = replace(rx, tag=rx.tag + 1000)
    with pytest.raises(LoweringError, match=re.escape(
            f"sends and receives do not match: [({rx.peer}, {d}, {rx.tag}), "
            f"({rx.peer}, {d}, {rx.tag + 1000})]")):
        verify_device(dprog)


def test_device_transfer_of_another_block(regrid):
    """A slice cutting (and describing) another atom of its block than the one its send's
    receiver expects."""
    dprog = copy_device(regrid.device)
    sent = {(d, ins.src): ins for d in dprog.devices for ins in dprog.code[d]
            if isinstance(ins, Send)}
    d, n, s = find(dprog, Slice, lambda d, ins: (d, ins.dst) in sent)
    other = next(ins.box for ins in dprog.code[d] if isinstance(ins, Slice) and ins.src == s.src
                 and ins.box != s.box)
    dprog.code[d][n] = replace(s, box=other)
    dprog.bufs[d][s.dst] = replace(dprog.bufs[d][s.dst], box=other)
    send = sent[(d, s.dst)]
    with pytest.raises(LoweringError, match=re.escape(
            f"transfer ({d}, {send.peer}, {send.tag}) sends {other}, receives {s.box}")):
        verify_device(dprog)


def test_device_duplicate_receive(ffn4):
    """The same transfer (sender, peer, tag) received twice, into two buffers: the sets of
    sends and receives still agreed, so the second receive, which never gets its data,
    passed."""
    dprog = copy_device(ffn4.device)
    d, n, rx = find(dprog, Recv)
    dprog.code[d].insert(n + 1, replace(rx, dst=rx.dst + "b"))
    dprog.bufs[d][rx.dst + "b"] = dprog.bufs[d][rx.dst]
    with pytest.raises(LoweringError, match=re.escape(f"duplicate receive ({rx.peer}, {d}, "
                                                      f"{rx.tag})")):
        verify_device(dprog)


def test_device_stored_blocks_not_tiling_an_output(ffn4):
    """An output with one of its two stores deleted (a check of the boxes the lower pass
    recorded, rather than of the stores, would let it pass), then with a block stored
    twice."""
    dprog = copy_device(ffn4.device)
    d, n, st = find(dprog, Store)
    del dprog.code[d][n]
    with pytest.raises(LoweringError, match=re.escape(
            "output 0: stored blocks ([4:8,0:4],) do not tile [0:8,0:4]")):
        verify_device(dprog)
    dprog = copy_device(ffn4.device)
    dprog.code[d].insert(n, st)
    with pytest.raises(LoweringError, match=re.escape(
            "output 0: stored blocks ([0:4,0:4], [0:4,0:4], [4:8,0:4]) do not tile "
            "[0:8,0:4]")):
        verify_device(dprog)


def test_device_store_to_an_output_the_program_lacks(ffn4):
    """A store to output 1 of a one-output program."""
    dprog = copy_device(ffn4.device)
    d, n, st = find(dprog, Store)
    dprog.code[d][n] = replace(st, output=1)
    with pytest.raises(LoweringError, match=rf"^device {d}: stores output 1 of 1$"):
        verify_device(dprog)


def test_device_store_of_another_block_or_variable(ffn4):
    """A store labelled with the other block of the output than its buffer holds, then a
    store whose buffer holds another variable than the output (both passed)."""
    dprog = copy_device(ffn4.device)
    d, n, st = find(dprog, Store)
    other = Box((4, 0), (8, 4))
    dprog.code[d][n] = replace(st, box=other)
    with pytest.raises(LoweringError, match=re.escape(
            f"device {d}: store of {other} but buffer {st.src} holds {st.box}")):
        verify_device(dprog)
    dprog = copy_device(ffn4.device)
    dprog.bufs[d][st.src] = replace(dprog.bufs[d][st.src], var="e")
    with pytest.raises(LoweringError, match=rf"^device {d}: stores a block of e as output 0 "
                                            rf"\(f\)$"):
        verify_device(dprog)


def test_device_concat_of_a_part_twice(regrid):
    """A concat of its first part twice: the sizes add up (the check once compared only
    them), the parts overlap and a part is missing."""
    dprog = copy_device(regrid.device)
    d, n, c = find(dprog, Concat)
    dprog.code[d][n] = replace(c, srcs=(c.srcs[0], c.srcs[0]))
    part = dprog.bufs[d][c.srcs[0]].box
    with pytest.raises(LoweringError, match=re.escape(
            f"device {d}: concat into {c.dst}: blocks {part} and {part} overlap")):
        verify_device(dprog)


def test_device_kernel_with_too_few_inputs(ffn4):
    """A matmul kernel given only its first input (zip once stopped there, so the missing
    one passed)."""
    dprog = copy_device(ffn4.device)
    d, n, k = find(dprog, Kernel)
    dprog.code[d][n] = replace(k, ins=k.ins[:1])
    with pytest.raises(LoweringError, match=re.escape(
            f"device {d}: eqn 0 (matmul) has 2 inputs and 1 outputs, its kernel 1 and 1 for a "
            f"function specification of 2 and 1")):
        verify_device(dprog)


def test_device_kernel_given_another_variables_block(ffn4):
    """The first matmul's operands swapped on device 0, where both are [0:4,0:4] blocks of
    float32: box and dtype agree, only the variable is wrong (this passed)."""
    dprog = copy_device(ffn4.device)
    d, n, k = find(dprog, Kernel, lambda d, ins: d == 0)
    dprog.code[d][n] = replace(k, ins=k.ins[::-1])
    with pytest.raises(LoweringError, match=re.escape(
            "device 0: eqn 0 (matmul) input 0 is a block of b, needs one of a")):
        verify_device(dprog)


# per kind: (the buffer whose table entry is cut short, the block the instruction gives it)
HOLDS = {
    Load: lambda ins, bufs: (ins.dst, ins.box),
    Slice: lambda ins, bufs: (ins.dst, ins.box),
    Kernel: lambda ins, bufs: (ins.outs[0], ins.fspec.outputs[0]),
    Agg: lambda ins, bufs: (ins.srcs[1], bufs[ins.dst].box),   # a source: the result's block
}


@pytest.mark.parametrize("kind", list(HOLDS), ids=lambda k: k.kind)
def test_device_buffer_not_holding_its_instructions_block(ffn4, regrid, kind):
    """The buffer table says another block than the instruction writes (load, slice,
    kernel) or combines (agg). Nothing compared them, and the checks reading the table
    (kernel inputs, transfers, concats) trusted it: a slice cutting another atom than its
    table entry says passed."""
    dprog = copy_device((regrid if kind is Slice else ffn4).device)
    d, n, ins = find(dprog, kind)
    buf, box = HOLDS[kind](ins, dprog.bufs[d])
    held = dprog.bufs[d][buf].box
    wrong = Box(held.lo, (held.hi[0] - 1,) + held.hi[1:])
    dprog.bufs[d][buf] = replace(dprog.bufs[d][buf], box=wrong)
    with pytest.raises(LoweringError, match=re.escape(
            f"device {d}: {ins.kind} of {box} but buffer {buf} holds {wrong}")):
        verify_device(dprog)


def test_device_load_outside_its_tensor(ffn4):
    """A load of rows 0..9 of the (8, 4) input."""
    dprog = copy_device(ffn4.device)
    d, n, ld = find(dprog, Load)
    big = Box((0, 0), (9, 4))
    dprog.code[d][n] = replace(ld, box=big)
    dprog.bufs[d][ld.dst] = replace(dprog.bufs[d][ld.dst], box=big)
    with pytest.raises(LoweringError, match=re.escape(
            f"device {d}: load of {big} outside in0 of shape (8, 4)")):
        verify_device(dprog)
