"""ExProg parser (paper Section 5.2): lexer and recursive-descent parser of the concrete syntax
described in :mod:`eins.ir.exprog`, with line and column in every error."""
from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from eins.errors import ExProgSyntaxError
from eins.ir.exprog.syntax import (
    _UNITS, GB, MAX_ATOM_BYTES, Action, AtomDecl, ExProg, Partition, Requirement, action_key,
    agg_text, format_action, format_requirement, format_size, hop_fault)

# ----------------------------------------------------------------------------------------
# Lexer

_KEYWORDS = ("GPUS", "PARTITIONS", "IN", "OUT")
_TOKEN_RE = re.compile(
    r"(?P<ws>[ \t\r\f\v]+)"
    r"|(?P<comment>\#.*)"
    # ASCII digits: \d and str.isdigit() take other scripts' ('\u0663' read as site 3)
    r"|(?P<num>[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?|\.[0-9]+(?:[eE][+-]?[0-9]+)?)"
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
    if tok.kind == "NL" or (tok.kind in (",", ";") and not tok.text):
        return "end of line"   # also the separator a continued section's line break makes
    if tok.kind == "name":
        return f"name '{tok.text}'"
    if tok.kind == "num":
        return f"number {tok.text}"
    return f"'{tok.text}'"


MAX_NUMBER_CHARS = 40   # 2**53 bytes is 16 digits; 0.000000001 GB is 11 characters


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
            if kind == "num" and len(text) > MAX_NUMBER_CHARS:
                # int() refuses 4,301+ digits with a bare ValueError; no site, partition
                # size or atom size of a program is that long
                raise ExProgSyntaxError(f"a number of {len(text):,} characters; sites, "
                                        f"partition sizes and atom sizes are at most "
                                        f"{MAX_NUMBER_CHARS}", lineno, pos + 1)
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
        if tok.kind != "num" or not tok.text.isdecimal():
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
        if tok.kind == "num" and tok.text.isdecimal():
            return self.site(what)
        self.fail(tok, f"expected {what} (a GPU number or a partition name), "
                       f"found {_describe(tok)}")

    def aggregate(self, where: str) -> frozenset:
        atoms: set[str] = set()
        while True:
            tok = self.peek()
            if tok.kind != "name" or self.at_header():
                what = "an atom name" + (" after '+'" if atoms else f" {where}")
                self.fail(tok, f"expected {what}, found {_describe(tok)}")
            self.next()
            if tok.text in atoms:
                self.fail(tok, f"atom '{tok.text}' appears twice in one aggregate "
                               f"(an aggregate is a set of atoms)")
            atoms.add(tok.text)
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
                if n.kind != "num" or not n.text.isdecimal() or int(n.text) == 0:
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
        exponent = num.text.lower().partition("e")[2].lstrip("+-").lstrip("0")
        if len(exponent) > 3:   # 1e999999999 would take Fraction minutes to build
            self.fail(num, f"atom '{atom}' has size {num.text} {unit.text}, an exponent of "
                           f"more than three digits; sizes must be from one byte to 2**53 "
                           f"bytes (9 PB)")
        exact = Fraction(num.text) * _UNITS[unit.text.upper()]
        if exact.denominator != 1 and exact >= 1:
            self.fail(num, f"atom '{atom}' has size {num.text} {unit.text}, {float(exact):g} "
                           f"bytes; sizes are whole numbers of bytes")
        nbytes = int(exact)
        if nbytes <= 0:
            self.fail(num, f"atom '{atom}' has size {num.text} {unit.text}; sizes must be "
                           f"at least one byte")
        if nbytes > MAX_ATOM_BYTES:
            self.fail(num, f"atom '{atom}' has size {num.text} {unit.text}; sizes must be at "
                           f"most 2**53 bytes (9 PB), where the simulator's float "
                           f"arithmetic is exact")
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
        hops, dest_toks = [], []

        def dest(what):
            dest_toks.append(self.peek())
            return self.site(what)

        while self.peek().kind == "->":
            self.next()
            tok = self.peek()
            if tok.kind == "name":
                self.fail(tok, f"expected a destination site after '->', found "
                               f"{_describe(tok)} (destinations are GPU numbers, not partitions)")
            hop = self.comma_list(dest, "a destination site after '->'",
                                  "a destination site after ','")
            hops.append(tuple(hop))
        actions = [Action(agg, s, tuple(hops)) for s in sources]
        for a in actions:
            fault = hop_fault(a)
            if fault is not None:
                k, j, why = fault
                self.fail(dest_toks[sum(map(len, hops[:k])) + j],
                          f"in action '{format_action(a)}': {why}")
        return actions

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
        actions: dict[tuple, Action] = {}  # a set (by action_key) that keeps the order
        while self.peek().kind != "EOF":
            if self.at_header():
                self.fail(self.peek(), f"section '{self.peek().text}:' must come before the "
                                       f"actions of the body")
            start = self.peek()
            for a in self.statement():
                if action_key(a) in actions:
                    self.fail(start, f"action '{format_action(a)}' is written twice (a "
                                     f"program is a set of actions)")
                actions[action_key(a)] = a
            tok = self.peek()
            if tok.kind not in (";", "NL", "EOF"):
                last = format_action(next(reversed(actions.values())))
                self.fail(tok, f"expected ';', '->' or end of line after action '{last}', "
                               f"found {_describe(tok)}")
            while self.peek().kind in (";", "NL"):
                self.next()
        return self.build(sec, header_tok, list(actions.values()))

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
        placed, first = {}, {}   # first: an atom's first declaration (a scan was O(n^2))
        for d, tok in decls:
            if (d.name, d.site) in placed:
                self.fail(tok, f"atom '{d.name}' is declared twice at site {d.site}")
            other = first.setdefault(d.name, d)
            if other.size != d.size:
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
