"""The HTML report of a history: written from real TopoMonitor runs, every image checked, every figure labelled."""

import dataclasses
import html.parser
import json
import re
import shutil
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch
from matplotlib.image import imread

from tests.cadence import AT_CADENCE
from tests.unit.rules import old_rule
from tests.waiting import HANG_SECONDS
from topocallbacks import InputError, TopoMonitor
from topocallbacks.check import CheckRecord, InterventionRecord
from topocallbacks.cli import _digits_probe, _dimensional_collapse
from topocallbacks.functional import persistence_diagrams
from topocallbacks.interventions import scale_learning_rate
from topocallbacks.report import _events, _figures, _load_history, write_report
from topocallbacks.settings import COMPONENTS

COLLAPSE_STEP = 40  # the check (step 8 x 5) from which the features are squeezed onto fewer directions
LAYERS = ("encoder.0", "encoder.1")


class TinyActuator:
    """An Actuator (topocallbacks.interventions) over a real optimizer: cuts really cut, stops are remembered."""

    def __init__(self):
        self.optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
        self.stopped = False

    def scale_learning_rate(self, factor):
        scale_learning_rate([self.optimizer], [], factor)
        return f"learning rate -> {self.optimizer.param_groups[0]['lr']:g}"

    def request_stop(self):
        self.stopped = True
        return "stop requested"

    def checkpoint_location(self, tag):
        return f"(not saved in this test: {tag})"

    def save_checkpoint(self, tag):
        pass


def run_monitor(history_path=None, *, layer_shift=0.0, diverge=True, seed=0):
    """12 checks of real digits features: jittered, squeezed at COLLAPSE_STEP, NaN at the end; decisions acted on."""
    probe = _digits_probe(120, 0)
    rng = np.random.default_rng(seed)
    monitor = TopoMonitor(
        check_every=1,
        history_path=None if history_path is None else str(history_path),
        policy=old_rule(warmup=3, action="lower_lr"),
        **AT_CADENCE,
    )
    actuator = TinyActuator()

    # The rule can stop (a diverged check): it would keep snapshots to restore first, but TinyActuator takes none.
    def checks():
        for i in range(12):
            step = 5 * i
            features = probe + (0.05 + layer_shift) * rng.normal(size=probe.shape)
            if step >= COLLAPSE_STEP:
                features = _dimensional_collapse(features, 1.0)
            if diverge and i == 11:
                features[3, 5] = np.nan
            record = monitor.process(features, step)
            monitor.act(record, actuator)

    with pytest.warns(RuntimeWarning, match="keeps no rollback snapshots: TinyActuator takes no snapshots") as caught:
        checks()
    assert len(caught) == 1  # said once
    return monitor, actuator


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    folder = tmp_path_factory.mktemp("single")
    monitor, actuator = run_monitor(folder / "history.jsonl")
    out = folder / "report"
    path = write_report(folder / "history.jsonl", out, title="digits collapse")
    return monitor, actuator, path


@pytest.fixture(scope="module")
def layered(tmp_path_factory):
    """Two layers (the second jittered more), with the diagrams of every check, as (step, layer) keys."""
    records, diagrams = [], {}
    probe = _digits_probe(80, 0)
    healthy, collapsed = (persistence_diagrams(_dimensional_collapse(probe, s)) for s in (0.0, 1.0))
    for layer, shift in zip(LAYERS, (0.0, 0.3), strict=True):
        monitor, _ = run_monitor(layer_shift=shift, diverge=layer == LAYERS[1], seed=len(layer))
        records += [dataclasses.replace(r, layer=layer) if isinstance(r, CheckRecord) else r for r in monitor.history]
        for step in (0, 35, 40, 55):
            diagrams[(step, layer)] = collapsed if step >= COLLAPSE_STEP else healthy
    out = tmp_path_factory.mktemp("layered")
    path = write_report([r.as_dict() for r in records], out, diagrams=diagrams)
    return records, diagrams, path


class Page(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.images, self.links, self.tags = [], [], set()

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        attrs = dict(attrs)
        if tag == "img":
            self.images.append(attrs["src"])
        for key in ("href", "src"):
            if key in attrs:
                self.links.append(attrs[key])


def parse(path):
    page = Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def check_page(path):
    """Every referenced image exists next to the page and decodes; nothing comes from elsewhere."""
    page = parse(path)
    assert page.images
    for source in page.images:
        image = path.parent / source
        assert image.parent == path.parent, source
        assert image.is_file(), source
        pixels = imread(image)
        assert pixels.shape[0] > 100
        assert pixels.shape[1] > 100
    assert not {"script", "link", "iframe"} & page.tags
    assert all("://" not in link and not link.startswith("/") for link in page.links)
    return page


def assert_labelled(figures):
    for name, figure, caption in figures.items:
        assert caption, name
        axes = [a for a in figure.axes if a.get_label() != "<colorbar>"]
        assert axes, name
        for a in axes:
            assert a.get_title(), name
            assert a.get_xlabel(), name
            assert a.get_ylabel(), name
        colourbars = [a for a in figure.axes if a.get_label() == "<colorbar>"]
        assert all(c.get_ylabel() for c in colourbars), name


def diagnoses(path):
    text = path.read_text(encoding="utf-8")
    return text[text.index("Warnings, interventions and diagnosis") : text.index("<h2>Persistence diagrams")]


def test_the_monitor_run_warned_acted_and_diverged(single):
    monitor, actuator, _ = single
    checks = [r for r in monitor.history if isinstance(r, CheckRecord)]
    interventions = [r for r in monitor.history if isinstance(r, InterventionRecord)]
    # The squeeze is flagged at its onset. Then each check is measured against the previous one, already squeezed
    # (drift is the smaller distance to the previous check or to the last unflagged one): the collapse that
    # persists is not flagged again by the index (a squeeze to 0.91 of the variance in one direction is no total
    # collapse: no sentinel holds), so one cut, then the diverged check's stop.
    assert [c.step for c in checks if c.decision.flagged] == [COLLAPSE_STEP, 55]
    assert [c.step for c in checks if c.decision.action.value == "lower_lr"] == [COLLAPSE_STEP]
    healthy = [c.index_value for c in checks if 0 < c.step < COLLAPSE_STEP]
    onset, *after = [c.index_value for c in checks if COLLAPSE_STEP <= c.step < 55]
    assert onset > 30 * max(healthy)
    assert max(after) < min(healthy)  # the squeezed clouds are near each other
    assert all(c.sentinels.holding == () for c in checks[:-1])
    assert [(i.step, i.action) for i in interventions] == [(COLLAPSE_STEP, "lower_lr"), (55, "stop")]
    assert checks[-1].status == "diverged"
    assert checks[-1].report is None
    assert checks[-1].sentinels is None
    assert actuator.optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    assert actuator.stopped


def test_report_of_a_history_file_renders_with_every_image(single):
    _, _, path = single
    assert path.name == "index.html"
    page = check_page(path)
    assert set(page.images) == {"index.png", "scores.png", "composite_0.png"}  # one layer: no heatmap, no diagrams
    text = path.read_text(encoding="utf-8")
    assert "<title>digits collapse</title>" in text
    assert "No persistence diagrams were given" in text
    assert "Step 55: diverged check" in text  # shown, not crashed on


def test_the_diagnosis_names_the_component_that_moved(single):
    monitor, _, path = single
    checks = [r for r in monitor.history if isinstance(r, CheckRecord) and r.ok]
    before = [c for c in checks if c.step < COLLAPSE_STEP][-10:]
    at = next(c for c in checks if c.step == COLLAPSE_STEP)
    change = {
        name: at.report.components[name] - statistics.median(c.report.components[name] for c in before)
        for name in COMPONENTS
    }
    moved, second, _ = sorted(change, key=lambda name: -abs(change[name]))
    # Squeezing onto fewer directions raises the anisotropy; at the scale ε of a mean degree of 8 it also joins the
    # cloud's components into one (β0 9 -> 1), and the Betti term moves the most (0 -> 1).
    assert (moved, second) == ("betti", "anisotropy")
    assert (at.report.betti0, at.report.betti1) == (1, 0)
    text = diagnoses(path)
    block = text[text.index(f"Step {COLLAPSE_STEP}: decision") : text.index("Step 55")]
    assert f"<b>{moved}</b> moved the most against the 8 checks before ({change[moved]:+.3f})" in block
    assert f"<b>Also anisotropy</b> ({change['anisotropy']:+.3f})" in block
    assert "dimensional collapse" in block
    assert "What was done:</b> learning rate -&gt; 0.05" in block
    assert "warm-up" in block
    assert "stop-gradient" not in block  # no loss fell here: nothing says the model is self-supervised
    assert block.count("<li>") <= 5  # the most specific hints, not every one
    diverged = text[text.index("Step 55: diverged check") :]
    assert "NaN or Inf" in diverged
    assert "clip gradients" in diverged


def test_every_figure_has_a_title_and_labelled_axes(single, layered):
    for records in (single[0].history, layered[0]):
        checks = [r for r in records if isinstance(r, CheckRecord)]
        interventions = [r for r in records if isinstance(r, InterventionRecord)]
        events = _events(checks, interventions)
        diagrams = layered[1] if records is layered[0] else {}
        assert_labelled(_figures(checks, interventions, diagrams, events))


def test_several_layers_give_a_heatmap_and_the_diagrams_are_drawn(layered):
    records, _, path = layered
    page = check_page(path)
    assert {"heatmap_index.png", "heatmap_ci.png", "diagrams.png", "composite_0.png", "composite_1.png"} <= set(
        page.images
    )
    checks = [r for r in records if isinstance(r, CheckRecord)]
    events = _events(checks, [r for r in records if isinstance(r, InterventionRecord)])
    figure = _figures(checks, [], layered[1], events).get("diagrams.png")
    titles = [a.get_title() for a in figure.axes]
    # The first and last checks, and the one at the first warning.
    assert titles[0].startswith("step 0")
    assert any(t.startswith(f"step {COLLAPSE_STEP}") for t in titles)
    assert titles[-1].startswith("step 55")
    text = diagnoses(path)
    assert "Which layer:</b> of the 2 layers checked at this step" in text


def test_the_layer_that_moved_is_named():
    """Two layers; only the second one's features are squeezed: the diagnosis names it."""
    probe = _digits_probe(100, 1)
    rng = np.random.default_rng(3)
    monitors = {layer: TopoMonitor(check_every=1, policy=old_rule(warmup=3), **AT_CADENCE) for layer in LAYERS}
    records = []
    for i in range(9):
        for layer, monitor in monitors.items():
            features = probe + 0.05 * rng.normal(size=probe.shape)
            if layer == LAYERS[1] and i == 8:
                features = _dimensional_collapse(features, 1.5)
            records.append(dataclasses.replace(monitor.process(features, i), layer=layer))
    checks = [r for r in records if isinstance(r, CheckRecord)]
    event = next(e for e in _events(checks, []) if e.step == 8)
    assert event.layer == LAYERS[1]
    assert event.layers[0].name == LAYERS[1]
    assert event.layers[0].z > event.layers[1].z
    # At the mean-degree ε the squeeze joins the components (the Betti term moves the most), then anisotropy.
    assert [m.name for m in event.components[:2]] == ["betti", "anisotropy"]


def test_a_constructed_history_where_only_the_entropy_term_moves():
    def check(step, entropy, action="none"):
        return {
            "kind": "check", "step": step, "status": "ok", "index": "paper", "index_value": 0.3 + entropy,
            "check_ms": 1.0, "layer": None,
            "decision": {"action": action, "reason": "test", "step": step},
            "report": {
                "ci": 0.3 + entropy, "betti_term": 1.0, "entropy_term": entropy, "anisotropy_term": 0.2,
                "betti0": 1, "betti1": 0, "persistence_entropy": 1 - entropy, "epsilon": 1.0, "n_samples": 10,
                "n_features": 3, "n_diagram_points": 10, "weights": {"betti": 0.4, "entropy": 0.3, "anisotropy": 0.3},
                "timings_ms": {},
            },
            "engine": None,
        }  # fmt: skip

    history = [check(s, 0.05 + 0.001 * (s % 3)) for s in range(6)] + [check(6, 0.6, "warn")]
    records, _ = _load_history(history)
    (event,) = _events(records, [])
    assert event.top == "entropy"
    assert event.components[0].change == pytest.approx(0.6 - 0.051)
    assert [m.name for m in event.components[1:]] == ["betti", "anisotropy"]  # neither moved


def test_records_of_the_monitor_are_accepted_directly(tmp_path):
    monitor, _ = run_monitor(diverge=False)
    path = write_report(monitor.history, tmp_path / "out")
    check_page(path)
    assert "Step 40: decision <b>lower_lr</b>" in path.read_text(encoding="utf-8")


def test_a_history_with_only_diverged_checks(tmp_path):
    monitor = TopoMonitor(check_every=1, **AT_CADENCE)
    for step in range(3):
        monitor.process(np.full((20, 4), np.nan), step)
    path = write_report(monitor.history, tmp_path)
    check_page(path)
    text = path.read_text(encoding="utf-8")
    assert len(re.findall(r"Step \d+: diverged check", text)) == 3


def test_bad_histories_give_clear_errors(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(InputError, match=r"`history` '.*nope.jsonl' does not exist"):
        write_report(missing, tmp_path / "out")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(InputError, match=r"`history` '.*empty.jsonl' holds no records"):
        write_report(empty, tmp_path / "out")
    torn = tmp_path / "torn.jsonl"
    torn.write_text('{"kind": "check", "st')
    with pytest.raises(InputError, match="holds no records"):
        write_report(torn, tmp_path / "out")
    with pytest.raises(InputError, match="`history` is an empty list"):
        write_report([], tmp_path / "out")
    with pytest.raises(InputError, match=r"`history` record 0 of 1 records is not a check or an intervention"):
        write_report([{"kind": "check", "step": 1}], tmp_path / "out")
    with pytest.raises(InputError, match="holds no check records"):
        write_report([InterventionRecord(3, "warn", "r", "d", 1.0)], tmp_path / "out")
    with pytest.raises(InputError, match="`history` must be the path of a history JSONL file or a list"):
        write_report(42, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_bad_output_folder_and_diagrams(tmp_path, single):
    history = single[0].history
    afile = tmp_path / "file.txt"
    afile.write_text("x")
    with pytest.raises(InputError, match=r"`out_dir` '.*file.txt' exists and is not a folder"):
        write_report(history, afile)
    with pytest.raises(InputError, match=r"`diagrams\[0\]`: `diagram` must have shape \(n_bars, 2\)"):
        write_report(history, tmp_path / "o", diagrams={0: [np.zeros((3, 3))]})
    with pytest.raises(InputError, match="`diagrams` keys must be steps"):
        write_report(history, tmp_path / "o", diagrams={"zero": [np.zeros((3, 2))]})
    with pytest.raises(InputError, match="non-empty list of"):
        write_report(history, tmp_path / "o", diagrams={0: np.zeros((3, 2))})


def test_the_history_file_has_what_the_report_reads(single, tmp_path):
    """A torn last line (a crash mid-write) is skipped, as the JSONL sink's reader does."""
    _, _, path = single
    history = path.parent.parent / "history.jsonl"
    copy = tmp_path / "history.jsonl"
    shutil.copy(history, copy)
    with copy.open("a") as handle:
        handle.write('{"kind": "check", "step": 99, "sta')
    lines = history.read_text().splitlines()
    assert {json.loads(line)["kind"] for line in lines} == {"check", "intervention"}
    assert write_report(copy, tmp_path / "out").is_file()


def _browser():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install playwright; no browser download needed)")
    return chromium, sync_playwright


def test_a_headless_browser_loads_every_image_without_errors(layered):
    chromium, sync_playwright = _browser()
    path = Path(layered[2])
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=chromium,
            timeout=HANG_SECONDS * 1e3,  # milliseconds; a browser starts slowly on a busy machine
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--no-first-run",
            ],
        )
        try:
            page = browser.new_page()
            page.set_default_timeout(HANG_SECONDS * 1e3)
            problems, requests = [], []
            page.on("console", lambda message: problems.append(message.text) if message.type == "error" else None)
            page.on("pageerror", lambda error: problems.append(str(error)))
            page.on("requestfailed", lambda request: problems.append(f"failed: {request.url}"))
            page.on("request", lambda request: requests.append(request.url))
            page.goto(path.as_uri(), wait_until="load")
            images = page.evaluate(
                "Array.from(document.images).map(i => [i.getAttribute('src'), i.complete, i.naturalWidth])"
            )
        finally:
            browser.close()
    assert problems == []
    assert len(images) == len(parse(path).images) >= 5
    assert all(complete and width > 0 for _, complete, width in images), images
    assert all(url.startswith("file://") for url in requests), requests


def test_the_scores_figure_draws_each_score_its_threshold_and_the_interventions(single):
    monitor, _, _ = single
    checks = [r for r in monitor.history if isinstance(r, CheckRecord)]
    interventions = [r for r in monitor.history if not isinstance(r, CheckRecord)]
    figure = _figures(checks, interventions, {}, []).get("scores.png")
    (axes,) = figure.axes
    scored = {c.step: c.decision.score for c in checks if c.ok and c.decision.score is not None}
    (line,) = [d for d in axes.get_lines() if d.get_label() == "score: index"]
    assert dict(zip(line.get_xdata(), line.get_ydata(), strict=True)) == pytest.approx(scored)
    (threshold,) = [d for d in axes.get_lines() if d.get_label().startswith("threshold: index")]
    assert set(threshold.get_ydata()) == {monitor.settings.rule.threshold}
    cuts = [d for d in axes.get_lines() if d.get_label() == "intervention: lower_lr"]
    assert [d.get_xdata()[0] for d in cuts] == [r.step for r in interventions if r.action == "lower_lr"][:1]


def test_the_loss_the_rule_saw_is_in_the_records_and_drawn_with_the_interventions(tmp_path):
    probe = _digits_probe(80, 0)
    rng = np.random.default_rng(3)
    monitor = TopoMonitor(check_every=1, summary=False, **AT_CADENCE)
    losses = {}
    for i in range(8):
        losses[i * 5] = 2.0 / (1 + i)
        monitor.process(probe + 0.05 * rng.normal(size=probe.shape), i * 5, loss=losses[i * 5], grad_norm=1.0)
    checks = [r for r in monitor.history if isinstance(r, CheckRecord)]
    assert {c.step: c.loss for c in checks} == losses  # one step per check: the mean is that step's loss
    assert {c.grad_norm for c in checks} == {1.0}
    figure = _figures(checks, [], {}, []).get("loss.png")
    (line,) = [d for d in figure.axes[0].get_lines() if d.get_label().startswith("training loss")]
    assert dict(zip(line.get_xdata(), line.get_ydata(), strict=True)) == pytest.approx(losses)
    path = write_report(monitor.history, tmp_path)
    assert "loss.png" in parse(path).images


def test_a_sentinel_is_named_with_dead_units_and_its_own_hints(tmp_path):
    probe = _digits_probe(80, 0)
    monitor = TopoMonitor(
        check_every=1, summary=False, policy={"action": "warn", "channels": ["index"], "require": 1}, **AT_CADENCE
    )
    for i in range(5):
        monitor.process(probe + 0.05 * np.random.default_rng(i).normal(size=probe.shape), i * 5)
    monitor.process(np.full_like(probe, 0.3), 25)  # every unit constant: a dead layer
    (alarm,) = [r for r in monitor.history if isinstance(r, CheckRecord) and r.decision.fired]
    assert alarm.sentinels.holding == ("constant",)
    text = diagnoses(write_report(monitor.history, tmp_path))
    block = text[text.index("Step 25: decision") :]
    assert "<b>Sentinel (constant):</b>" in block
    assert "units are dead" in block
    assert "LeakyReLU" in block
    assert "stop-gradient" not in block
    assert "moved the most" not in block  # the components of a constant cloud say nothing


def test_the_hints_follow_what_the_loss_did_at_the_alarm(tmp_path):
    # The same drift alarm twice: once with the loss jumping 5x with it, once with the loss still falling.
    probe = _digits_probe(80, 0)
    rng = np.random.default_rng(4)
    pages = {}
    for case, last_loss in (("jumped", 5.0), ("fell", 0.2)):
        monitor = TopoMonitor(check_every=1, summary=False, policy=old_rule(warmup=3, action="warn"), **AT_CADENCE)
        for i in range(7):
            features = probe + 0.05 * rng.normal(size=probe.shape)
            if i == 6:
                features = _dimensional_collapse(features, 1.0)  # the features move: an index alarm
            monitor.process(features, i * 5, loss=last_loss if i == 6 else 1.0 - 0.05 * i)
        (alarm,) = [r for r in monitor.history if isinstance(r, CheckRecord) and r.decision.fired]
        assert alarm.step == 30
        pages[case] = diagnoses(write_report(monitor.history, tmp_path / case))
    assert "The training loss:</b> 5.000 against a median of 0.875 over the 6 checks before" in pages["jumped"]
    assert "the loss jumped with the features" in pages["jumped"]
    assert "the loss kept falling" not in pages["jumped"]
    assert "the loss kept falling at this check" in pages["fell"]
    assert "the loss jumped" not in pages["fell"]
    # The features concentrated while the loss fell: the self-supervised hint, there only.
    assert "stop-gradient" in pages["fell"]
    assert "stop-gradient" not in pages["jumped"]
