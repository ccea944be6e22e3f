"""Placing the frees of a device program (the lower pass's last step, and a re-lowering's):
each buffer is freed right after its last use."""
from __future__ import annotations

from eins.ir.device import Free, Kernel, Load, Recv, Send, Slice

__all__ = ["insert_frees"]


def insert_frees(dprog) -> None:
    """A Free after each buffer's last use (its definition when never read), on every device
    of ``dprog`` (a device program without frees), in place."""
    # one Free per name for all devices: names are numbered per device, so every device
    # frees "b0", "b1", ..., and an instruction is immutable (a 32-block program frees
    # a million buffers)
    frees = {}
    for d, code in dprog.code.items():
        last = {}
        for n, ins in enumerate(code):
            t = type(ins)   # the transfers first: most of a big program's instructions
            if t is Send and ins.window is None:   # a windowed one reads its table too
                last[ins.src] = n
                continue
            if t is Recv:
                if ins.dst not in last:
                    last[ins.dst] = n
                continue
            if t is Slice:   # reads its source, then writes its destination
                last[ins.src] = n
                if ins.dst not in last:
                    last[ins.dst] = n
                continue
            if t is Kernel:   # Kernel.uses, then its defs, by hand: the rest of the bulk
                for b in ins.ins:
                    if isinstance(b, str):   # not a literal
                        last[b] = n
                if ins.acc is not None:
                    last[ins.acc] = n
                for b in ins.outs:
                    if b not in last:
                        last[b] = n
                continue
            if t is Load:
                if ins.dst not in last:
                    last[ins.dst] = n
                continue
            for b in ins.uses():
                last[b] = n
            for b in ins.defs():
                if b not in last:   # written and never read: freed at once
                    last[b] = n
        # the buffers freed after each instruction: one name, or a list of them
        at = [None] * len(code)
        for b, n in last.items():
            got = at[n]
            if got is None:
                at[n] = b
            elif type(got) is list:
                got.append(b)
            else:
                at[n] = [got, b]
        new = []
        add = new.append
        for ins, bs in zip(code, at):
            add(ins)
            if bs is None:
                continue
            if type(bs) is not list:
                f = frees.get(bs)
                if f is None:
                    f = frees[bs] = Free(bs)
                add(f)
                continue
            bs.sort()
            for b in bs:
                f = frees.get(b)
                if f is None:
                    f = frees[b] = Free(b)
                add(f)
        dprog.code[d] = new
