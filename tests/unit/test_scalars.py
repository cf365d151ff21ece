"""What the loggers receive of a check (topocallbacks.sinks.scalars_of)."""

import numpy as np
import pytest

from tests.cadence import AT_CADENCE
from topocallbacks import TopoMonitor
from topocallbacks.sinks import scalars_of


def test_a_sentinel_that_acts_has_its_curve_at_that_step():
    monitor = TopoMonitor(policy={"action": "warn", "channels": ["index"], "require": 1}, **AT_CADENCE)
    rng = np.random.default_rng(0)
    healthy = monitor.process(rng.normal(size=(64, 8)), step=0)
    line = np.outer(rng.normal(size=64), rng.normal(size=8))  # every point on one line through the origin
    collapsed = monitor.process(line, step=10)
    assert collapsed.decision.fired
    values = scalars_of(collapsed)
    assert values["topo/sentinel/holds"] == 1.0
    assert values["topo/sentinel/top_share"] == pytest.approx(1.0)
    calm = scalars_of(healthy)
    assert calm["topo/sentinel/holds"] == 0.0
    assert calm["topo/sentinel/top_share"] < 0.5
    assert 0.5 < calm["topo/sentinel/spread"] <= 1.0
