"""The monitors the tests build check where the test says: ``**AT_CADENCE`` (no budget), or a budget the test chose.

With an overhead budget (``ScheduleSettings.overhead_budget``) the monitor plans once, at the third check, from the
machine's timings: where checks run, the lag of their decisions, how often, on how many samples
(``topocallbacks.budget``). A test that counts checks or decisions would then depend on how fast the machine is,
which no test may (``docs/development.md``). So every monitor or callback a test builds names its budget:
``**AT_CADENCE`` for the checks exactly as configured, or ``overhead_budget=...`` / ``plan=...`` where the budget is
the subject (``tests/unit/test_suite_lint.py`` checks it), whatever the shipped default is.
"""

AT_CADENCE = {"overhead_budget": None}
