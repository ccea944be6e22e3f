"""The exchange IR (Section 5.3): for every consumer input, the atoms (cells of the overlay of
the producer's blocks and the consumer's required blocks), the copies of each producer block
and where they live, and an ExProg program that moves and ⊕-aggregates them."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from eins.ir.exprog import ExProg, agg_size
from eins.ir.slots import fast_init
from eins.ir.types import Box, Grid

if TYPE_CHECKING:
    from eins.hardware.topology import Topology
    from eins.ir.plan import Plan


@fast_init
@dataclass(frozen=True, slots=True)
class Copy:
    """One physically existing producer block: produced by function specification ``fspec``
    of the producer, living on ``device``. ``partial`` when ⊕ still has to combine it."""

    box: Box
    device: int
    fspec: int
    partial: bool


def frozen_mapping(m) -> Mapping:
    """A read-only view of a copy of ``m`` (a mapping already read-only is kept as is): the
    exchange IR is shared between passes and, through the overlay cache, between exchanges,
    so nothing may change it in place."""
    return m if isinstance(m, MappingProxyType) else MappingProxyType(dict(m))


@dataclass(frozen=True)
class Exchange:
    """The data movement feeding input ``input`` of eqn ``eqn`` (``eqn == -1``: program
    output ``input``, gathered at its owners for the host), and the inputs (outputs) in
    ``also``: the same variable read again by that eqn in the same blocks (``y * y``;
    ``return y, y``) is delivered once, by the exchange of its first reading. ``serves``:
    later eqns that read the same variable in the same blocks on the same devices (the
    query, key and value projections of one normalized activation under tensor
    parallelism): their inputs read the blocks this exchange delivered, and no exchange of
    their own moves them again (the synthesize pass finds them, :func:`reuse_key`).

    Immutable: the overlay pass builds it with its preamble; the synthesize pass returns a
    copy (``dataclasses.replace``) carrying ``program``, ``membership`` and the predicted
    times. ``atoms`` and ``membership`` are read-only mappings."""

    eqn: int
    input: int
    var_name: str
    producer: int                  # producer eqn index
    out_pos: int                   # which output of the producer
    op: str | None                 # ⊕, None when every block has one copy
    itemsize: int
    grid: Grid                     # the overlay of the producer's and consumer's blocks
    cells: tuple[Box, ...]         # its cells, the atoms' index sets
    copies: tuple[Copy, ...]
    atoms: Mapping[str, tuple[int, int]]   # atom name -> (cell index, copy index)
    needs: tuple[tuple[str, Box], ...]     # per consumer fspec: (partition name, required Box)
    preamble: ExProg               # without body
    program: ExProg | None = None  # with body, after synthesis
    membership: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # partition -> sites
    predicted_s: float | None = None
    naive_s: float | None = None
    also: tuple[int, ...] = ()     # later inputs (outputs) of the eqn this exchange delivers
    serves: tuple[tuple[int, tuple[int, ...]], ...] = ()   # (later eqn, its inputs) delivered

    @property
    def inputs(self) -> tuple[int, ...]:
        """Every input of the eqn (program output, ``eqn == -1``) this exchange delivers."""
        return (self.input,) + self.also

    def inputs_text(self) -> str:
        """``input 0`` / ``inputs 0 and 1`` (``output 0`` / ``outputs 1 and 2`` when ``eqn ==
        -1``): what the exchange text, the demo and the checks name it by."""
        word = "input" if self.eqn >= 0 else "output"
        return f"{word}{'s' if self.also else ''} " + " and ".join(map(str, self.inputs))

    def serves_text(self) -> str:
        """``, also eqn 5 input 0 and eqn 9 input 0`` (empty when it serves no later eqn)."""
        if not self.serves:
            return ""
        return ", also " + " and ".join(
            f"eqn {i} input{'s' if len(ks) > 1 else ''} {' and '.join(map(str, ks))}"
            for i, ks in self.serves)

    def delivered_sites(self) -> tuple[int, ...]:
        """Per consumer function specification, the device its block is delivered to (its
        partition's one member; after synthesis)."""
        return tuple(self.membership[p][0] for p, _ in self.needs)

    def __post_init__(self):
        object.__setattr__(self, "atoms", frozen_mapping(self.atoms))
        object.__setattr__(self, "membership", frozen_mapping(self.membership))

    def sites(self) -> tuple[int, ...]:
        """The devices this exchange's program works on, sorted: each action's source (a
        partition's members) and the sites of its hops (a partition named in a hop: its
        members); an action without hops (a local ⊕) counts its site, which computes it.
        () before synthesis (no program). The predicted schedule's device tracks and the
        GPU-by-GPU time (eins.cost.predict.Timeline) both take an exchange's devices from
        here."""
        if self.program is None:
            return ()
        out = set()

        def add(site):
            out.update(self.membership.get(site, ()) if isinstance(site, str) else (site,))
        for act in self.program.actions:
            add(act.source)
            for hop in act.hops:
                for site in hop:
                    add(site)
        return tuple(sorted(out))

    def local(self, sites) -> bool:
        """Whether nothing moves when consumer function specification f runs on
        ``sites[f]``: each one needs exactly producer copy f's whole block, a single cell
        of the overlay that no other copy holds, on that same device (the token-wise eqns
        of a plan cut alike). Lowering such an exchange emits no instruction: each kernel
        reads its producer's buffer as it is, and its naive body has no action."""
        n = len(self.copies)
        if len(self.needs) != n or len(self.atoms) != n or len(sites) != n:
            return False
        cell = [None] * n   # copy -> the cell of its one atom
        for c, j in self.atoms.values():
            if cell[j] is not None:
                return False
            cell[j] = c
        if len(set(cell)) != n:
            return False
        cells = self.cells
        return all(not cp.partial and cp.device == s and cp.box == block == cells[c]
                   for cp, s, (_, block), c in zip(self.copies, sites, self.needs, cell))

    def local_members(self, members) -> bool:
        """:meth:`local` with consumer function specification f at its partition's one
        member in ``members`` (a membership: partition -> sites); False where one has none
        or several."""
        sites = [members.get(p) for p, _ in self.needs]
        return all(m is not None and len(m) == 1 for m in sites) and \
            self.local([m[0] for m in sites])

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
        size = {a: self.cells[c].size * self.itemsize for a, (c, _) in self.atoms.items()}
        total = 0
        for act in (self.program.actions if self.program is not None else ()):
            nsrc = len(self.membership.get(act.source, (0,))) if isinstance(act.source, str) else 1
            per = agg_size(size, act.agg)  # ⊕ keeps the shape
            total += nsrc * per * sum(len(h) for h in act.hops)
        return total


def reuse_key(x: Exchange) -> tuple:
    """What an exchange delivers, apart from where: the producer's output and the block each
    consumer function specification needs, in order. Two consumer inputs with equal keys
    whose blocks go to the same devices receive the same data: one exchange serves both."""
    return (x.producer, x.out_pos, tuple(b for _, b in x.needs))


@dataclass(frozen=True)
class ExchangeIR:
    """The plan plus every exchange and the placement: ``placement[i][f]`` is the device of
    function specification f of eqn i. The overlay pass builds it with preambles only under
    the naive placement; the synthesize pass returns a new one with every body and the final
    placement."""

    plan: Plan
    placement: Mapping[int, tuple[int, ...]]
    exchanges: tuple[Exchange, ...]
    schedule: str
    topology: Topology | None = None
    _by_eqn: Mapping[int, tuple[Exchange, ...]] = field(init=False, repr=False, compare=False)
    _serving: Mapping[int, tuple] = field(init=False, repr=False, compare=False)
    # what lowering derives from the exchanges alone, the same for every rank (the firing
    # order of each distinct program, each exchange's atoms per copy): built once per
    # process (eins.passes.lower.exchange_schedules), so a rank lowers only its own share
    derived: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "derived", {})
        object.__setattr__(self, "placement", frozen_mapping(self.placement))
        object.__setattr__(self, "exchanges", tuple(self.exchanges))
        by_eqn: dict = {}
        for x in self.exchanges:
            by_eqn.setdefault(x.eqn, []).append(x)
        object.__setattr__(self, "_by_eqn",
                           MappingProxyType({i: tuple(xs) for i, xs in by_eqn.items()}))
        serving: dict = {}
        for x in self.exchanges:
            for i, ks in x.serves:
                serving.setdefault(i, []).append((x, ks))
        object.__setattr__(self, "_serving",
                           MappingProxyType({i: tuple(v) for i, v in serving.items()}))

    def for_eqn(self, i: int) -> tuple[Exchange, ...]:
        """The exchanges feeding eqn i (``-1``: the program outputs'), in input order."""
        return self._by_eqn.get(i, ())

    def serving(self, i: int) -> tuple:
        """(exchange of an earlier eqn, inputs of eqn i) for every input of eqn i that an
        earlier eqn's exchange already delivers (:attr:`Exchange.serves`)."""
        return self._serving.get(i, ())
