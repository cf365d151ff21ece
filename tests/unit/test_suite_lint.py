"""The suite's own lint: no test depends on how fast the machine is (issue 34).

A test may not assert a wall-clock duration or compare two timings, and may not sleep to let something happen:
it waits for the event (:mod:`tests.waiting`), injects a clock or the measured costs, or asserts a property that
holds at any speed. Timing claims live in ``benchmarks/``. The few exceptions are listed below with their reasons;
a new one must be added there, reviewed, and explained.
"""

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

# A value that is a duration: a name or attribute like check_ms, wait_ms, seconds, elapsed, duration, ..., or a
# reading of a clock.
TIMING_NAME = re.compile(r"(^|_)(ms|seconds|secs|elapsed|duration|durations|wall|overhead|speedup|dt)$")
CLOCKS = {"perf_counter", "perf_counter_ns", "time", "monotonic", "monotonic_ns", "process_time", "thread_time"}

#: (file, function) -> why its timing assertion or sleep holds at any speed.
EXCEPTIONS = {
    ("unit/test_background.py", "test_a_late_worker_makes_the_loop_wait_and_the_record_says_so"): (
        "wait_ms > check_ms is an order of events, not a speed: the worker is stopped before the check is sent and "
        "resumed only once the loop waits, so its evaluation lies inside the loop's wait on one monotonic clock"
    ),
    ("unit/test_collapse_index.py", "test_report_components_are_the_documented_formulas"): (
        "the total's interval contains the Betti numbers' (nested readings of one monotonic clock): an order"
    ),
    ("unit/test_mmhm.py", "test_cost_model_learns_a_linear_time_law"): (
        "the cost model fitted to times the test writes (a known linear law): arithmetic, no time is measured"
    ),
    ("unit/test_mmhm.py", "test_predictions_and_budget"): (
        "the predictions of a fresh engine's cost model from its priors: arithmetic, no time is measured"
    ),
    ("unit/test_background.py", "test_a_worker_slow_to_start_is_waited_for_and_the_timeout_counts_for_its_checks"): (
        "the sleep is a lower bound, not a race: it starts once the loop waits for the stopped worker and keeps it "
        "stopped for twice its timeout, so the loop's wait exceeds the timeout by construction"
    ),
}


def timing_operand(node: ast.AST, clocks: frozenset[str] = frozenset()) -> bool:
    """Whether an expression reads a duration (a timing name or key, or a clock; ``clocks``: names imported from
    ``time``)."""
    for child in ast.walk(node):
        if isinstance(child, ast.Name) and (TIMING_NAME.search(child.id) or child.id in clocks):
            return True
        if isinstance(child, ast.Attribute) and TIMING_NAME.search(child.attr):
            return True
        if isinstance(child, ast.Constant) and isinstance(child.value, str) and TIMING_NAME.search(child.value):
            return True  # a subscript such as timings["total_ms"]
        if (
            isinstance(child, ast.Call)
            and isinstance(child.func, ast.Attribute)
            and child.func.attr in CLOCKS
            and isinstance(child.func.value, ast.Name)
            and child.func.value.id == "time"
        ):
            return True
    return False


def harmless(node: ast.AST) -> bool:
    """A bound every duration meets at any speed: 0 (a measured time is positive) or None (measured or not)."""
    return isinstance(node, ast.Constant) and node.value in (0, 0.0, None)


def imported_from_time(tree: ast.AST) -> dict[str, str]:
    """Local names bound by ``from time import ...`` (``sleep``, ``perf_counter as clock``, ...), to the function."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "time":
            for alias in node.names:
                names[alias.asname or alias.name] = alias.name
    return names


def loose_approx(node: ast.AST) -> bool:
    """Whether ``node`` is ``pytest.approx(..., rel=...)`` or ``(..., abs=...)``: compared with a duration, a bound.

    At its default tolerance (a millionth) an approximate equality is an exact one: a measured time never meets it,
    only a computed or injected one does.
    """
    return (
        isinstance(node, ast.Call)
        and getattr(node.func, "attr", getattr(node.func, "id", None)) == "approx"
        and any(keyword.arg in ("rel", "abs") for keyword in node.keywords)
    )


def violations(path: Path) -> list[tuple[str, int, str]]:
    """(function, line, what) for every timing assertion and every sleep in a test file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    from_time = imported_from_time(tree)
    clocks = frozenset(name for name, function in from_time.items() if function in CLOCKS)
    sleeps = frozenset(name for name, function in from_time.items() if function == "sleep")
    found = []
    # Each finding is the outermost function's (a helper nested in a test is the test's).
    outermost = [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    outermost += [m for c in tree.body if isinstance(c, ast.ClassDef) for m in c.body if isinstance(m, ast.FunctionDef)]
    for function in outermost:
        for node in ast.walk(function):
            if isinstance(node, ast.Assert):
                for compare in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
                    operands = [compare.left, *compare.comparators]
                    bound = any(isinstance(op, ast.Lt | ast.LtE | ast.Gt | ast.GtE) for op in compare.ops)
                    if not bound and not any(loose_approx(op) for op in operands):
                        continue  # an exact equality: a measured time never equals a value, only a synthetic one does
                    timed = [op for op in operands if timing_operand(op, clocks)]
                    if len(timed) >= 2:
                        found.append((function.name, node.lineno, "compares two durations"))
                    elif timed and not all(harmless(op) for op in operands if op is not timed[0]):
                        found.append((function.name, node.lineno, "asserts a duration against a bound"))
            if isinstance(node, ast.Call) and (
                (
                    isinstance(node.func, ast.Attribute)
                    and node.func.attr == "sleep"
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "time"
                )
                or (isinstance(node.func, ast.Name) and node.func.id in sleeps)
            ):
                found.append((function.name, node.lineno, "sleeps"))
    return sorted(found, key=lambda item: item[1])


def test_no_test_asserts_a_duration_compares_timings_or_sleeps_but_the_listed_exceptions():
    files = sorted(p for p in TESTS.rglob("*.py") if p.name != "waiting.py")
    assert len(files) > 30
    seen, problems = set(), []
    for path in files:
        relative = path.relative_to(TESTS).as_posix()
        for function, line, what in violations(path):
            if (relative, function) in EXCEPTIONS:
                seen.add((relative, function))
            else:
                problems.append(f"tests/{relative}:{line} {function} {what}")
    assert problems == [], "wait for events or inject a clock (tests/waiting.py):\n" + "\n".join(problems)
    assert seen == set(EXCEPTIONS), f"exceptions no longer needed: {sorted(set(EXCEPTIONS) - seen)}"


def test_the_lint_finds_what_it_forbids(tmp_path):
    sample = tmp_path / "test_sample.py"
    sample.write_text(
        "import time\n"
        "def test_a(r):\n"
        "    assert r.check_ms < 50\n"  # a duration bound
        "    assert r.wait_ms > 0.5 * r.check_ms\n"  # a ratio of two timings
        "    start = time.perf_counter()\n"
        "    assert time.perf_counter() - start < 2\n"  # a clock read
        "    time.sleep(1.0)\n"  # sleep, then assert
        "    assert r.check_ms > 0 and r.step_ms >= 0 and r.wait_ms is not None\n"  # allowed at any speed
        "    assert elapsed_steps == 3\n"  # not a duration
        "from time import perf_counter as clock, sleep\n"
        "def test_b(r, t0, speedup):\n"
        "    sleep(1)\n"  # sleep imported by name
        "    assert clock() - t0 < 2\n"  # a clock imported by name
        "    assert r.check_ms == pytest.approx(40, rel=0.5)\n"  # a bound written as an approximate equality
        "    assert r.report['timings']['total_ms'] < 100\n"  # a duration behind a key
        "    assert speedup > 2\n"  # a ratio of two timings
    )
    assert [(line, what) for _, line, what in violations(sample)] == [
        (3, "asserts a duration against a bound"),
        (4, "compares two durations"),
        (6, "asserts a duration against a bound"),
        (7, "sleeps"),
        (12, "sleeps"),
        (13, "asserts a duration against a bound"),
        (14, "asserts a duration against a bound"),
        (15, "asserts a duration against a bound"),
        (16, "asserts a duration against a bound"),
    ]


#: What builds a monitor: the classes, and their `from_preset` constructors.
MONITOR_BUILDERS = {"TopoMonitor", "TopoCollapseCallback", "TopoCollapseTrainerCallback", "from_preset"}
#: The keywords that name the budget a monitor checks under (`tests.cadence`): none (``**AT_CADENCE``), one the test
#: chose, or a recorded plan.
BUDGET_KEYWORDS = {"overhead_budget", "plan"}


#: Scripts outside tests/ whose checks a test asserts (the benchmarks that measure the default budget are not among
#: them: they run the default on purpose).
SCRIPTS_THE_TESTS_CHECK = [TESTS.parent / "benchmarks" / "gpu_sharded_rollback.py"]


def unbudgeted_monitors(tree: ast.AST) -> list[int]:
    """The lines of the calls in ``tree`` that build a monitor or callback without naming its overhead budget."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
        if name not in MONITOR_BUILDERS:
            continue
        named = {k.arg for k in node.keywords if k.arg is not None}
        spread = [k.value for k in node.keywords if k.arg is None]
        if named & BUDGET_KEYWORDS or any(isinstance(v, ast.Name) and v.id == "AT_CADENCE" for v in spread):
            continue
        lines.append(node.lineno)
    return lines


def test_every_monitor_a_test_builds_names_its_overhead_budget():
    # With a budget the checks follow the machine's timings (one plan, made at the third check): a test that counts
    # checks or decisions must say `**AT_CADENCE` (checks exactly as configured) or the budget it tests, whatever
    # the shipped default is (tests/cadence.py). Scripts the tests run (DDP, FSDP) are held to it too.
    found = []
    for path in [*sorted(TESTS.rglob("*.py")), *SCRIPTS_THE_TESTS_CHECK]:
        for line in unbudgeted_monitors(ast.parse(path.read_text())):
            found.append(f"{path.relative_to(TESTS.parent)}:{line}")
    assert not found, "build these with **AT_CADENCE (tests/cadence.py) or an explicit budget:\n" + "\n".join(found)


def test_the_budget_lint_sees_a_missing_budget_and_accepts_the_three_ways_to_name_one():
    source = """
TopoMonitor(check_every=5)
TopoCollapseCallback.from_preset("gpt", probe=p)
TopoMonitor(check_every=5, **AT_CADENCE)
TopoCollapseTrainerCallback(probe=p, overhead_budget=0.02)
TopoCollapseCallback(probe=p, plan={"at_step": 20})
"""
    assert unbudgeted_monitors(ast.parse(source)) == [2, 3]
