"""One home per primitive: outside its op family file (eins/ops, and the models written on
top of them), no code tests a primitive's name. Codegen, runtimes, cost models and
tolerance read the fields of :class:`eins.ir.primitive.Primitive` instead, so a new
primitive needs no edit there (docs/adding-a-primitive.md)."""
from __future__ import annotations

import ast
import pathlib

import pytest

from eins.errors import EinsError
from eins.ir.primitive import PRIMITIVES, unregister

ROOT = pathlib.Path(__file__).resolve().parent.parent / "eins"
ALLOWED = ("ops", "models")   # the op family files, and the models built from them

# an expression that is a primitive's name: ``eqn.prim``, ``x.primitive.name``, or a
# variable called so
_NAMES = {"prim", "prim_name", "primitive"}


def _is_prim(node) -> bool:
    if isinstance(node, ast.Attribute):
        if node.attr == "prim":
            return True
        if node.attr == "name" and isinstance(node.value, ast.Attribute) and \
                node.value.attr == "primitive":
            return True
    return isinstance(node, ast.Name) and node.id in _NAMES


def _strings(node) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(_strings(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        return bool(node.keys) and all(k is not None and _strings(k) for k in node.keys)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
            node.func.attr == "fromkeys":   # dict.fromkeys(["a", "b"], ...)
        return bool(node.args) and _strings(node.args[0])
    return False


def name_tests(source: str, filename: str = "<src>") -> list[str]:
    """Every comparison or membership test of a primitive's name against string literals
    (directly, or a module-level table of them), and every lookup of a primitive's name in
    such a table, as ``file:line: code``."""
    tree = ast.parse(source, filename)
    tables = {t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
              for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
              if isinstance(t, ast.Name) and n.value is not None and _strings(n.value)}

    def literal(node):
        return _strings(node) or (isinstance(node, ast.Name) and node.id in tables)

    out = []
    for n in ast.walk(tree):
        hit = False
        if isinstance(n, ast.Compare):
            sides = [n.left, *n.comparators]
            hit = any(_is_prim(s) for s in sides) and any(literal(s) for s in sides)
        elif isinstance(n, ast.Subscript):
            hit = _is_prim(n.slice) and literal(n.value)
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and \
                n.func.attr == "get" and n.args:
            hit = _is_prim(n.args[0]) and literal(n.func.value)
        if hit:
            out.append(f"{filename}:{n.lineno}: {ast.unparse(n)}")
    return out


def test_no_code_outside_the_op_files_tests_a_primitive_name():
    bad = []
    for p in sorted(ROOT.rglob("*.py")):
        rel = p.relative_to(ROOT)
        if rel.parts[0] in ALLOWED:
            continue
        bad += name_tests(p.read_text(), str(rel))
    assert not bad, "primitive names tested outside eins/ops:\n" + "\n".join(bad)


def test_the_name_scan_catches_each_form():
    src = '''
_STRIDED = {"rope": 1, "attention": 2}
_KINDS = ("matmul", "add")
def f(eqn, prim, e):
    if eqn.prim == "attention":
        pass
    if e.primitive.name in ("rms_norm", "layer_norm"):
        pass
    if prim not in _STRIDED:
        pass
    x = _STRIDED[eqn.prim]
    y = _STRIDED.get(prim)
    if "add" != e.prim or e.prim in _KINDS:
        pass
'''
    lines = [int(g.split(":")[1]) for g in name_tests(src)]
    assert sorted(set(lines)) == [5, 7, 9, 11, 12, 13]
    assert lines.count(13) == 2   # both tests of the line


def test_the_name_scan_passes_field_reads():
    src = '''
NAMES = ("a", "b")
def f(eqn, op):
    if eqn.primitive.residual_epilogue or op == "matmul":
        pass
    if eqn.primitive.expression is not None and eqn.prim in PRIMITIVES:
        pass
    return NAMES[0], render(eqn.prim)
'''
    assert name_tests(src) == []


def test_every_primitive_lives_in_its_op_family_file():
    """Each registered primitive's rules are defined in eins/ops (its family file), and
    each GPU lowering's launcher and fallback too."""
    for name, p in PRIMITIVES.items():
        assert p.abstract.__module__.startswith("eins.ops."), name
        for low in p.lowerings.values():
            for fn in (low.fn, low.fallback, low.partial):
                if fn is not None:
                    assert fn.__module__.startswith("eins.ops."), (name, fn)


def test_unregistering_an_unknown_primitive_names_it():
    with pytest.raises(EinsError, match="unknown primitive 'no_such_op'"):
        unregister("no_such_op")
