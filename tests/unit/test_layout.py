"""The package's form: no function over 60 lines and no class over 250 outside the MMHM engine, held with room (10 %
under each: issue 38), and no record of more than three fields built by position."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[2] / "topocallbacks"
EXEMPT_FILES = {"mmhm/engine.py"}  # the MMHM engine's incremental state machine (docs/architecture.md)
FUNCTION_LINES, CLASS_LINES = 60, 250
#: The limits hold with room: a module that grows by a few lines does not have to be split on the spot.
ROOM = 0.9


def sizes():
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path.relative_to(PACKAGE).as_posix(), node, node.end_lineno - node.lineno + 1


def test_no_class_over_250_lines_and_no_function_over_60_with_room():
    found = list(sizes())
    assert len(found) > 100  # the walk saw the package
    too_long = [
        f"{where}: {node.name} ({lines} lines)"
        for where, node, lines in found
        if where not in EXEMPT_FILES
        and lines > ROOM * (CLASS_LINES if isinstance(node, ast.ClassDef) else FUNCTION_LINES)
    ]
    assert too_long == []


def record_fields(trees):
    """The field names of the package's records (dataclasses and named tuples), by class name."""
    fields = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            marks = [ast.unparse(d) for d in node.decorator_list] + [ast.unparse(b) for b in node.bases]
            if any("dataclass" in m or m.endswith("NamedTuple") for m in marks):
                fields[node.name] = [
                    b.target.id for b in node.body if isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name)
                ]
    return fields


def positional_records(trees, fields):
    for where, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and len(node.args) > 3:
                name = getattr(node.func, "id", getattr(node.func, "attr", None))
                if name in fields:
                    yield f"{where}:{node.lineno}: {name} with {len(node.args)} positional arguments"


def test_no_record_of_more_than_three_fields_is_built_by_position():
    trees = {p.relative_to(PACKAGE).as_posix(): ast.parse(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}
    fields = record_fields(trees)
    assert {"CheckRecord", "Decision", "Plan", "BettiCurve"} <= set(fields)  # dataclasses and named tuples seen
    assert list(positional_records(trees, fields)) == []
    built = {"x.py": ast.parse("Decision(1, 2, 3, 4)\nDecision(action=1, reason=2, step=3, value=4)\n")}
    assert list(positional_records(built, fields)) == ["x.py:1: Decision with 4 positional arguments"]
