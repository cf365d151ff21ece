"""docs/architecture.md shows every import arrow of the package: its table of imports is the code's, module by
module (top-level and deferred imports alike), so a new arrow cannot go unseen."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
PACKAGE = ROOT / "topocallbacks"
PAGE = ROOT / "docs" / "architecture.md"
ROW = re.compile(r"^\| `(?P<module>[a-z_.]+)` \| (?P<imports>.*) \|$")


def module_name(path: Path) -> str:
    """``policy.rule`` for ``topocallbacks/policy/rule.py``; a package is named by its folder (``policy``)."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)  # "" for the package itself


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def resolve(name: str, known: dict[str, Path]) -> str:
    """The package module ``name`` (dotted, relative to the package) names, or the package above it."""
    while name not in known:
        name = name.rpartition(".")[0]
    return name


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports, at any depth of its code."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name.removeprefix("topocallbacks.") for a in node.names if a.name.startswith("topocallbacks.")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                source = ".".join([*base, *([node.module] if node.module else [])])
            elif node.module and (node.module == "topocallbacks" or node.module.startswith("topocallbacks.")):
                source = node.module.removeprefix("topocallbacks").lstrip(".")
            else:
                continue
            # ``from . import runner`` imports a module; ``from .policy import Policy`` the package.
            targets = [f"{source}.{a.name}".lstrip(".") if f"{source}.{a.name}".lstrip(".") in known else source
                       for a in node.names]  # fmt: skip
        found |= {resolve(target, known) for target in targets} - {name}
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def table() -> str:
    """The page's table, as the code gives it."""
    lines = ["| module | imports (package modules) |", "|---|---|"]
    for name, targets in sorted(graph().items()):
        lines.append(f"| `{shown(name)}` | {', '.join(f'`{shown(t)}`' for t in sorted(targets)) or '-'} |")
    return "\n".join(lines)


def shown(name: str) -> str:
    return name or "topocallbacks"


def page_graph(text: str) -> dict[str, set[str]]:
    found = {}
    for line in text.splitlines():
        match = ROW.match(line)
        if match:
            found[match["module"]] = set(re.findall(r"`([a-z_.]+)`", match["imports"]))
    return found


def test_the_page_shows_every_import_arrow_of_the_package():
    code = {shown(a): {shown(b) for b in targets} for a, targets in graph().items()}
    page = page_graph(PAGE.read_text())
    missing = sorted(f"{a} -> {b}" for a, targets in code.items() for b in targets - page.get(a, set()))
    extra = sorted(f"{a} -> {b}" for a, targets in page.items() for b in targets - code.get(a, set()))
    assert (missing, extra, sorted(set(page) - set(code))) == ([], [], []), (
        f"docs/architecture.md's import table is out of date; missing {missing}, not in the code {extra}. "
        f"The table as the code gives it:\n{table()}"
    )


def test_the_arrows_are_read_from_relative_absolute_and_deferred_imports(tmp_path):
    known = {"": tmp_path / "__init__.py", "monitor": tmp_path / "monitor.py",
             "policy": tmp_path / "policy" / "__init__.py",
             "policy.rule": tmp_path / "policy" / "rule.py", "runner": tmp_path / "runner.py",
             "report": tmp_path / "report.py"}  # fmt: skip
    (tmp_path / "policy").mkdir()
    known["policy.rule"].write_text(
        "from ..runner import Runner\nfrom . import helper\nimport topocallbacks.report\n"
        "def f():\n    from topocallbacks.monitor import TopoMonitor\n"
    )
    assert imports_of("policy.rule", known["policy.rule"], known) == {"runner", "policy", "report", "monitor"}
    known["monitor"].write_text("from .policy import Policy\nfrom .policy.rule import holds\nfrom . import runner\n")
    assert imports_of("monitor", known["monitor"], known) == {"policy", "policy.rule", "runner"}
    known[""].write_text("from .monitor import TopoMonitor\nfrom . import report\n")
    assert imports_of("", known[""], known) == {"monitor", "report"}
