"""The exchange IR (Section 5.3): for every consumer input, the atoms (cells of the overlay of
the producer's blocks and the consumer's required blocks), the copies of each producer block
and where they live, and an ExProg program that moves and ⊕-aggregates them."""
from __future__ import annotations

from dataclasses import dataclass, field

from eins.ir.types import Box


@dataclass(frozen=True, slots=True)
class Copy:
    """One physically existing producer block: produced by function specification ``fspec``
    of the producer, living on ``device``. ``partial`` when ⊕ still has to combine it."""

    box: Box
    device: int
    fspec: int
    partial: bool


@dataclass
class Exchange:
    """The data movement feeding input ``input`` of eqn ``eqn`` (``eqn == -1``: program
    output ``input``, gathered at its owners for the host)."""

    eqn: int
    input: int
    var_name: str
    producer: int                  # producer eqn index
    out_pos: int                   # which output of the producer
    op: str | None                 # ⊕, None when every block has one copy
    itemsize: int
    grid: object                   # the overlay Grid (eins.ir.types.Grid)
    cells: tuple                   # tuple[Box]: its cells, the atoms' index sets
    copies: tuple                  # tuple[Copy]
    atoms: dict                    # atom name -> (cell index, copy index)
    needs: tuple                   # per consumer fspec: (partition name, required Box)
    preamble: object               # ExProg without body
    program: object = None         # ExProg with body, after synthesis
    membership: dict = field(default_factory=dict)   # partition -> (device,)
    predicted_s: float | None = None
    naive_s: float | None = None

    def cell_aggregates(self) -> list:
        """Per cell c, the aggregate of all its copies (the fully ⊕-combined atom)."""
        groups: dict = {}
        for a, (c, _) in self.atoms.items():
            groups.setdefault(c, []).append(a)
        # most cells of a large overlay hold no atom: share one empty aggregate
        empty = frozenset()
        return [frozenset(groups[c]) if c in groups else empty for c in range(len(self.cells))]

    def bytes_moved(self) -> int:
        """Bytes the program's transfers carry (every destination of every hop)."""
        from eins.ir.exprog import agg_size

        size = {a: self.cells[c].size * self.itemsize for a, (c, _) in self.atoms.items()}
        total = 0
        for act in (self.program.actions if self.program is not None else ()):
            nsrc = len(self.membership.get(act.source, (0,))) if isinstance(act.source, str) else 1
            per = agg_size(size, act.agg)  # ⊕ keeps the shape
            total += nsrc * per * sum(len(h) for h in act.hops)
        return total


@dataclass
class ExchangeIR:
    """The plan plus every exchange and the final placement: ``placement[i][f]`` is the
    device of function specification f of eqn i."""

    plan: object
    placement: dict
    exchanges: list
    schedule: str
    topology: object = None

    def __post_init__(self):
        self._by_eqn = {}
        for x in self.exchanges:
            self._by_eqn.setdefault(x.eqn, []).append(x)

    def for_eqn(self, i: int) -> list:
        """The exchanges feeding eqn i (``-1``: the program outputs'), built once."""
        return self._by_eqn.get(i, [])
