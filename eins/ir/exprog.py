"""ExProg (Section 5.2): the exchange-program language. Frozen AST, parser, printer and the
semantics of Definition 5.5.

AST (fixed; the parser, printer, semantics, simulator and synthesizer all share it):

- an *aggregate* is a ``frozenset[str]`` of atom names (``A+B`` == ``B+A``);
- a *site* is an ``int`` GPU id; a *target* is a site or a partition name (``str``);
- ``Action(agg, source, hops)``: ``X @ s`` has ``hops == ()``; ``X @ s -> 1, 2`` has
  ``hops == ((1, 2),)``; the relay ``X @ s -> r -> d`` has ``hops == ((r,), (d,))``. ``source``
  may be a partition name (``X @ G1``: aggregate at every site of G1, no transfer).

Concrete syntax (what :func:`parse` reads and :func:`to_text` writes)::

    # comments run to the end of the line
    GPUS: 0, 1, 2, 3, 4, 5, 6, 7              # optional: inferred from the sites used
    PARTITIONS: G1 {size 4}; G2 {2, 3, 6, 7}  # optional; by size or by members
    IN: A @ 0 (size: 0.5 GB); B @ 1           # sizes in GB/MB/KB/B (10^9/10^6/10^3/1); default 1 GB
    OUT: A+B @ 0, 1; A @ G1
    A @ 0 -> 1; B @ 1 -> 0                    # the body: actions, separated by ';' or newlines
    A+B @ 0, 1                                # shorthand for the two actions A+B @ 0 and A+B @ 1
    A @ 0 -> 2 -> 3                           # relay through 2

Layout: the sections come first. A section continues onto the next line when that line is
indented deeper than the section's header line, when the line before ends with ``;``, ``,``
or the header's ``:``, or (GPUS/PARTITIONS) when the line can only be a site list / a
partition; the line break then separates two entries. Any other line after the sections
starts the body. (IN and OUT entries look like actions, so the body cannot be told from a
section without such a rule.) Several sections may share one line
(``IN: A @ 0; B @ 1 OUT: A+B @ 0``).

Semantics (Definition 5.5): :func:`closure`, :func:`is_valid`, :func:`check`.
"""
from __future__ import annotations

import itertools
import re
from collections import defaultdict, deque
from dataclasses import dataclass
from fractions import Fraction

from eins.errors import ExProgError, ExProgSyntaxError

GB = 10**9  # ExProg sizes are decimal gigabytes
MB = 10**6
KB = 10**3
_UNITS = {"GB": GB, "MB": MB, "KB": KB, "B": 1}


@dataclass(frozen=True, slots=True)
class Partition:
    """``G1 {size 4}`` (members None: chosen by the compiler) or ``G1 {0, 1, 4, 5}``."""

    name: str
    size: int
    members: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class AtomDecl:
    """``A @ 0 (size: 1.0 GB)``; ``size`` in bytes."""

    name: str
    site: int
    size: int = GB


@dataclass(frozen=True, slots=True)
class Requirement:
    """``A+B @ 0, 1`` or ``A+B @ G1`` in OUT."""

    agg: frozenset
    targets: tuple  # of int sites and str partition names


@dataclass(frozen=True, slots=True)
class Action:
    agg: frozenset
    source: object  # int site, or str partition name
    hops: tuple = ()  # tuple of tuples of int sites

    def __str__(self):
        return format_action(self)


@dataclass(frozen=True, slots=True)
class ExProg:
    gpus: tuple[int, ...]
    partitions: tuple[Partition, ...]
    inputs: tuple[AtomDecl, ...]
    outputs: tuple[Requirement, ...]
    actions: tuple[Action, ...] = ()

    def __str__(self):
        return to_text(self)


# ----------------------------------------------------------------------------------------
# Small helpers shared with the simulator and the synthesizer


def agg_text(agg) -> str:
    """An aggregate as ExProg writes it: atom names sorted, joined by ``+``."""
    return "+".join(sorted(agg))


def atom_sizes(prog: ExProg) -> dict[str, int]:
    """Bytes per atom name (an atom declared at several sites has one size)."""
    return {d.name: d.size for d in prog.inputs}


def agg_size(prog_or_sizes, agg) -> int:
    """Bytes of an aggregate: ``⊕`` keeps the shape, so it is the size of any of its atoms
    (the largest, should a hand-written program disagree)."""
    sizes = prog_or_sizes if isinstance(prog_or_sizes, dict) else atom_sizes(prog_or_sizes)
    return max(sizes[a] for a in agg)


def format_size(nbytes: int) -> str:
    """Exact decimal text of a byte count (``0.5 GB``, ``2.0 KB``, ``7 B``): the shortest
    exact form, preferring the larger unit, so that parsing it gives ``nbytes`` back."""
    best = f"{nbytes} B"
    for name in ("KB", "MB", "GB"):
        unit = _UNITS[name]
        whole, rest = divmod(nbytes, unit)
        digits = len(str(unit)) - 1
        frac = str(rest).rjust(digits, "0").rstrip("0") or "0"
        text = f"{whole}.{frac} {name}"
        if len(text) <= len(best):
            best = text
    return best


def format_action(a: Action) -> str:
    """``A+B @ 0 -> 1, 2 -> 3``."""
    text = f"{agg_text(a.agg)} @ {a.source}"
    for hop in a.hops:
        text += " -> " + ", ".join(str(d) for d in hop)
    return text


def format_requirement(r: Requirement) -> str:
    return f"{agg_text(r.agg)} @ " + ", ".join(map(str, r.targets))


def format_atom(d: AtomDecl) -> str:
    text = f"{d.name} @ {d.site}"
    if d.size != GB:
        text += f" (size: {format_size(d.size)})"
    return text


def format_partition(p: Partition) -> str:
    if p.members is None:
        return f"{p.name} {{size {p.size}}}"
    return f"{p.name} {{" + ", ".join(str(m) for m in p.members) + "}"


def fill_membership(prog: ExProg, membership) -> ExProg:
    """``prog`` with every partition named in ``membership`` declared by those members
    (e.g. the result of :func:`check`), so the printed program records the placement."""
    parts = tuple(Partition(p.name, p.size, tuple(membership[p.name]))
                  if p.name in membership else p for p in prog.partitions)
    return ExProg(prog.gpus, parts, prog.inputs, prog.outputs, prog.actions)


def destinations(a: Action) -> tuple[int, ...]:
    """Every site on every hop, first-seen order: all of them receive ``a.agg``."""
    return tuple(dict.fromkeys(d for hop in a.hops for d in hop))


# ----------------------------------------------------------------------------------------
# Printer

_WIDTH = 96


def _section(header: str, items: list[str], sep: str) -> list[str]:
    """One section, wrapped: continuation lines are indented (and end with the separator)
    so the parser's layout rule reads them back as the same section."""
    lines, cur = [], header
    for k, item in enumerate(items):
        piece = item + (sep if k + 1 < len(items) else "")
        if cur.strip() and cur != header and len(cur) + 1 + len(piece) > _WIDTH:
            lines.append(cur.rstrip())
            cur = "   "
        cur += " " + piece
    lines.append(cur.rstrip())
    return lines


def to_text(prog: ExProg) -> str:
    """Deterministic ExProg text; ``parse(to_text(p)) == p`` for every well-declared p."""
    lines = _section("GPUS:", [str(g) for g in prog.gpus], ",")
    if prog.partitions:
        lines += _section("PARTITIONS:", [format_partition(p) for p in prog.partitions], ";")
    lines += _section("IN:", [format_atom(d) for d in prog.inputs], ";")
    lines += _section("OUT:", [format_requirement(r) for r in prog.outputs], ";")
    # Consecutive local aggregations of one aggregate print as one line (``A+B @ 0, 1``);
    # the parser expands that back into the same actions in the same order.
    acts = prog.actions
    i = 0
    while i < len(acts):
        a = acts[i]
        j = i + 1
        if not a.hops:
            while j < len(acts) and not acts[j].hops and acts[j].agg == a.agg:
                j += 1
        if j - i > 1:
            lines.append(f"{agg_text(a.agg)} @ " + ", ".join(str(b.source) for b in acts[i:j]))
        else:
            lines.append(format_action(a))
        i = j
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------
# Lexer

_KEYWORDS = ("GPUS", "PARTITIONS", "IN", "OUT")
_TOKEN_RE = re.compile(
    r"(?P<ws>[ \t\r\f\v]+)"
    r"|(?P<comment>\#.*)"
    r"|(?P<num>\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)"
    r"|(?P<name>[A-Za-z_][A-Za-z0-9_.]*)"
    r"|(?P<punct>->|[@+,;:{}()])"
)


@dataclass(frozen=True, slots=True)
class _Tok:
    kind: str  # 'num', 'name', a punctuation string, 'NL' or 'EOF'
    text: str
    line: int
    col: int


def _describe(tok: _Tok) -> str:
    if tok.kind == "EOF":
        return "end of input"
    if tok.kind == "NL":
        return "end of line"
    if tok.kind == "name":
        return f"name '{tok.text}'"
    if tok.kind == "num":
        return f"number {tok.text}"
    return f"'{tok.text}'"


def _lex_line(line: str, lineno: int) -> list[_Tok]:
    toks, pos = [], 0
    while pos < len(line):
        m = _TOKEN_RE.match(line, pos)
        if m is None:
            raise ExProgSyntaxError(f"unexpected character {line[pos]!r}", lineno, pos + 1)
        kind = m.lastgroup
        if kind == "comment":
            break
        if kind != "ws":
            text = m.group()
            toks.append(_Tok(text if kind == "punct" else kind, text, lineno, pos + 1))
        pos = m.end()
    return toks


def _is_header(toks, k) -> bool:
    return (k + 1 < len(toks) and toks[k].kind == "name" and toks[k].text in _KEYWORDS
            and toks[k + 1].kind == ":")


def _lex(text: str) -> list[_Tok]:
    """Tokens with an 'NL' token wherever a line break ends a section or a body statement
    (the layout rule of the module docstring)."""
    out: list[_Tok] = []
    header_indent = None  # indent of the line holding the open section's header
    section = None  # keyword of the open section; None once the body has started
    lines = text.split("\n")
    for lineno, raw in enumerate(lines, 1):
        toks = _lex_line(raw, lineno)
        if not toks:
            continue
        indent = len(raw.expandtabs(8)) - len(raw.expandtabs(8).lstrip())
        if out:
            cont = False
            if section is not None and not _is_header(toks, 0):
                cont = (out[-1].kind in (";", ",", ":") or indent > header_indent
                        or (section == "GPUS" and toks[0].kind == "num")
                        or (section == "PARTITIONS" and len(toks) > 1
                            and toks[0].kind == "name" and toks[1].kind == "{"))
            if cont and out[-1].kind not in (";", ",", ":"):
                # the line break separates the entries of the continued section
                prev = out[-1]
                out.append(_Tok("," if section == "GPUS" else ";", "", prev.line,
                                prev.col + len(prev.text)))
            if not cont:
                prev = out[-1]
                out.append(_Tok("NL", "", prev.line, prev.col + len(prev.text)))
                if not _is_header(toks, 0):
                    section = None
        for k in range(len(toks)):
            if _is_header(toks, k):
                section, header_indent = toks[k].text, indent
        out.extend(toks)
    if out:  # end of input: just after the last token
        out.append(_Tok("EOF", "", out[-1].line, out[-1].col + len(out[-1].text)))
    else:
        out.append(_Tok("EOF", "", 1, 1))
    return out


# ----------------------------------------------------------------------------------------
# Parser


class _Parser:
    def __init__(self, text: str):
        self.toks = _lex(text)
        self.i = 0
        # where each name/site was used, for static checks with positions
        self.site_uses: list[tuple[int, _Tok]] = []
        self.atom_uses: list[tuple[str, _Tok]] = []
        self.part_uses: list[tuple[str, _Tok]] = []

    # -- token helpers
    def peek(self, k=0) -> _Tok:
        return self.toks[min(self.i + k, len(self.toks) - 1)]

    def next(self) -> _Tok:
        tok = self.peek()
        self.i += 1
        return tok

    def fail(self, tok: _Tok, msg: str):
        raise ExProgSyntaxError(msg, tok.line, tok.col)

    def expect(self, kind: str, what: str) -> _Tok:
        tok = self.peek()
        if tok.kind != kind:
            self.fail(tok, f"expected {what}, found {_describe(tok)}")
        return self.next()

    def at_header(self) -> bool:
        return _is_header(self.toks, self.i)

    def at_end_of_section(self) -> bool:
        return self.peek().kind in ("NL", "EOF") or self.at_header()

    # -- pieces
    def site(self, what: str, record: bool = True) -> int:
        tok = self.peek()
        if tok.kind != "num" or not tok.text.isdigit():
            self.fail(tok, f"expected {what} (a GPU number), found {_describe(tok)}")
        self.next()
        if record:  # uses outside GPUS itself must be declared GPUs
            self.site_uses.append((int(tok.text), tok))
        return int(tok.text)

    def target(self, what: str):
        tok = self.peek()
        if tok.kind == "name" and not self.at_header():
            self.next()
            self.part_uses.append((tok.text, tok))
            return tok.text
        if tok.kind == "num" and tok.text.isdigit():
            return self.site(what)
        self.fail(tok, f"expected {what} (a GPU number or a partition name), "
                       f"found {_describe(tok)}")

    def aggregate(self, where: str) -> frozenset:
        atoms: list[str] = []
        while True:
            tok = self.peek()
            if tok.kind != "name" or self.at_header():
                what = "an atom name" + (" after '+'" if atoms else f" {where}")
                self.fail(tok, f"expected {what}, found {_describe(tok)}")
            self.next()
            if tok.text in atoms:
                self.fail(tok, f"atom '{tok.text}' appears twice in one aggregate "
                               f"(an aggregate is a set of atoms)")
            atoms.append(tok.text)
            self.atom_uses.append((tok.text, tok))
            if self.peek().kind != "+":
                return frozenset(atoms)
            self.next()

    def comma_list(self, item, first: str, rest: str) -> list:
        """``item(first)``, then ``item(rest)`` after each ','."""
        items = [item(first)]
        while self.peek().kind == ",":
            self.next()
            items.append(item(rest))
        return items

    # -- sections
    def gpus(self) -> list[int]:
        sites = self.comma_list(lambda what: self.site(what, record=False),
                                "a site after 'GPUS:'", "a site after ','")
        if not self.at_end_of_section():
            self.fail(self.peek(), f"expected ',' or end of line in GPUS, "
                                   f"found {_describe(self.peek())}")
        return sites

    def partitions(self) -> list[tuple[Partition, _Tok]]:
        parts = []
        while True:
            name = self.peek()
            if name.kind != "name" or self.at_header():
                self.fail(name, f"expected a partition name, found {_describe(name)}")
            self.next()
            self.expect("{", f"'{{' after partition name '{name.text}'")
            tok = self.peek()
            if tok.kind == "name" and tok.text == "size":
                self.next()
                if self.peek().kind == ":":
                    self.next()
                n = self.peek()
                if n.kind != "num" or not n.text.isdigit() or int(n.text) == 0:
                    self.fail(n, f"expected a positive whole partition size after 'size', "
                                 f"found {_describe(n)}")
                self.next()
                part = Partition(name.text, int(n.text))
            else:
                members = self.comma_list(
                    self.site, f"a member site or 'size' in partition '{name.text}'",
                    "a member site after ','")
                seen = set()
                for m in members:
                    if m in seen:
                        self.fail(tok, f"site {m} is listed twice in partition '{name.text}'")
                    seen.add(m)
                part = Partition(name.text, len(members), tuple(members))
            self.expect("}", f"',' or '}}' in partition '{name.text}'")
            parts.append((part, name))
            if self.peek().kind in (";", ","):
                self.next()
            if self.at_end_of_section():
                return parts

    def inputs(self) -> list[tuple[AtomDecl, _Tok]]:
        decls = []
        while True:
            name = self.peek()
            if name.kind != "name" or self.at_header():
                self.fail(name, f"expected an atom name in IN, found {_describe(name)}")
            self.next()
            at = self.peek()
            if at.kind != "@":
                self.fail(at, f"expected '@' after atom '{name.text}' in IN (an IN entry "
                              f"places one atom at one site), found {_describe(at)}")
            self.next()
            site = self.site(f"a site for atom '{name.text}'")
            size = GB
            if self.peek().kind == "(":
                size = self.size_clause(name.text)
            decls.append((AtomDecl(name.text, site, size), name))
            if self.at_end_of_section():
                return decls
            if self.peek().kind != ";":
                self.fail(self.peek(), f"expected ';', '(size: ...)' or end of line after IN "
                                       f"entry '{name.text} @ {site}', "
                                       f"found {_describe(self.peek())}")
            self.next()
            if self.at_end_of_section():
                return decls

    def size_clause(self, atom: str) -> int:
        self.next()  # '('
        kw = self.peek()
        if kw.kind != "name" or kw.text != "size":
            self.fail(kw, f"expected 'size' after '(' for atom '{atom}', found {_describe(kw)}")
        self.next()
        self.expect(":", "':' after 'size'")
        num = self.expect("num", f"a number for the size of atom '{atom}'")
        unit = self.peek()
        if unit.kind != "name" or unit.text.upper() not in _UNITS:
            self.fail(unit, f"expected a unit (GB, MB, KB or B) after {num.text}, "
                            f"found {_describe(unit)}")
        self.next()
        nbytes = round(Fraction(num.text) * _UNITS[unit.text.upper()])
        if nbytes <= 0:
            self.fail(num, f"atom '{atom}' has size {num.text} {unit.text}; sizes must be "
                           f"at least one byte")
        self.expect(")", "')' after the size")
        return nbytes

    def outputs(self) -> list[Requirement]:
        reqs = []
        while True:
            agg = self.aggregate("in OUT")
            self.expect("@", f"'+' or '@' after '{agg_text(agg)}' in OUT")
            targets = self.comma_list(self.target, "a site or partition after '@'",
                                      "a site or partition after ','")
            reqs.append(Requirement(agg, tuple(targets)))
            if self.at_end_of_section():
                return reqs
            tok = self.peek()
            if tok.kind != ";":
                hint = (" (OUT lists requirements; start the body on a new, unindented line)"
                        if tok.kind == "->" else "")
                self.fail(tok, f"expected ';', ',' or end of line after OUT requirement "
                               f"'{format_requirement(reqs[-1])}', found {_describe(tok)}{hint}")
            self.next()
            if self.at_end_of_section():
                return reqs

    # -- body
    def statement(self) -> list[Action]:
        agg = self.aggregate("to start an action")
        self.expect("@", f"'+' or '@' after '{agg_text(agg)}'")
        sources = self.comma_list(self.target, "a source site or partition after '@'",
                                  "a source site or partition after ','")
        hops = []
        while self.peek().kind == "->":
            self.next()
            tok = self.peek()
            if tok.kind == "name":
                self.fail(tok, f"expected a destination site after '->', found "
                               f"{_describe(tok)} (destinations are GPU numbers, not partitions)")
            hop = self.comma_list(self.site, "a destination site after '->'",
                                  "a destination site after ','")
            hops.append(tuple(hop))
        return [Action(agg, s, tuple(hops)) for s in sources]

    def program(self) -> ExProg:
        sec: dict[str, object] = {}
        header_tok: dict[str, _Tok] = {}
        while self.peek().kind == "NL":
            self.next()
        while self.at_header():
            kw = self.next()
            self.next()  # ':'
            if kw.text in sec:
                self.fail(kw, f"section '{kw.text}:' is declared twice")
            header_tok[kw.text] = kw
            if self.at_end_of_section():
                self.fail(self.peek(), f"expected entries after '{kw.text}:', "
                                       f"found {_describe(self.peek())}")
            sec[kw.text] = {"GPUS": self.gpus, "PARTITIONS": self.partitions,
                            "IN": self.inputs, "OUT": self.outputs}[kw.text]()
            while self.peek().kind == "NL":
                self.next()
        for kw in ("IN", "OUT"):
            if kw not in sec:
                self.fail(self.peek(), f"expected an '{kw}:' section before "
                                       f"{_describe(self.peek())}")
        actions: list[Action] = []
        while self.peek().kind != "EOF":
            if self.at_header():
                self.fail(self.peek(), f"section '{self.peek().text}:' must come before the "
                                       f"actions of the body")
            actions += self.statement()
            tok = self.peek()
            if tok.kind not in (";", "NL", "EOF"):
                self.fail(tok, f"expected ';', '->' or end of line after action "
                               f"'{format_action(actions[-1])}', found {_describe(tok)}")
            while self.peek().kind in (";", "NL"):
                self.next()
        return self.build(sec, header_tok, actions)

    # -- static checks, with the position of the offending text
    def build(self, sec, header_tok, actions) -> ExProg:
        decls = sec["IN"]
        parts = sec.get("PARTITIONS", [])
        if "GPUS" in sec:
            gpus = sec["GPUS"]
            seen = set()
            for s in gpus:
                if s in seen:
                    self.fail(header_tok["GPUS"], f"site {s} is listed twice in GPUS")
                seen.add(s)
            for s, tok in self.site_uses:
                if s not in seen:
                    self.fail(tok, f"site {s} is not in GPUS ({', '.join(map(str, gpus))})")
            gpus = tuple(gpus)
        else:
            gpus = tuple(sorted({s for s, _ in self.site_uses}))
        names = {}
        for p, tok in parts:
            if p.name in names:
                self.fail(tok, f"partition '{p.name}' is declared twice")
            names[p.name] = p
        owner = {}
        for p, tok in parts:
            for m in p.members or ():
                if m in owner:
                    self.fail(tok, f"site {m} is in both partition '{owner[m]}' and "
                                   f"partition '{p.name}' (partitions must be disjoint)")
                owner[m] = p.name
        total = sum(p.size for p, _ in parts)
        if total > len(gpus):
            self.fail(header_tok["PARTITIONS"], f"partition sizes add up to {total} but there "
                                                f"are only {len(gpus)} GPUs")
        for name, tok in self.part_uses:
            if name not in names:
                self.fail(tok, f"unknown partition '{name}' (declare it under PARTITIONS:)")
        placed = {}
        for d, tok in decls:
            if (d.name, d.site) in placed:
                self.fail(tok, f"atom '{d.name}' is declared twice at site {d.site}")
            other = next((e for (n, _), e in placed.items() if n == d.name), None)
            if other is not None and other.size != d.size:
                self.fail(tok, f"atom '{d.name}' is declared with two sizes "
                               f"({format_size(other.size)} and {format_size(d.size)})")
            placed[(d.name, d.site)] = d
        known = {d.name for d, _ in decls}
        for name, tok in self.atom_uses:
            if name not in known:
                self.fail(tok, f"unknown atom '{name}' (every atom must be declared in IN)")
        return ExProg(gpus, tuple(p for p, _ in parts), tuple(d for d, _ in decls),
                      tuple(sec["OUT"]), tuple(actions))


def parse(text: str) -> ExProg:
    """Parse ExProg text (Section 5.2). Raises :class:`ExProgSyntaxError` (with line and
    column) on malformed text or on a reference to an undeclared atom, site or partition."""
    return _Parser(text).program()


# ----------------------------------------------------------------------------------------
# Static validation of an AST built in code (the parser does the same with positions)


def validate(prog: ExProg) -> None:
    """Raise :class:`ExProgError` if ``prog`` references undeclared atoms, sites or
    partitions, or declares overlapping partitions (Section 5.2's declaration rules)."""
    gpus = set(prog.gpus)
    if len(gpus) != len(prog.gpus):
        raise ExProgError(f"GPUS lists a site twice: {prog.gpus}")
    names = {}
    owner = {}
    for p in prog.partitions:
        if p.name in names:
            raise ExProgError(f"partition '{p.name}' is declared twice")
        names[p.name] = p
        if p.size < 1:
            raise ExProgError(f"partition '{p.name}' has size {p.size}; sizes are positive")
        if p.members is not None:
            if len(p.members) != p.size or len(set(p.members)) != p.size:
                raise ExProgError(f"partition '{p.name}' has size {p.size} but members "
                                  f"{p.members}")
            for m in p.members:
                if m not in gpus:
                    raise ExProgError(f"site {m} of partition '{p.name}' is not in GPUS")
                if m in owner:
                    raise ExProgError(f"site {m} is in both partition '{owner[m]}' and "
                                      f"partition '{p.name}' (partitions must be disjoint)")
                owner[m] = p.name
    total = sum(p.size for p in prog.partitions)
    if total > len(gpus):
        raise ExProgError(f"partition sizes add up to {total} but there are only "
                          f"{len(gpus)} GPUs")
    sizes = {}
    for d in prog.inputs:
        if d.site not in gpus:
            raise ExProgError(f"atom '{d.name}' is placed at site {d.site}, not in GPUS")
        if d.name in sizes and sizes[d.name] != d.size:
            raise ExProgError(f"atom '{d.name}' is declared with two sizes")
        if d.size <= 0:
            raise ExProgError(f"atom '{d.name}' has size {d.size}; sizes are positive")
        sizes[d.name] = d.size

    def agg_ok(agg, where):
        if not agg:
            raise ExProgError(f"empty aggregate in {where}")
        for a in agg:
            if a not in sizes:
                raise ExProgError(f"unknown atom '{a}' in {where}")

    def target_ok(t, where):
        if isinstance(t, str):
            if t not in names:
                raise ExProgError(f"unknown partition '{t}' in {where}")
        elif t not in gpus:
            raise ExProgError(f"site {t} in {where} is not in GPUS")

    for r in prog.outputs:
        where = f"OUT requirement '{format_requirement(r)}'"
        agg_ok(r.agg, where)
        for t in r.targets:
            target_ok(t, where)
    for a in prog.actions:
        where = f"action '{format_action(a)}'"
        agg_ok(a.agg, where)
        target_ok(a.source, where)
        for hop in a.hops:
            for d in hop:
                if isinstance(d, str) or d not in gpus:
                    raise ExProgError(f"destination {d} in {where} is not a site in GPUS")


# ----------------------------------------------------------------------------------------
# Semantics (Definition 5.5)


def _covers(x: frozenset, present) -> bool:
    """Whether aggregates in ``present`` (a set of frozensets at one site) partition ``x``:
    ``x = Y1 ∪ ... ∪ Ym`` with the ``Yi`` pairwise disjoint (an exact cover)."""
    if x in present:
        return True
    if all(frozenset((a,)) in present for a in x):
        return True  # the common case: every atom present on its own
    cands = [y for y in present if y <= x]
    if not cands or frozenset().union(*cands) != x:
        return False
    by_atom: dict[str, list[frozenset]] = defaultdict(list)
    for y in cands:
        for a in y:
            by_atom[a].append(y)
    failed: set[frozenset] = set()

    def cover(rem: frozenset) -> bool:
        if not rem:
            return True
        if rem in failed:
            return False
        # branch on the atom with fewest candidate aggregates (Knuth's heuristic)
        atom = min(rem, key=lambda a: len(by_atom[a]))
        for y in by_atom[atom]:
            if y <= rem and cover(rem - y):
                return True
        failed.add(rem)
        return False

    return cover(x)


def resolve_membership(prog: ExProg, membership=None) -> dict[str, tuple[int, ...]]:
    """Members of every partition known so far: declared members, then ``membership``."""
    out = {}
    for p in prog.partitions:
        if p.members is not None:
            out[p.name] = p.members
        elif membership and p.name in membership:
            out[p.name] = tuple(membership[p.name])
    return out


class _Run:
    """One worklist evaluation of Definition 5.5's closure.

    ``instances``: one per (action, source site): ``(action index, site, agg, destinations)``;
    an action whose source is a partition has one instance per member site.
    """

    __slots__ = ("present", "fired", "instances", "order")

    def __init__(self, prog: ExProg, members: dict, unknown_sites=None):
        inst = []
        for i, a in enumerate(prog.actions):
            if isinstance(a.source, str):
                sites = members.get(a.source, unknown_sites)
                if sites is None:
                    continue  # membership unknown: the action cannot fire yet
            else:
                sites = (a.source,)
            dests = destinations(a)
            for s in sites:
                inst.append((i, s, a.agg, dests))
        self.instances = inst
        present: dict[int, set] = defaultdict(set)
        waiting: dict[tuple, list[int]] = defaultdict(list)  # (site, atom) -> instances
        for j, (_, s, agg, _) in enumerate(inst):
            for atom in agg:
                waiting[(s, atom)].append(j)
        fired = [False] * len(inst)
        order = []
        queue = deque()

        def add(x, s):
            at = present[s]
            if x not in at:
                at.add(x)
                queue.append((x, s))

        for d in prog.inputs:
            add(frozenset((d.name,)), d.site)
        while queue:
            y, s = queue.popleft()
            # an instance containing y must contain any one atom of y: scan those only
            atom = next(iter(y))
            for j in waiting.get((s, atom), ()):
                if fired[j]:
                    continue
                _, _, x, dests = inst[j]
                if y <= x and _covers(x, present[s]):
                    fired[j] = True
                    order.append(j)
                    add(x, s)
                    for d in dests:
                        add(x, d)
        self.present = present
        self.fired = fired
        self.order = order

    def state(self) -> set:
        return {(x, s) for s, xs in self.present.items() for x in xs}

    def has(self, x, s) -> bool:
        return x in self.present.get(s, ())


def closure(prog: ExProg, membership=None) -> set:
    """The closure ``S*(P)`` of Definition 5.5: the least state containing ``S_IN`` and closed
    under firing enabled actions, as a set of ``(frozenset aggregate, site)``. Actions at a
    partition declared by size and absent from ``membership`` do not fire."""
    return _Run(prog, resolve_membership(prog, membership)).state()


def firing_order(prog: ExProg, membership=None) -> list[tuple[int, int]]:
    """``(action index, source site)`` in an order in which they can fire (each enabled by
    the ones before it); actions that never fire are absent."""
    run = _Run(prog, resolve_membership(prog, membership))
    return [run.instances[j][:2] for j in run.order]


def _problems(prog: ExProg, run: _Run, members: dict, first_only: bool):
    """Definition 5.5's well-formedness then validity, as error messages."""
    out = []
    for j, ok in enumerate(run.fired):
        if not ok:
            i, s, x, _ = run.instances[j]
            out.append(_never_enabled(prog.actions[i], s, x, run))
            if first_only:
                return out
    for r in prog.outputs:
        for t in r.targets:
            sites = (t,) if isinstance(t, int) else members.get(t)
            if sites is None:
                out.append(f"OUT requirement '{format_requirement(r)}' is not met: partition "
                           f"'{t}' has no membership")
                if first_only:
                    return out
                continue
            for s in sites:
                if not run.has(r.agg, s):
                    where = f"site {s}" if isinstance(t, int) else (
                        f"site {s} of partition {t} = {{{', '.join(map(str, sites))}}}")
                    out.append(f"OUT requirement '{format_requirement(r)}' is not met: "
                               f"{agg_text(r.agg)} is never materialized at {where}")
                    if first_only:
                        return out
    return out


def _never_enabled(a: Action, s: int, x: frozenset, run: _Run) -> str:
    present = run.present.get(s, set())
    inside = [y for y in present if y <= x]
    missing = x - frozenset().union(*inside) if inside else x
    at = f" at site {s}" if isinstance(a.source, str) else ""
    head = f"action '{format_action(a)}'{at} is never enabled: "
    if missing:
        return head + (f"atom{'s' if len(missing) > 1 else ''} {', '.join(sorted(missing))} "
                       f"of {agg_text(x)} never reach{'es' if len(missing) == 1 else ''} "
                       f"site {s}")
    held = ", ".join(sorted(agg_text(y) for y in inside))
    return head + (f"the aggregates at site {s} inside {agg_text(x)} ({held}) overlap and "
                   f"never partition it")


def is_valid(prog: ExProg, membership=None) -> bool:
    """Definition 5.5: every action enabled by the closure and every OUT requirement met,
    for the given membership of the partitions declared by size."""
    members = resolve_membership(prog, membership)
    return not _problems(prog, _Run(prog, members), members, first_only=True)


def problems(prog: ExProg, membership=None) -> list[str]:
    """Every reason ``prog`` is invalid under ``membership`` (empty when valid)."""
    members = resolve_membership(prog, membership)
    return _problems(prog, _Run(prog, members), members, first_only=False)


_SEARCH_LIMIT = 200_000  # membership candidates tried before giving up


def check(prog: ExProg, membership=None) -> dict[str, tuple[int, ...]]:
    """A membership for every partition that makes ``prog`` valid (Definition 5.5; a program
    with partitions declared by size is valid when some membership makes it valid, Section
    5.2). Partitions declared by members keep theirs; ``membership`` may fix others. Raises
    :class:`ExProgError` naming the action that is never enabled or the unmet OUT requirement,
    or saying that no membership makes the program valid."""
    validate(prog)
    membership = dict(membership or {})
    byname = {p.name: p for p in prog.partitions}
    for name, sites in membership.items():
        p = byname.get(name)
        if p is None:
            raise ExProgError(f"membership names unknown partition '{name}'")
        sites = tuple(sites)
        if p.members is not None and set(sites) != set(p.members):
            raise ExProgError(f"partition '{name}' is declared as "
                              f"{format_partition(p)[len(name) + 1:]} but membership gives "
                              f"{sites}")
        if len(sites) != p.size or len(set(sites)) != p.size:
            raise ExProgError(f"membership gives partition '{name}' {len(set(sites))} sites "
                              f"{sites}; it has size {p.size}")
        if any(m not in prog.gpus for m in sites):
            raise ExProgError(f"membership of partition '{name}' {sites} is not within GPUS")
    members = resolve_membership(prog, membership)
    used = [m for ms in members.values() for m in ms]
    if len(used) != len(set(used)):
        raise ExProgError(f"partitions overlap in membership {members}")
    unknown = [p for p in prog.partitions if p.name not in members]
    if not unknown:
        errs = _problems(prog, _Run(prog, members), members, first_only=True)
        if errs:
            raise ExProgError(errs[0])
        return members

    free = [g for g in prog.gpus if g not in set(used)]
    cover = sum(p.size for p in prog.partitions) == len(prog.gpus)
    unknown_names = {p.name for p in unknown}
    # Over-approximation: every unknown partition holds every free site. Adding action
    # instances only grows the closure (monotonicity), so what fails here fails for every
    # membership, and a requirement at G can only be met at sites materializing it here.
    over = _Run(prog, members, unknown_sites=tuple(free))
    for j, ok in enumerate(over.fired):
        i, s, x, _ = over.instances[j]
        if not ok and prog.actions[i].source not in unknown_names:
            raise ExProgError(_never_enabled(prog.actions[i], s, x, over))
    for r in prog.outputs:
        for t in r.targets:
            if isinstance(t, str) and t in unknown_names:
                continue
            sites = (t,) if isinstance(t, int) else members[t]
            for s in sites:
                if not over.has(r.agg, s):
                    raise ExProgError(f"OUT requirement '{format_requirement(r)}' is not met: "
                                      f"{agg_text(r.agg)} is never materialized at site {s}")
    cand: dict[str, set] = {p.name: set(free) for p in unknown}
    why: dict[str, list[str]] = {p.name: [] for p in unknown}
    referenced: set[str] = set()
    for r in prog.outputs:
        for t in r.targets:
            if t in cand:
                referenced.add(t)
                ok = {s for s in free if over.has(r.agg, s)}
                size = byname[t].size
                if len(ok) < size:
                    raise ExProgError(
                        f"no membership makes this program valid: OUT requirement "
                        f"'{format_requirement(r)}' is not met: {agg_text(r.agg)} can be "
                        f"materialized {_only_at(ok)}, but partition '{t}' needs "
                        f"{size} site{'s' if size > 1 else ''}")
                cand[t] &= ok
                why[t].append(f"'{format_requirement(r)}' can be met {_only_at(ok)}")
    for j, ok in enumerate(over.fired):
        i, s, x, _ = over.instances[j]
        src = prog.actions[i].source
        if src in cand:
            referenced.add(src)
            if not ok:
                cand[src].discard(s)
    for p in unknown:
        if len(cand[p.name]) < p.size:
            reason = "; ".join(why[p.name] + [f"its actions can be enabled "
                                              f"{_only_at(cand[p.name])}"])
            raise ExProgError(f"no membership makes this program valid: partition "
                              f"'{p.name}' needs {p.size} sites but {reason}")
    # Partitions no requirement or action names cannot affect validity: fill them last.
    search = sorted((p for p in unknown if p.name in referenced),
                    key=lambda p: len(cand[p.name]))
    rest = [p for p in unknown if p.name not in referenced]
    depends = any(isinstance(a.source, str) and a.source in unknown_names
                          for a in prog.actions)
    tried = 0

    def leaf(chosen: dict) -> dict | None:
        nonlocal tried
        left = [g for g in free if all(g not in ms for ms in chosen.values())]
        full = dict(chosen)
        for p in rest:
            full[p.name], left = tuple(left[:p.size]), left[p.size:]
        if cover and left:
            return None
        tried += 1
        mem = {**members, **full}
        # Without actions at unknown partitions the closure does not depend on membership,
        # so the candidate sets are exact and every leaf is valid.
        if not depends or is_valid(prog, mem):
            return mem
        return None

    def node_ok(chosen: dict, taken: set) -> bool:
        """Prune a partial membership: with the unassigned partitions holding every site
        still free (again an over-approximation of any completion's closure), the assigned
        partitions' actions must fire and their requirements must be met."""
        nonlocal tried
        tried += 1
        mem = {**members, **chosen}
        run = _Run(prog, mem, unknown_sites=tuple(g for g in free if g not in taken))
        for j, ok in enumerate(run.fired):
            if not ok and prog.actions[run.instances[j][0]].source in chosen:
                return False
        return all(run.has(r.agg, m) for r in prog.outputs for t in r.targets
                   if t in chosen for m in chosen[t])

    def rec(k: int, chosen: dict, taken: set) -> dict | None:
        if tried > _SEARCH_LIMIT:
            raise ExProgError(f"membership search gave up after {_SEARCH_LIMIT} candidates")
        if k == len(search):
            return leaf(chosen)
        if depends and k > 0 and not node_ok(chosen, taken):
            return None
        if cover and not rest:
            # every free site must end up in a group: prune when one no longer can
            reach = set().union(*(cand[q.name] for q in search[k:]))
            if any(g not in taken and g not in reach for g in free):
                return None
        p = search[k]
        for group in itertools.combinations(sorted(cand[p.name] - taken), p.size):
            got = rec(k + 1, {**chosen, p.name: group}, taken | set(group))
            if got is not None:
                return got
        return None

    found = rec(0, {}, set())
    if found is None:
        detail = "; ".join(w for p in search for w in why[p.name])
        raise ExProgError("no membership makes this program valid"
                          + (f" ({detail})" if detail else ""))
    return {p.name: found[p.name] for p in prog.partitions}


def _only_at(sites) -> str:
    return ("only at {" + ", ".join(str(s) for s in sorted(sites)) + "}") if sites else \
        "at no site"
