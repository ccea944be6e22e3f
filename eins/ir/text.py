"""The words and units of the printed stages (see docs/stages.md): index names and sizes.

**Index names.** Operators name their indices internally as they like (signatures use one
letter per dimension: ``ij,jk->ik``); those letters differ between operator families and
clash with variable names. Printed plans, ``plan_table()`` and ``plan=`` use one rule for
every operator instead, computed here from the operator's :class:`~eins.ir.joinagg.Indexing`:

- ``d0``, ``d1``, ...: the index that runs along dimension 0, 1, ... of the eqn's output
  (of output j > 0: ``o1.d0``, ...), whatever the operator calls it;
- ``r0``, ``r1``, ...: the indices that appear in no output (contracted or reduced, and
  aggregated with ⊕ when split), in the operator's order;
- a name the operator gives in words (attention's ``batch``, ``heads_kv``, ``sequence``,
  ``head_dim``) is kept: it already says what the axis is.

Variables are named with letters only (``a``, ``b``, ..., ``aa``), so a printed index name,
which has a digit or is a word with ``_``, never reads as a variable.

**Sizes.** Byte counts print in binary units (B, KiB, MiB, GiB, TiB) with three significant
digits; times in ms.
"""
from __future__ import annotations

from eins.errors import PlanError
from eins.ir.program import eqn_indexing


def index_names(ix) -> dict[str, str]:
    """{operator's index name: printed name} for one Indexing (rule above)."""
    if ix.dims is None:
        return {n: n for n in ix.extents}
    out, r = {}, 0
    for n in ix.extents:
        where = ix.dims.get(n)
        if len(n) > 1:
            out[n] = n
        elif where is None:
            out[n] = f"r{r}"
            r += 1
        else:
            j, d = where
            out[n] = f"d{d}" if j == 0 else f"o{j}.d{d}"
    return out


def sort_key(printed: str):
    """Printed index names in reading order: output dims d0, d1, ..., then the operator's
    words, other outputs' dims, and the reduced r0, r1, ... last."""
    head, digits = printed[:1], printed[1:]
    if head in "dr" and digits.isdigit():
        return (0 if head == "d" else 3, int(digits), printed)
    return (2 if printed.startswith("o") and "." in printed else 1, 0, printed)


def eqn_index_names(eqn) -> dict[str, str]:
    """:func:`index_names` of an eqn's operator on its types."""
    return index_names(eqn_indexing(eqn))


def resolve_index(name, names: dict[str, str], shardable, where: str) -> str:
    """The operator's own name for index ``name`` given in ``plan=``: a printed name
    (``d0``, ``r0``, ``heads_kv``) or, for older code, the operator's letter. Anything else
    is a PlanError listing the valid printed names of this eqn."""
    printed = {p: n for n, p in names.items()}
    if name in printed:
        return printed[name]
    if name in names:
        return name
    valid = sorted((names[n] for n in names if n in shardable), key=sort_key) \
        or ["(none: never split)"]
    raise PlanError(f"{where}: unknown index {name!r}; this eqn's indices that can be split "
                    f"are {valid}")


def format_seconds(t) -> str:
    """``0.0011932`` -> ``'1.193 ms'``; ``6.87e-06`` -> ``'6.87 us'``; 4 significant digits.
    The unit is chosen after rounding (``0.99996`` is ``'1 s'``, not ``'1000 ms'``); under a
    microsecond in ns, and 0 is ``'0 us'``."""
    t = float(t)
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(float(f"{t / scale:.4g}")) >= 1:
            return f"{t / scale:.4g} {unit}"
    return "0 us" if t == 0 else f"{t / 1e-9:.4g} ns"


def format_bytes(n) -> str:
    """``1073807360`` -> ``'1 GiB'``; under 1 KiB in bytes (``'512 B'``). The unit is chosen
    after rounding (``1048575`` is ``'1 MiB'``, not ``'1024 KiB'``)."""
    n = float(n)
    for unit, scale in (("TiB", 2 ** 40), ("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        v = n / scale
        text = f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        if abs(float(text)) >= 1:
            return f"{text} {unit}"
    return f"{n:.0f} B"
