"""Every option of the monitor, its default and valid values, once: [`MonitorSettings`][topocallbacks.MonitorSettings].

The settings are one frozen value made of sections (``probe``, ``schedule``, ``transform``, ``index``, ``policy``,
``interventions``, ``output``) that mirror the sections of a preset file. Each field declares its default and its
check; nothing else in the package repeats them. Presets produce a value
([`topocallbacks.presets.load`][topocallbacks.presets.load]),
[`TopoMonitor`][topocallbacks.TopoMonitor] and both training callbacks take one, and keyword overrides are merged into
it by `MonitorSettings.merged`, which validates them with the same checks::

    settings = MonitorSettings().merged({"check_every": 20, "policy": {"action": "lower_lr"}})

Overrides name an option by its own name (``check_every``, ``layer``; two have a longer name outside their
section: ``max_probe_samples`` for ``probe.size`` and ``index`` for ``index.name``) or give a whole section as a
mapping merged into it (``policy={"patience": 5}``) or as a section value that replaces it. Errors name the key as
it was given (``check_every``, or ``policy.patience`` and the file of a preset), the valid keys and the closest one.

This module sits at the bottom of the package: it imports nothing of it but the argument checks.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import os
import types
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from ._validation import check_int, check_number, check_positive_float
from .exceptions import ConfigError, InputError

__all__ = [
    "COMPONENTS",
    "DEFAULT_RULES",
    "INDEX_NAMES",
    "LAYER_RULES",
    "MODES",
    "PAPER_WEIGHTS",
    "POOLINGS",
    "PRECISIONS",
    "PROJECTIONS",
    "SCORES",
    "SILENT_FAMILIES",
    "Action",
    "IndexSettings",
    "InterventionSettings",
    "MonitorSettings",
    "OutputSettings",
    "PolicySettings",
    "ProbeSettings",
    "ScheduleSettings",
    "SilentSettings",
    "TransformSettings",
    "resolve_weights",
]

#: How a layer's output becomes one vector per sample (see `FeatureExtractor`).
POOLINGS = ("auto", "mean", "last", "cls", "flatten", "none")
#: The probe pass's precision (see `ProbeSettings`).
PRECISIONS = ("auto", "32", "bf16", "16")
#: ``"probe"``: run a fixed probe every ``check_every`` steps; ``"stream"``: watch the training batches' features.
MODES = ("probe", "stream")
#: The fixed maps to fewer dimensions a monitor can apply before the topology.
PROJECTIONS = (None, "pca", "random")
#: What the policy can watch (see `topocallbacks.check`).
INDEX_NAMES = ("diagram_drift", "paper", "rankme")
#: How the policy turns the watched index into the score it compares with its threshold.
SCORES = ("value", "baseline", "zscore")
#: When a rollback skips updates and when it cuts the rate (``PolicySettings.rollback_order``).
ROLLBACK_ORDERS = ("skip_and_cut", "skip_if_confirmed", "from_second", "cut_if_refired")
#: What a rule can watch: the probe's index, and the training loss and gradient norm the adapters pass along.
CHANNELS = ("index", "loss", "grad_norm")
#: Names of the Collapse Index components, in the order they are reported.
COMPONENTS = ("betti", "entropy", "anisotropy")
#: The paper's weights: ``CI = 0.4 * betti + 0.3 * entropy + 0.3 * anisotropy``.
PAPER_WEIGHTS: Mapping[str, float] = types.MappingProxyType({"betti": 0.4, "entropy": 0.3, "anisotropy": 0.3})


class Action(str, enum.Enum):
    """What a decision asks the training adapter to do, weakest first (`level` orders them)."""

    NONE = "none"
    WARN = "warn"
    LOWER_LR = "lower_lr"
    ROLLBACK = "rollback"
    STOP = "stop"

    @property
    def level(self) -> int:
        """0 for ``none``, then 1, 2, ... in the order above: a cooldown never holds back a stronger action."""
        return list(Action).index(self)


def resolve_weights(weights: str | Mapping[str, float] | None, name: str = "weights") -> dict[str, float]:
    """Validate Collapse Index weights and normalise them to sum to 1.

    Args:
        weights: ``"paper"`` or None (the paper's 0.4/0.3/0.3), or a mapping from component name
            (``"betti"``, ``"entropy"``, ``"anisotropy"``) to a non-negative weight; missing components get 0.
        name: the argument's name in error messages.

    Returns:
        A dict over all components whose values sum to 1.

    Raises:
        InputError: unknown name, unknown component, negative or non-finite weight, or all weights zero.

    Examples:
        >>> resolve_weights({"entropy": 1.0})
        {'betti': 0.0, 'entropy': 1.0, 'anisotropy': 0.0}
    """
    if weights is None or weights == "paper":
        return dict(PAPER_WEIGHTS)
    if isinstance(weights, str):
        raise InputError(f'`{name}` must be "paper", None or a mapping of component weights, got {weights!r}')
    if not isinstance(weights, Mapping):
        raise InputError(f"`{name}` must be a mapping of component weights, got {type(weights).__name__}")
    unknown = sorted(set(weights) - set(COMPONENTS))
    if unknown:
        raise InputError(f"`{name}` has unknown component(s) {unknown}; valid components: {sorted(COMPONENTS)}")
    resolved = {}
    for component in COMPONENTS:
        value = weights.get(component, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise InputError(f"`{name}[{component!r}]` must be a finite number >= 0, got {value!r}")
        resolved[component] = float(value)
    total = sum(resolved.values())
    if total == 0:
        raise InputError(f"`{name}` must have at least one weight > 0, got {dict(weights)!r}")
    return {component: value / total for component, value in resolved.items()}


# --- checks: each takes the value and the name it was given under, and returns the value to store -------------

Check = Callable[[Any, str], Any]


def _integer(minimum: int) -> Check:
    return lambda value, name: check_int(value, name, minimum=minimum)


def _optional(check: Check) -> Check:
    return lambda value, name: None if value is None else check(value, name)


def _number(low: float = -math.inf, high: float = math.inf, *, high_open: bool = True) -> Check:
    return lambda value, name: check_number(value, name, low=low, high=high, high_open=high_open)


def _positive(value: Any, name: str) -> float:
    return check_positive_float(value, name)


def _choice(choices: tuple[Any, ...]) -> Check:
    def check(value: Any, name: str) -> Any:
        if isinstance(value, enum.Enum):
            value = value.value
        if value not in choices:
            listed = [c for c in choices if c is not None]
            shown = f"{listed} or None" if None in choices else str(listed)
            raise InputError(f"`{name}` must be one of {shown}, got {value!r}")
        return value

    return check


def _boolean(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise InputError(f"`{name}` must be true or false, got {value!r} of type {type(value).__name__}")
    return value


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise InputError(f"`{name}` must be a non-empty string, got {value!r}")
    return value


def _filepath(value: Any, name: str) -> str:
    """A file or directory path: a string or an ``os.PathLike`` (kept as a string, so settings stay JSON)."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        raise InputError(f"`{name}` must be a path (a non-empty string or os.PathLike), got {value!r}")
    return value


def _layers(value: Any, name: str) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else None
    if not items or not all(isinstance(item, str) and item for item in items):
        raise InputError(f"`{name}` must be a module name or a non-empty list of name patterns, got {value!r}")
    return tuple(items)


def _layer_list(value: Any, name: str) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else None
    if not items or not all(isinstance(item, str) and item for item in items):
        raise InputError(
            f"`{name}` must be a non-empty list of module names, name patterns or preset shortcuts, got {value!r}"
        )
    twice = next((item for item in items if items.count(item) > 1), None)
    if twice is not None:
        raise InputError(f"`{name}` names {twice!r} twice: {items!r}")
    return tuple(items)


def _shortcuts(value: Any, name: str) -> dict[str, tuple[str, ...]]:
    if not isinstance(value, Mapping):
        raise InputError(f"`{name}` must be a mapping from a shortcut name to name patterns, got {value!r}")
    return {str(key): _layers(patterns, f"{name}.{key}") for key, patterns in value.items()}


#: How the policy combines several watched layers (besides a number k: k of them).
LAYER_RULES = ("primary", "any", "all")


def _layer_rule(value: Any, name: str) -> str | int:
    if isinstance(value, str) and value in LAYER_RULES:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise InputError(f"`{name}` must be one of {list(LAYER_RULES)} or a number of layers >= 1, got {value!r}")


def _weights(value: Any, name: str) -> str | dict[str, float]:
    resolve_weights(value, name)
    return "paper" if value is None or value == "paper" else {str(k): float(v) for k, v in value.items()}


def _channels(value: Any, name: str) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else None
    if not items or not all(isinstance(item, str) for item in items):
        raise InputError(f"`{name}` must be a non-empty list of {list(CHANNELS)}, got {value!r}")
    unknown = [item for item in items if item not in CHANNELS]
    if unknown:
        raise InputError(
            f"`{name}` has {unknown[0]!r}{_did_you_mean(unknown[0], list(CHANNELS))} Valid: {list(CHANNELS)}"
        )
    if len(set(items)) != len(items):
        raise InputError(f"`{name}` names a channel twice: {items!r}")
    return tuple(items)


#: The keys of a budget's plan that ``plan=`` takes (`topocallbacks.check.Plan.settings`).
PLAN_KEYS = ("at_step", "intervals", "background", "lag", "probe_size")


def _plan(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise InputError(f"`{name}` must be a mapping of a budget's plan ({list(PLAN_KEYS)}), got {value!r}")
    unknown = sorted(set(value) - set(PLAN_KEYS))
    if unknown:
        raise InputError(f"`{name}` has unknown key {unknown[0]!r}{_did_you_mean(unknown[0], list(PLAN_KEYS))} "
                         f"Valid: {list(PLAN_KEYS)}")  # fmt: skip
    if "at_step" not in value:
        raise InputError(f"`{name}` needs `at_step`, the step of the check that made the plan, got {dict(value)!r}")
    return {
        "at_step": check_int(value["at_step"], f"{name}.at_step", minimum=0),
        "intervals": check_int(value.get("intervals", 1), f"{name}.intervals", minimum=1),
        "background": _boolean(value.get("background", False), f"{name}.background"),
        "lag": _optional(_integer(0))(value.get("lag"), f"{name}.lag"),
        "probe_size": _optional(_integer(2))(value.get("probe_size"), f"{name}.probe_size"),
    }


def _option(default: Any, check: Check, *, alias: str | None = None) -> Any:
    """A settings field: its default, its check and (rarely) the longer name it has outside its section."""
    return dataclasses.field(default=default, metadata={"check": check, "alias": alias})


class _Section:
    """Validation shared by every section: each field's own check, then the checks across fields."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            object.__setattr__(self, field.name, field.metadata["check"](getattr(self, field.name), field.name))
        self._check_together(dataclasses.asdict(self), "")  # type: ignore[call-overload]

    @classmethod
    def _check_together(cls, values: Mapping[str, Any], prefix: str) -> None:
        """Checks that involve several fields (``prefix`` is the section's key path in messages)."""

    def replace(self, **changes: Any) -> Any:
        """A copy with ``changes`` (validated).

        Raises:
            ConfigError: an unknown field (with the closest one and the valid ones).
        """
        valid = sorted(f.name for f in dataclasses.fields(self))  # type: ignore[arg-type]
        unknown = sorted(set(changes) - set(valid))
        if unknown:
            key = unknown[0]
            raise ConfigError(f"unknown argument `{key}`{_did_you_mean(key, valid)} Valid arguments: {valid}")
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


@dataclasses.dataclass(frozen=True)
class ProbeSettings(_Section):
    """Which layer is watched, and how the probe runs.

    Attributes:
        layer: the watched module's name in ``model.named_modules()``, or name patterns tried in order
            (``"*.ln_f"``; see `topocallbacks.probe.resolve_layer`). Required to run a probe.
        pooling: how the layer's output becomes one vector per sample: ``"auto"`` (2-D as is, 4-D global
            average, 3-D mask-aware mean), ``"mean"`` (mask-aware over tokens), ``"last"`` (last non-padding
            token), ``"cls"`` (first token), ``"flatten"`` or ``"none"``.
        size: keep at most this many probe samples, a seeded subset (None: all); ``max_probe_samples`` as an
            override.
        batch_size: probe samples per forward pass.
        precision: the probe pass's precision: ``"auto"`` (the trainer's: the training callbacks run it in their
            framework's autocast context; a plain monitor in the model's own dtype), ``"32"``, ``"bf16"`` or
            ``"16"`` (autocast on the model's device).
        stop_at_layer: end each probe forward as soon as the watched layer has run (nothing after it is computed,
            e.g. a language model's vocabulary-wide head); turn off for a model that catches every exception in
            its forward. Off by itself for sharded models (FSDP), whose forward must run to its end on every rank.
        max_length: a text probe (a list of strings with ``tokenizer=``) is truncated to this many tokens (None:
            the tokenizer's ``model_max_length``, at most 512).
        layers: several layers watched in one probe pass, each with its own ε, transform, index and history
            (probe mode only): module names, ``fnmatch`` patterns (each stands for every module it matches that is
            not inside another match: ``"transformer.h.*"`` is the GPT blocks) or a shortcut of ``shortcuts``
            (``"all_blocks"``). ``layer``, when given, is watched too and is the *primary* layer the policy acts
            on by default (``policy.layer_rule``); else the first layer found is. None: ``layer`` alone.
        shortcuts: names for groups of layers a preset defines for its architecture, each a list of patterns tried
            in order (the first that matches any module gives all its matches), e.g.
            ``{"all_blocks": ["transformer.h.*", "*.transformer.h.*"]}``.
    """

    layer: tuple[str, ...] | None = _option(None, _optional(_layers))
    pooling: str = _option("auto", _choice(POOLINGS))
    size: int | None = _option(None, _optional(_integer(2)), alias="max_probe_samples")
    batch_size: int = _option(256, _integer(1))
    precision: str = _option("auto", _choice(PRECISIONS))
    stop_at_layer: bool = _option(True, _boolean)
    max_length: int | None = _option(None, _optional(_integer(1)))
    layers: tuple[str, ...] | None = _option(None, _optional(_layer_list))
    shortcuts: dict[str, tuple[str, ...]] | None = _option(None, _optional(_shortcuts))


@dataclasses.dataclass(frozen=True)
class ScheduleSettings(_Section):
    """When checks happen.

    Attributes:
        mode: ``"probe"`` (run the probe every ``check_every`` steps) or ``"stream"`` (watch the training
            batches' own features, a window of the last ``window`` points).
        check_every: optimizer steps between checks, from step 0. 100 is a cost choice: a check of a 512-sample
            probe takes about 0.4 s of one CPU thread.
        window: streaming window size.
        points_per_batch: streaming mode: keep a seeded random subset of at most this many of each batch's points
            (None: all). 32 refreshes a 1,024-point window every 32 steps at a small fraction of the cost of
            pushing whole batches.
        background: evaluate checks in a background worker process while training goes on (True), in the
            training loop (False), or None: in the background when the model trains on an accelerator. A
            background check's decision is applied ``lag`` steps after its features were taken, on every rank.
        lag: steps between a check and the step at which its decision is applied, in the background (None: half
            the check interval, at most 20 steps, at least 1; with an ``overhead_budget``, as many steps as hide the
            worker's evaluation, up to the next check). If the worker is late the loop waits there, and the record
            says how long (``wait_ms``).
        worker_threads: threads the background worker's numerical libraries may use (when the overhead budget moves
            the checks of a model trained on the CPU to the worker: at most the cores the training's threads leave
            free).
        worker_timeout: seconds the training loop waits for the worker at a check's applied step before it counts
            the worker as stuck, from the moment the worker says it is ready (a worker still starting gets up to
            120 s, ``topocallbacks._worker.START_TIMEOUT``: a busy machine can take several seconds to start one); a
            stuck or dead worker is replaced once (the new one gets the checks it had not answered), then the checks
            run in the loop, each time with one warning: training never hangs and never raises because of the
            worker.
        check_budget_ms: streaming mode: the window is capped so that the engine's predicted time for a check of
            it (a rebuild, the worst case) stays within this budget; the record gives the window used.
        overhead_budget: the share of the training step time the monitor may cost the loop (probe pass, waits for
            the worker, evaluation in the loop, snapshots, records): 0.02 by default (the figure
            ``benchmarks/DEFAULT_BUDGET.md`` chose by its pre-registered rule in stage 4), or None
            (measured and logged, not enforced: checks at exactly the configured cadence, where and on the probe
            configured, so that a run's checks and decisions do not depend on the machine's speed, e.g. for a test
            that counts them). The share is measured at every check (``topo/overhead``, whatever this
            setting) and, with a budget, kept by adapting the checks the schedule calls (``on_step``), in this order
            and only as far as needed, planned on the cheaper of the last two intervals: where checks are evaluated
            (the background worker, when ``background`` is automatic and a core is free), the lag of a background
            check's decision (when ``lag`` is automatic: enough steps to hide the evaluation, at most until the next
            check), the cadence (more ``check_every`` intervals between checks, at most `FLOOR_INTERVALS`), the
            probe size (halved down to `MIN_PROBE`, when ``max_probe_samples`` is automatic, during the warm-up: it
            restarts the calibration). When even that misses the budget, one warning says what was chosen
            (`topocallbacks.budget`). The budget plans **once**, at the third check the schedule calls (on the
            cheaper of the two intervals before it: the first check's one-off costs are not planned on), and keeps
            that plan for the rest of the run, so that the run's decisions do not follow the machine's load from
            check to check; the plan is in the history (the record of that check), the checkpointed state and the
            summary, which gives the ``plan=`` that reruns it.
        plan: a plan the budget made, to follow again instead of planning (`Plan.settings`, e.g. ``{"at_step": 20,
            "intervals": 2, "background": True, "lag": 15, "probe_size": 128}``): taken at the first check the
            schedule calls at or after ``at_step``, whatever ``overhead_budget`` is, so that a run whose plan came
            from one machine's timings reruns with the same checks and decisions on another.
    """

    mode: str = _option("probe", _choice(MODES))
    check_every: int = _option(100, _integer(1))
    window: int = _option(1024, _integer(2))
    points_per_batch: int | None = _option(32, _optional(_integer(1)))
    background: bool | None = _option(None, _optional(_boolean))
    lag: int | None = _option(None, _optional(_integer(0)))
    worker_threads: int = _option(2, _integer(1))
    worker_timeout: float = _option(60.0, _positive)
    check_budget_ms: float = _option(250.0, _positive)
    overhead_budget: float | None = _option(0.02, _optional(_positive))
    plan: dict[str, Any] | None = _option(None, _optional(_plan))

    @property
    def apply_lag(self) -> int:
        """The ``lag`` in effect in the background (see above)."""
        return self.lag if self.lag is not None else max(1, min(self.check_every // 2, 20))


@dataclasses.dataclass(frozen=True)
class TransformSettings(_Section):
    """The fixed map applied to the features before the topology (`FeatureTransform`).

    Attributes:
        normalize: centre each check's cloud and scale it to unit RMS radius, so that a fixed ε keeps its meaning
            while the network's feature scale drifts (in streaming mode the centre and scale are fitted once, on
            the first batch, to keep the window's coordinates fixed).
        projection: None, ``"pca"`` (fitted at the first check and kept) or ``"random"`` (a seeded Gaussian
            projection): a fixed map to ``projection_dim`` dimensions, so points stay comparable across checks.
        projection_dim: target dimension of the projection.
    """

    normalize: bool = _option(True, _boolean)
    projection: str | None = _option(None, _choice(PROJECTIONS))
    projection_dim: int = _option(64, _integer(1))


@dataclasses.dataclass(frozen=True)
class IndexSettings(_Section):
    """How a cloud becomes the index the policy watches.

    Attributes:
        name: ``"diagram_drift"`` (the default: the Wasserstein-1 distance between this check's H0/H1 diagrams
            and the previous check's; the collapse-evidence suite's best feature index at <= 2 % false positives),
            ``"paper"`` (the paper's composite Collapse Index) or ``"rankme"`` (effective rank; handed to the
            policy negated, as collapse lowers it). The composite and its components are computed and logged
            either way. ``index`` as an override.
        epsilon: a fixed ε, or None to calibrate at the first check.
        epsilon_degree: the calibration's target: ε is the distance at which the points of the first check's
            cloud (or streaming window) have this many ε-neighbours on average, so that the ε-graph is informative
            whatever the feature dimension: neither every point isolated (β0 = n) nor one blob (β0 = 1). On real
            clouds (an MLP's and a GPT's features, MiniLM sentence embeddings, Gaussians in 8 and 384 dimensions)
            a mean degree of 8 leaves 8-27 % of the points as components and β1 near its largest; the median
            heuristic (``epsilon_quantile=0.5, epsilon_factor=0.5``) isolated 93-100 % of the points of the 384-d
            and GPT clouds and left the MLP's one blob. A streaming window whose mean degree leaves
            `DEGREE_BAND` at a check that is not flagged is recalibrated
            to this degree (the record's ``report.epsilon`` says which ε a check used).
        epsilon_quantile: a fixed quantile of pairwise distances in ``(0, 1]`` to calibrate on instead of
            ``epsilon_degree`` (0.5: the median, the paper's heuristic), or None...
        epsilon_factor: ...times this factor (the paper's heuristic: 0.5).
        weights: the composite's weights, ``"paper"`` (0.4/0.3/0.3) or a mapping of component weights.
        max_points: size of the seeded subsample the persistence diagrams are computed on (full H1 persistence
            is cubic; 256 points take tens of milliseconds).
    """

    name: str = _option("diagram_drift", _choice(INDEX_NAMES), alias="index")
    epsilon: float | None = _option(None, _optional(_positive))
    epsilon_degree: float = _option(8.0, _positive)
    epsilon_quantile: float | None = _option(None, _optional(_number(0.0, 1.0, high_open=False)))
    epsilon_factor: float = _option(1.0, _positive)
    weights: str | dict[str, float] = _option("paper", _weights)
    max_points: int = _option(256, _integer(2))


@dataclasses.dataclass(frozen=True)
class PolicySettings(_Section):
    """When to act, and how (see `Policy`).

    The defaults are the rule the rescue suite chose (``benchmarks/rescue/``, results in
    ``benchmarks/results/rescue.md``), among candidates and actions designed on the suite's first results
    (``benchmarks/rescue/HISTORY.md`` dates each step; ``docs/evidence.md`` gives the figures outside them), with
    the rollback order chosen among the candidates pre-registered in ``benchmarks/PREREGISTERED.md`` on the design
    runs alone (``benchmarks/results/rescue_candidates.md``): roll back when the probe's index (diagram drift) and
    the training loss both jump, 4.5 robust standard deviations above their recent checks, skip the updates of two
    check intervals after each rollback, cut the learning rate by 0.5 (compounding) only when a rollback fires again
    within two checks of the previous one, at most 4 rollbacks, then stop at the last healthy state. The loss
    confirms the index: alone, the index raised false alarms on healthy runs. Absolute sentinels
    (`topocallbacks.functional.sentinels`) act on a total collapse at any check, warm-up or not. ``action``
    changes only what is done.

    Attributes:
        action: ``"rollback"`` (to the newest healthy snapshot), ``"warn"``, ``"lower_lr"``, ``"stop"`` or
            ``"none"`` (log only).
        score: how the index is scored: ``"value"`` (the index itself), ``"baseline"`` (its excess over the warm-up
            mean) or ``"zscore"`` (`trailing_zscore` against the last ``zscore_window``
            scored checks that did not reach the threshold). The training channels are always scored by the
            z-score, with a noise floor of 1 % of their own scale (the largest value they reached at a healthy
            check), so a loss near zero does not turn a tiny blip into thousands of standard deviations.
        threshold: the score a check must reach.
        patience: consecutive checks at or above the threshold.
        warmup: checks that only build the reference.
        zscore_window: checks in the z-score's level (its noise uses twice as many).
        cooldown: checks after an action during which the *same* action is held back, unless the score exceeds
            the one that started the cooldown; a stronger action always goes through, and so does a rollback
            (``max_rollbacks`` bounds those).
        trend_window: checks in the rising-trend fit, or None for no trend rule.
        trend_slope: the slope per check that fires the trend rule; required with ``trend_window``.
        lr_factor: learning-rate multiplier of ``lower_lr``, in ``(0, 1)``.
        max_lr_cuts: cuts before ``lower_lr`` escalates to ``after_max_lr_cuts``.
        after_max_lr_cuts: ``"warn"``, ``"stop"`` or ``"none"``.
        checkpoint: ask for a rescue checkpoint with ``lower_lr``, ``rollback`` and ``stop``.
        on_diverged: the action for a diverged check (NaN or Inf features, loss or gradient norm), at once, warm-up
            or not.
        sentinels: act on a total collapse of the features (constant, on one line, or one point at the scale;
            `topocallbacks.functional.sentinels`) with ``action``, at any check, warm-up or not.
        rollback_lr_factor: ``rollback`` also multiplies the learning rate by this factor (None: the first rollback
            keeps the rate; every later one cuts it by ``lr_factor``). The cuts compound: after the k-th cutting
            rollback the rates are the snapshot's times the product of the k cuts (restoring a snapshot would
            otherwise undo the earlier ones), and a stop after the last rollback keeps them.
        rollback_skip: after a rollback, the next this many optimizer updates are skipped (their batches are
            seen, their gradients dropped, the schedulers step as usual), so training also moves past a burst of
            bad data longer than the steps a rollback undoes (PaLM skipped 200-500 batches after its rollbacks).
            None: the updates of two check intervals (``2 * check_every``; the rescue suite's 20 at checks every
            10).
        rollback_order: when a rollback skips and when it cuts the rate: ``"cut_if_refired"`` (the default: every
            rollback skips ``rollback_skip`` updates; one cuts by ``rollback_lr_factor``, or ``lr_factor`` when
            that is None, compounding, only when it fires within two checks of the previous rollback: a fault that
            outlives the skip), ``"skip_and_cut"`` (every rollback skips and cuts by ``rollback_lr_factor``,
            compounding; the default before the pre-registered choice), ``"skip_if_confirmed"`` (as
            ``"skip_and_cut"``, but the skip waits for the next check and is made only if the training loss flags
            again there; needs ``"loss"`` in ``channels``) or ``"from_second"`` (the first rollback neither skips
            nor cuts, every later one does both).
        max_rollbacks: rollbacks before ``rollback`` escalates to ``after_max_rollbacks``.
        after_max_rollbacks: ``"stop"``, ``"warn"`` or ``"none"``. A stop first restores the last healthy
            snapshot (see ``stop_restores``), so it never leaves the weights of the fault.
        stop_restores: ``"always"`` (a stop restores the last healthy snapshot first) or ``"if_better"`` (only when
            the mean training loss of the last two checks is above the loss at that snapshot's check; otherwise
            training stops where it is, its weights kept: a stop late in a run then does not throw away more
            progress than the fault cost).
        snapshot_health: which channels must be settled for a check to count as healthy, so that its state is kept
            as a rollback snapshot: ``"all"`` (every training channel, watched or not: an unwatched gradient norm
            that spikes keeps checks unsettled) or ``"watched"`` (only the channels the rule watches).
        channels: what the rule watches: ``"index"`` (the probe's index), ``"loss"`` and ``"grad_norm"`` (the
            training loss and gradient norm the adapters pass, averaged over the steps since the last check; each
            scored like the index, as a rise). Non-finite loss or gradient norm makes the check a diverged one.
        require: how many channels must hold at one check (1: any of them; ``len(channels)``: all).
        layer_rule: with several layers (``probe.layers``): ``"primary"`` (the rule watches the primary layer;
            the others are scored and logged only), ``"any"`` (acts when the rule holds on any layer), ``"all"``,
            or a number k (on at least k layers). Every layer is judged by this rule on its own history; a check
            acts once, whatever the number of layers, and its reason says which layer moved first and by how much.
    """

    action: str = _option("rollback", _choice(tuple(a.value for a in Action)))
    score: str = _option("zscore", _choice(SCORES))
    threshold: float = _option(4.5, _number())
    patience: int = _option(1, _integer(1))
    warmup: int = _option(10, _integer(0))
    zscore_window: int = _option(10, _integer(2))
    cooldown: int = _option(5, _integer(0))
    trend_window: int | None = _option(None, _optional(_integer(2)))
    trend_slope: float | None = _option(None, _optional(_positive))
    lr_factor: float = _option(0.5, _number(0.0, 1.0))
    max_lr_cuts: int = _option(3, _integer(0))
    after_max_lr_cuts: str = _option("stop", _choice(("warn", "stop", "none")))
    checkpoint: bool = _option(False, _boolean)
    on_diverged: str = _option("rollback", _choice(tuple(a.value for a in Action)))
    sentinels: bool = _option(True, _boolean)
    rollback_lr_factor: float | None = _option(0.5, _optional(_number(0.0, 1.0)))
    rollback_skip: int | None = _option(None, _optional(_integer(0)))
    rollback_order: str = _option("cut_if_refired", _choice(ROLLBACK_ORDERS))
    max_rollbacks: int = _option(4, _integer(0))
    after_max_rollbacks: str = _option("stop", _choice(("warn", "stop", "none")))
    stop_restores: str = _option("always", _choice(("always", "if_better")))
    snapshot_health: str = _option("all", _choice(("all", "watched")))
    channels: tuple[str, ...] = _option(("index", "loss"), _channels)
    require: int = _option(2, _integer(1))
    layer_rule: str | int = _option("primary", _layer_rule)

    @classmethod
    def _check_together(cls, values: Mapping[str, Any], prefix: str) -> None:
        window, slope = values.get("trend_window"), values.get("trend_slope")
        if (window is None) != (slope is None):
            raise InputError(
                f"`{prefix}trend_window` and `{prefix}trend_slope` go together, got trend_window={window!r}, "
                f"trend_slope={slope!r}"
            )
        channels, require = values.get("channels", ("index", "loss")), values.get("require", 2)
        if values.get("rollback_order") == "skip_if_confirmed" and "loss" not in channels:
            raise InputError(
                f"`{prefix}rollback_order` 'skip_if_confirmed' waits for the training loss to confirm a burst, so "
                f"`{prefix}channels` must include 'loss', got {list(channels)}"
            )
        if require > len(channels):
            raise InputError(
                f"`{prefix}require` must be at most the number of `{prefix}channels` ({len(channels)}: "
                f"{list(channels)}), got {require}"
            )


#: Each silent family's registered rule, ``(threshold, patience, sentinels)``: ``"drift"`` as round 2 of the silent
#: suite chose it (``benchmarks/silent/ROUND2.md``, stage 2), ``"geometry"`` as round 5 chose it on round 4's 36 healthy
#: runs (``benchmarks/silent/ROUND5.md``, stage 2). `SilentSettings` fields left at None take these.
SILENT_FAMILIES: dict[str, tuple[float, int, bool]] = {"drift": (12.0, 2, True), "geometry": (4.5, 3, False)}


@dataclasses.dataclass(frozen=True)
class SilentSettings(_Section):
    """The silent path: a warning when the probe's representation drifts or degenerates, whatever the loss does.

    **Off by default** (``silent_path=True`` turns it on). The loud path (`PolicySettings`) waits for the loss; this one
    does not. Probe mode only: a streaming window has no fixed inputs to compare. Two families of signals, each with
    the rule the silent suite registered for it (`SILENT_FAMILIES`; the evidence page has the figures):

    * ``"drift"`` (round 2's choice, the default family): at every check after ``warmup`` checks, against the
      features and the persistence diagrams of the last warm-up check (the reference), the diagram drift and 1 -
      linear CKA, each divided by the checks elapsed since the reference, each scored against its own trailing
      checks (the rule's robust z-score); a drift alarms when its score is ``>= threshold`` (12) at ``patience`` (2)
      consecutive checks. With ``sentinels`` (on for this family) it also alarms at once on a rank squeeze
      (effective rank <= 1.5), a cone (mean pairwise cosine of the raw features >= 0.95) or a shrinkage (RMS radius
      <= 0.1 x the warm-up's). It caught none of round 2's held-out faults; round 3 found no candidate that catches
      a fault whose harm is in what the monitor watches at no healthy alarm, so the path ships off.
    * ``"geometry"`` (rounds 4 and 5's choice): the embedding's absolute-scale geometry, each signal scored against
      the warm-up checks' median and spread (frozen there) in the direction a collapse moves it: the RMS radius over
      the warm-up's (falls), Lightly's std of the L2-normalised embeddings (falls), the top covariance eigenvalue's
      share (rises), the mean pairwise cosine (rises: a cone), and the clusters holding >= 1 % of the probe at a
      scale fixed at the last warm-up check (modes lost since then); a signal alarms when its score is ``>=
      threshold`` (4.5) at ``patience`` (3) consecutive checks; no sentinels. Held out it caught round 4's VICReg
      variance collapse and round 5's contrastive embedding with shuffled labels before their harm, at no healthy
      alarm, but misses other held-out classes, so by its registered ship rule it is an opt-in.

    Attributes:
        enabled: watch for silent collapse (``silent_path`` as a flat option).
        family: the signals watched, ``"drift"`` or ``"geometry"`` (``silent_family``).
        action: what a silent alarm does: ``"warn"`` (a warning, a logger marker and the reason in the history) or
            ``"stop"`` (restoring the last healthy snapshot first, as the loud path's stop does)
            (``silent_action``).
        threshold: the robust z-score that counts; None: the family's (``silent_threshold``).
        patience: consecutive checks a signal must stay at or above ``threshold``; None: the family's
            (``silent_patience``).
        warmup: checks before the reference is taken; the signals are judged after it (``silent_warmup``).
        sentinels: also alarm on the three absolute sentinels; None: the family's (``silent_sentinels``).
    """

    enabled: bool = _option(False, _boolean, alias="silent_path")
    family: str = _option("drift", _choice(tuple(SILENT_FAMILIES)), alias="silent_family")
    action: str = _option("warn", _choice(("warn", "stop")), alias="silent_action")
    threshold: float | None = _option(None, _optional(_positive), alias="silent_threshold")
    patience: int | None = _option(None, _optional(_integer(1)), alias="silent_patience")
    warmup: int = _option(10, _integer(2), alias="silent_warmup")
    sentinels: bool | None = _option(None, _optional(_boolean), alias="silent_sentinels")

    @property
    def rule(self) -> tuple[float, int, bool]:
        """``(threshold, patience, sentinels)`` in effect: each field, or the family's registered value where None."""
        threshold, patience, sentinels = SILENT_FAMILIES[self.family]
        return (threshold if self.threshold is None else self.threshold,
                patience if self.patience is None else self.patience,
                sentinels if self.sentinels is None else self.sentinels)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class InterventionSettings(_Section):
    """How decisions are carried out by the training adapters.

    Attributes:
        checkpoint_on_stop: save a checkpoint before stopping, so a stop never loses the last state.
        rescue_dir: where the Lightning callback writes rescue checkpoints (None: ``trainer.default_root_dir``;
            the Hugging Face Trainer saves into its ``output_dir``).
        snapshots: healthy snapshots kept for ``rollback`` (model, optimizers, schedulers, grad scaler and the
            monitor's check state, taken when a check is judged healthy; only while a rule can roll back).
        snapshot_dir: None keeps them in host memory; a directory keeps them there as ``torch.save`` files (for
            models whose copies would not fit in memory). A stop writes the newest one there too, or into
            ``rescue_dir`` when snapshots live in memory.
    """

    checkpoint_on_stop: bool = _option(True, _boolean)
    rescue_dir: str | None = _option(None, _optional(_filepath))
    snapshots: int = _option(2, _integer(1))
    snapshot_dir: str | None = _option(None, _optional(_filepath))


@dataclasses.dataclass(frozen=True)
class OutputSettings(_Section):
    """Where records go besides the in-memory history.

    Attributes:
        history_path: a JSONL file that receives one line per check and per intervention.
        tensorboard_dir: a TensorBoard log directory for ``topo/*`` scalars.
        diagram_every: checks between persistence-diagram figures in TensorBoard (0: never).
        prefix: the names' prefix in loggers and TensorBoard (``topo/index``, ...); None: ``topo``, or
            ``topo/<layer>`` when several callbacks are attached to one trainer, so their metrics never collide.
        summary: print a summary at the end of training (checks, warnings, interventions and their reasons, where
            the history went), once, on rank 0.
        console: the Hugging Face callback also prints each check's values to the Trainer's console (its progress
            bar or printer), as a Trainer log does; False sends them to the ``report_to`` loggers only.
    """

    history_path: str | None = _option(None, _optional(_filepath))
    tensorboard_dir: str | None = _option(None, _optional(_filepath))
    diagram_every: int = _option(0, _integer(0))
    prefix: str | None = _option(None, _optional(_text))
    summary: bool = _option(True, _boolean)
    console: bool = _option(True, _boolean)


#: The default rule of each index, when no policy is given: the rescue suite's rule (the `PolicySettings`
#: defaults), and for the paper's composite, which lives in ``[0, 1]``, a fixed threshold on the index alone (the
#: same actions).
DEFAULT_RULES: Mapping[str, PolicySettings] = types.MappingProxyType(
    {
        "diagram_drift": PolicySettings(),
        "rankme": PolicySettings(),
        "paper": PolicySettings(score="value", threshold=0.7, patience=3, warmup=3, channels=("index",), require=1),
    }
)

_SECTIONS: dict[str, type[_Section]] = {
    "probe": ProbeSettings,
    "schedule": ScheduleSettings,
    "transform": TransformSettings,
    "index": IndexSettings,
    "policy": PolicySettings,
    "interventions": InterventionSettings,
    "silent": SilentSettings,
    "output": OutputSettings,
}


def _did_you_mean(key: str, valid: list[str], prefix: str = "") -> str:
    guess = difflib.get_close_matches(key, valid, n=1)
    return f"; did you mean `{prefix}{guess[0]}`?" if guess else ""


def _built_sections(
    values: Mapping[str, dict[str, Any]], whole: Mapping[str, Any], overrides: Mapping[str, Any], origin: str | None
) -> dict[str, Any]:
    """Every section but the policy: the one given whole, else one built (and validated) from its merged values."""
    return {
        name: whole[name] if name in whole else _build(kind, values[name], _path(name, overrides, origin), origin)
        for name, kind in _SECTIONS.items()
        if name != "policy"
    }


def _merged_policy(
    policy: PolicySettings | None, values: Mapping[str, Any], index: str, origin: str | None
) -> PolicySettings:
    """The rule in effect (``policy``; None: the default rule of ``index``) with ``values`` merged in, validated."""
    base = policy if policy is not None else DEFAULT_RULES[index]
    merged: PolicySettings = _build(PolicySettings, {**dataclasses.asdict(base), **values}, "policy.", origin)
    return merged


def _where(origin: str | None) -> str:
    return f" in {origin}" if origin else ""


@dataclasses.dataclass(frozen=True)
class MonitorSettings:
    """Every option of a [`TopoMonitor`][topocallbacks.TopoMonitor] and of the training callbacks.

    Build one with keyword overrides (``MonitorSettings().merged({"check_every": 20})``), from a preset
    (``topocallbacks.presets.load("gpt").settings``) or section by section. ``policy`` None means the default
    rule of the watched index (`DEFAULT_RULES`); `rule` is the policy in effect.

    Attributes:
        probe: see `ProbeSettings`.
        schedule: see `ScheduleSettings`.
        transform: see `TransformSettings`.
        index: see `IndexSettings`.
        policy: see `PolicySettings`, or None.
        interventions: see `InterventionSettings`.
        silent: see `SilentSettings` (the silent path).
        output: see `OutputSettings`.
        seed: seed of every random choice (probe subset, random projection, diagram subsample), >= 0.

    Examples:
        >>> settings = MonitorSettings().merged({"check_every": 20, "policy": {"action": "lower_lr"}})
        >>> settings.schedule.check_every, settings.rule.action, settings.rule.threshold
        (20, 'lower_lr', 4.5)
        >>> MonitorSettings().merged({"index": "paper"}).rule.threshold  # the composite's own default rule
        0.7
    """

    probe: ProbeSettings = dataclasses.field(default_factory=ProbeSettings)
    schedule: ScheduleSettings = dataclasses.field(default_factory=ScheduleSettings)
    transform: TransformSettings = dataclasses.field(default_factory=TransformSettings)
    index: IndexSettings = dataclasses.field(default_factory=IndexSettings)
    policy: PolicySettings | None = None
    interventions: InterventionSettings = dataclasses.field(default_factory=InterventionSettings)
    silent: SilentSettings = dataclasses.field(default_factory=SilentSettings)
    output: OutputSettings = dataclasses.field(default_factory=OutputSettings)
    seed: int = 0

    #: Options by the name an override gives them: ``{"check_every": ("schedule", "check_every"), ...}``.
    OPTIONS: ClassVar[Mapping[str, tuple[str, str]]]

    def __post_init__(self) -> None:
        for name, kind in _SECTIONS.items():
            value = getattr(self, name)
            if not (value is None and name == "policy") and not isinstance(value, kind):
                raise InputError(f"`{name}` must be a {kind.__name__}, got {type(value).__name__}")
        object.__setattr__(self, "seed", check_int(self.seed, "seed", minimum=0))
        layers, rule = self.probe.layers, self.rule.layer_rule
        if layers is not None and self.schedule.mode == "stream":
            raise InputError(
                f"`layers` ({list(layers)}) works in probe mode only, got mode='stream': streaming several layers "
                "would copy each one's features at every training step; watch one `layer` in streaming mode"
            )
        if layers is None and rule != "primary":
            raise InputError(f"`policy.layer_rule` {rule!r} needs several layers: pass `layers=[...]`")

    @property
    def rule(self) -> PolicySettings:
        """The policy in effect: ``policy``, or the default rule of the watched index."""
        return self.policy if self.policy is not None else DEFAULT_RULES[self.index.name]

    @property
    def rollback_skip(self) -> int:
        """The updates skipped after a rollback: ``policy.rollback_skip``, or two check intervals."""
        skip = self.rule.rollback_skip
        return 2 * self.schedule.check_every if skip is None else skip

    def merged(self, overrides: Mapping[str, Any], *, origin: str | None = None) -> MonitorSettings:
        """A copy with ``overrides`` applied and validated.

        Args:
            overrides: options by name (``check_every``, ``max_probe_samples``, ``seed``...); section names with a
                mapping merged into that section (``{"policy": {"patience": 5}}``; a policy mapping is merged into
                the policy in effect, `rule`) or a section value that replaces it (for ``policy``, also a
                `Policy`, which counts by its settings).
            origin: where the overrides come from (a file), named in error messages; with an origin, keys are
                reported with their section (``policy.patience``) and out-of-range values raise ConfigError.

        Raises:
            ConfigError: an unknown key (with the valid keys and the closest one), or a bad value from ``origin``.
            InputError: a bad value given directly (the message names it as it was given).
        """
        values = {name: dataclasses.asdict(getattr(self, name)) for name in _SECTIONS if name != "policy"}
        whole: dict[str, _Section | None] = {}
        policy_values: dict[str, Any] | None = None
        seed = self.seed
        for key, value in overrides.items():
            if key == "policy" and isinstance(getattr(value, "settings", None), PolicySettings):
                value = value.settings  # a Policy object: its settings (its counters start afresh)
            section_value = isinstance(value, (Mapping, _Section)) or (key == "policy" and value is None)
            if key in _SECTIONS and (section_value or key not in self.OPTIONS):
                policy_values = self._override_section(key, value, values, whole, policy_values, origin)
            elif key == "seed":
                seed = value
            elif key in self.OPTIONS:
                section, field = self.OPTIONS[key]
                values[section][field] = value
                whole.pop(section, None)
            else:
                self._unknown(key, origin)
        sections = _built_sections(values, whole, overrides, origin)
        policy: Any = whole.get("policy", self.policy)
        if policy_values is not None:
            policy = _merged_policy(policy, policy_values, sections["index"].name, origin)
        try:
            return MonitorSettings(**sections, policy=policy, seed=seed)
        except InputError as exc:
            raise _located(exc, origin) from exc

    @classmethod
    def _override_section(
        cls,
        key: str,
        value: Any,
        values: dict[str, dict[str, Any]],
        whole: dict[str, _Section | None],
        policy_values: dict[str, Any] | None,
        origin: str | None,
    ) -> dict[str, Any] | None:
        """Apply one section's override for `merged`; the policy mapping to merge into the policy in effect, so far.

        A mapping is merged into the section's ``values`` (for the policy, into ``policy_values``); a section value
        (or None for the policy) replaces the whole section in ``whole``, dropping the policy mapping merged so far.

        Raises:
            InputError: ``value`` is neither a mapping nor the section's class.
        """
        if value is None and key == "policy":
            whole["policy"] = None
            return None
        if isinstance(value, _SECTIONS[key]):
            whole[key] = value
            return None if key == "policy" else policy_values
        if not isinstance(value, Mapping):
            raise InputError(
                f"`{key}` must be a mapping of its options or a {_SECTIONS[key].__name__}, got "
                f"{type(value).__name__}{_where(origin)}"
            )
        cls._reject_unknown(value, key, origin)
        if key == "policy":
            return {**(policy_values or {}), **value}
        values[key].update(value)
        whole.pop(key, None)
        return policy_values

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready nested copy (``MonitorSettings().merged(settings.as_dict()) == settings``)."""
        result = dataclasses.asdict(self)
        layer = result["probe"]["layer"]
        result["probe"]["layer"] = None if layer is None else list(layer)
        for key in ("layers",):
            value = result["probe"][key]
            result["probe"][key] = None if value is None else list(value)
        shortcuts = result["probe"]["shortcuts"]
        if shortcuts is not None:
            result["probe"]["shortcuts"] = {name: list(patterns) for name, patterns in shortcuts.items()}
        if result["policy"] is not None:
            result["policy"]["channels"] = list(result["policy"]["channels"])
        return result

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, origin: str | None = None) -> MonitorSettings:
        """The inverse of `as_dict`; also reads a preset's sections (sparse: the rest keeps its default).

        Raises:
            ConfigError: unknown keys or sections, or bad values (named with their key path and ``origin``).
        """
        return cls().merged(data, origin=origin or "<dict>")

    @staticmethod
    def _reject_unknown(values: Mapping[str, Any], section: str, origin: str | None) -> None:
        valid = sorted(f.name for f in dataclasses.fields(_SECTIONS[section]))  # type: ignore[arg-type]
        unknown = sorted(str(k) for k in set(values) - set(valid))
        if unknown:
            key = unknown[0]
            raise ConfigError(
                f"unknown key `{section}.{key}`{_where(origin)}{_did_you_mean(key, valid, section + '.')} "
                f"Valid keys of {section}: {valid}"
            )

    @classmethod
    def _unknown(cls, key: str, origin: str | None) -> None:
        if origin:
            valid = sorted([*_SECTIONS, "seed"])
            raise ConfigError(f"unknown key `{key}`{_where(origin)}{_did_you_mean(key, valid)} Valid keys: {valid}")
        valid = sorted({*cls.OPTIONS, *_SECTIONS, "seed"})
        if key in {f.name for f in dataclasses.fields(PolicySettings)}:
            raise ConfigError(f"unknown argument `{key}`: it is a policy option, pass policy={{{key!r}: ...}}")
        raise ConfigError(f"unknown argument `{key}`{_did_you_mean(key, valid)} Valid arguments: {valid}")


def _path(section: str, overrides: Mapping[str, Any], origin: str | None) -> str:
    """The prefix error messages give a section's keys: the section when it came from a file or a mapping."""
    return f"{section}." if origin or isinstance(overrides.get(section), Mapping) else ""


def _located(exc: InputError, origin: str | None) -> InputError:
    if origin is None:
        return exc
    return ConfigError(f"{exc}{_where(origin)}")


def _build(kind: type[_Section], values: Mapping[str, Any], prefix: str, origin: str | None) -> Any:
    """A section from its values, each checked under the name it was given by (``prefix`` + key, or its alias)."""
    aliases = {f.name: f.metadata["alias"] for f in dataclasses.fields(kind)}  # type: ignore[arg-type]
    checked = {}
    try:
        for field in dataclasses.fields(kind):  # type: ignore[arg-type]
            name = field.name if prefix or aliases[field.name] is None else aliases[field.name]
            checked[field.name] = field.metadata["check"](values[field.name], f"{prefix}{name}")
        kind._check_together(checked, prefix)
    except InputError as exc:
        raise _located(exc, origin) from exc
    return kind(**checked)


def _options() -> dict[str, tuple[str, str]]:
    options: dict[str, tuple[str, str]] = {}
    for section, kind in _SECTIONS.items():
        if section == "policy":
            continue  # policy options are given as policy={...}: names such as `action` would be ambiguous
        for field in dataclasses.fields(kind):  # type: ignore[arg-type]
            name = field.metadata["alias"] or field.name
            if name in options or (name in _SECTIONS and field.metadata["alias"] is None):
                raise RuntimeError(f"settings option `{name}` is defined twice")  # pragma: no cover
            options[name] = (section, field.name)
    return options


MonitorSettings.OPTIONS = types.MappingProxyType(_options())
