"""The rescuer: carries a check's decision out, keeping the snapshots of healthy states a rollback goes back to.

Rollback with a skip and compounding cuts, the last healthy state restored before a stop; what a snapshot holds and
where it is kept is [`topocallbacks.snapshots`][topocallbacks.snapshots]'s.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Protocol

from ._state import StateFields, Stateful
from .check import CheckRecord, InterventionRecord
from .distributed import all_gather_object, rank_and_world
from .exceptions import InputError, SnapshotUnsupported
from .interventions import Actuator
from .policy import Decision
from .settings import Action, MonitorSettings, PolicySettings
from .snapshots import Snapshot, SnapshotStore

__all__ = ["HealthySnapshots", "MonitorHooks", "Rescuer"]


class MonitorHooks(Protocol):
    """What the rescuer calls on the monitor (`TopoMonitor`) when it carries a decision out."""

    def reference_diagrams(self) -> Any:
        """What drift is measured against now (kept with a snapshot)."""

    def rewind(self, diagrams: Any) -> None:
        """After a restore: settle the pending checks, measure drift against ``diagrams``, forget the undone steps."""

    def emit(self, record: InterventionRecord) -> None:
        """Write an intervention to the history and the sinks."""


class HealthySnapshots:
    """Keeps the snapshots of healthy states a rollback goes back to, or none, saying why, where they cannot be kept.

    They are wanted while the rule can roll back or stop (`wanted`); a rollback or a stop goes back to the newest one
    taken before the alarm's onset that every rank holds (`target`). Before the first one in host memory,
    ``snapshots + 1`` copies of every rank's state must fit in half of the memory available (rank 0 deciding); a
    sharded strategy or an actuator without snapshots turns them off, with one warning.

    Args:
        settings: the monitor's settings.
    """

    def __init__(self, settings: MonitorSettings) -> None:
        self.settings = settings
        #: The healthy snapshots a ``rollback`` goes back to.
        self.store = SnapshotStore(settings.interventions.snapshots, settings.interventions.snapshot_dir)
        #: Why no snapshots are kept although the rule can use them (a sharded strategy, too little host memory, an
        #: actuator without snapshots), or None. Rollback decisions then warn, and say why.
        self.off: str | None = None

    @property
    def wanted(self) -> bool:
        """Whether the rule in effect can roll back or stop (then healthy checks keep snapshots).

        A rollback goes back to one; a stop restores one first, so that it never leaves the weights of the fault.
        """
        rule = self.settings.rule
        reachable = {rule.action, rule.on_diverged}
        if Action.LOWER_LR.value in reachable:
            reachable.add(rule.after_max_lr_cuts)
        if Action.ROLLBACK.value in reachable:
            reachable.add(rule.after_max_rollbacks)
        return bool(reachable & {Action.ROLLBACK.value, Action.STOP.value})

    def target(self, decision: Decision, record: CheckRecord, step: int) -> Snapshot | None:
        """The snapshot a rollback (or a stop) goes back to: the newest one taken before the alarm's onset."""
        onset = decision.step if decision.onset is None else decision.onset
        if step > record.step:
            # In the background a healthy check's snapshot is taken when its decision is applied, `lag` steps
            # after the check: go back to one taken before the last check before the onset, which that check
            # saw healthy.
            onset -= self.settings.schedule.check_every - 1
        # Every rank goes back to the same step: the newest snapshot before the onset that every rank holds (a
        # rank whose copy failed lacks one), or none anywhere, so that no rank restores alone.
        held = all_gather_object([s.step for s in self.store.snapshots if s.step < onset])
        common = set(held[0]).intersection(*held[1:])
        return self.store.at(max(common)) if common else None

    def keep(self, actuator: Actuator, step: int, diagrams: Any, *, loss: float | None, lr_factor: float,
             rollback_cut: float) -> None:  # fmt: skip
        """Keep this healthy state as a snapshot, unless it cannot be kept here (then say so once, and keep none)."""
        try:
            self.store.check_room(actuator)  # errors but a refusal propagate: every rank reaches its collective
        except SnapshotUnsupported as error:
            self._turn_off(error)
            return
        try:
            kept = self.store.add(step, _snapshot(actuator), diagrams)
        except SnapshotUnsupported as error:
            self._turn_off(error)
            return
        except Exception as error:  # a copy that failed on this rank (host memory, the disk): go on without it
            warnings.warn(
                f"topocallbacks could not keep the snapshot of step {step} on rank {rank_and_world()[0]} "
                f"({type(error).__name__}: {error}); a rollback goes back to an older snapshot every rank holds",
                RuntimeWarning,
                stacklevel=4,
            )
            return
        kept.lr_factor = lr_factor
        kept.rollback_cut = rollback_cut
        kept.loss = None if loss is None or not math.isfinite(loss) else float(loss)

    def _turn_off(self, error: SnapshotUnsupported) -> None:
        """No snapshots from now on, said once (rank 0): a rollback decision warns instead."""
        self.off = str(error)
        if rank_and_world()[0] == 0:
            warnings.warn(
                f"topocallbacks keeps no rollback snapshots: {error}. A rollback decision warns instead.",
                RuntimeWarning,
                stacklevel=5,
            )

    def __getstate__(self) -> dict[str, Any]:
        # Snapshots are not pickled (ddp_spawn pickles callbacks): each process keeps its own from its next check.
        return {**self.__dict__, "store": SnapshotStore(self.store.keep, self.store.directory)}


class Rescuer(Stateful):
    """Carries decisions out through an [`Actuator`][topocallbacks.interventions.Actuator], with healthy snapshots.

    While the rule can roll back or stop (`HealthySnapshots.wanted`), every healthy check's state is kept
    (`HealthySnapshots`: where none can be kept, rollbacks warn). A rollback restores the newest snapshot taken
    before the alarm's onset, in place, skips the next ``rollback_skip`` updates and cuts the rates as its decision
    says (``rollback_order``; the cuts compound over rollbacks, relative to those a snapshot already holds). A stop
    first restores that last healthy state and keeps the cuts.

    Args:
        settings: the monitor's settings.
    """

    _state = StateFields(
        version=2,
        fields={
            "lr_factor": "lr_factor_",
            "last_rollback_step": "last_rollback_step_",
            "rollback_cut": "rollback_cut_",
            "pending_skip": "pending_skip_",
            "recent_losses": "recent_losses_",
        },
    )

    def __init__(self, settings: MonitorSettings) -> None:
        self.settings = settings
        #: The healthy snapshots (kept only while a rule can roll back or stop), or why none are kept.
        self.healthy = HealthySnapshots(settings)
        self.lr_factor_ = 1.0  # the cumulative learning-rate factor of the interventions so far
        self.last_rollback_step_: int | None = None  # the latest rollback's step (the next one undoes updates since)
        self.rollback_cut_ = 1.0  # the product of the rollbacks' learning-rate cuts (they compound)
        self.pending_skip_ = False  # a rollback's skip waits for the loss to flag at the next check (skip "later")
        self.recent_losses_: list[float] = []  # the training loss of the last two checks (``stop_restores``)

    def act(self, record: CheckRecord, actuator: Actuator, monitor: MonitorHooks) -> InterventionRecord | None:
        """Carry out ``record``'s decision at its ``applied_step``, or keep a healthy snapshot; the intervention."""
        decision = record.decision
        if record.applied_step is None:
            return None
        step = record.applied_step
        if record.loss is not None:
            # A non-finite loss counts as the worst: a stop after it always restores.
            loss = float(record.loss) if math.isfinite(record.loss) else math.inf
            self.recent_losses_ = [*self.recent_losses_, loss][-2:]
        confirmed = self.pending_skip_ and "loss" in decision.flagged
        self.pending_skip_ = False
        if not decision.fired:
            if record.ok and decision.healthy and self.healthy.wanted and self.healthy.off is None:
                self.healthy.keep(actuator, step, monitor.reference_diagrams(), loss=record.loss,
                                  lr_factor=self.lr_factor_, rollback_cut=self.rollback_cut_)  # fmt: skip
            if confirmed:
                return self._confirmed_skip(actuator, step, monitor)
            return None
        target: Snapshot | None = None
        if decision.action in (Action.ROLLBACK, Action.STOP):
            target = self.healthy.target(decision, record, step)
        decision, target = self._as_carried_out(decision, target)
        return self._carry_out(decision, actuator, step, target, monitor, confirmed)

    def _carry_out(
        self,
        decision: Decision,
        actuator: Actuator,
        step: int,
        target: Snapshot | None,
        monitor: MonitorHooks,
        confirmed: bool,
    ) -> InterventionRecord:
        """Carry ``decision`` out at ``step``; the intervention.

        Nothing is lost: the action first (a stop restores and writes the last healthy state), then the history, then
        the rescue checkpoint, which so holds both.
        """
        undone = None if target is None else self._updates_undone(target, step)
        done = self._take_action(decision, actuator, step, target, monitor, confirmed)
        stop = decision.action is Action.STOP
        save = decision.checkpoint or (stop and self.settings.interventions.checkpoint_on_stop)
        tag = f"topo-{decision.action.value}-step{step}"
        if save:
            done.append(f"checkpoint {actuator.checkpoint_location(tag)}")
        if decision.lr_factor is not None and decision.action in (Action.LOWER_LR, Action.ROLLBACK):
            self.lr_factor_ *= decision.lr_factor
        entry = InterventionRecord(
            step=step,
            action=decision.action.value,
            reason=decision.reason,
            detail="; ".join(done),
            lr_factor=self.lr_factor_,
            snapshot_step=None if target is None else target.step,
            steps_lost=undone,
        )
        monitor.emit(entry)
        if save:
            actuator.save_checkpoint(tag)
        return entry

    def _take_action(self, decision: Decision, actuator: Actuator, step: int, target: Snapshot | None,
                     monitor: MonitorHooks, confirmed: bool) -> list[str]:  # fmt: skip
        """Do ``decision``'s action at ``step`` through ``actuator``; what was done, in words."""
        done: list[str] = []
        if decision.action is Action.WARN:
            if rank_and_world()[0] == 0:
                checked = "" if step == decision.step else f" (a check of step {decision.step}'s features)"
                warnings.warn(f"topocallbacks at step {step}{checked}: {decision.reason}", RuntimeWarning, stacklevel=5)
            done.append("warned")
        elif decision.action is Action.LOWER_LR and decision.lr_factor is not None:
            done.append(actuator.scale_learning_rate(decision.lr_factor))
        elif decision.action is Action.ROLLBACK:
            if target is None:  # pragma: no cover - `_as_carried_out` makes a rollback with no snapshot another action
                raise RuntimeError("a rollback decision reached the rescuer without a snapshot to go back to")
            done.append(self._roll_back(actuator, target, step, decision, monitor, confirmed))
            if decision.lr_factor is not None:
                done.append(actuator.scale_learning_rate(decision.lr_factor))
        elif decision.action is Action.STOP:
            if target is not None:  # the last healthy state first: a stop never leaves the weights of the fault
                done.append(self._roll_back(actuator, target, step, decision, monitor, confirmed))
            done.append(actuator.request_stop())
            kept = target or (self.healthy.store.snapshots[-1] if self.healthy.store.snapshots else None)
            if kept is not None:  # the last healthy state to a file too
                where = actuator.save_snapshot(kept.load(), f"topo-last-healthy-step{kept.step}")
                done.append(f"last healthy state (step {kept.step}) {where}")
        return done

    # --- the decision's target ------------------------------------------------------------------------------

    def _as_carried_out(self, decision: Decision, target: Snapshot | None) -> tuple[Decision, Snapshot | None]:
        """The decision as carried out, and the snapshot it restores (None: none).

        A rollback without a snapshot warns (or escalates), a rollback's cuts compound, a stop says it restores the
        last healthy state first.
        """
        if decision.action is Action.ROLLBACK:
            if target is None:
                diverged = decision.rule == "diverged"  # the features, or a NaN loss or gradient norm
                instead = self.settings.rule.after_max_rollbacks if diverged else "warn"
                return _no_snapshot(decision, instead, self.healthy.off), None
            if decision.lr_factor is not None or self.rollback_cut_ != target.rollback_cut:
                decision = self._compound(decision, target)
            return decision, target
        if decision.action is Action.STOP and target is not None:
            kept = _why_stop_keeps_weights(self.settings.rule, self.recent_losses_, target)
            if kept is not None:
                return dataclasses.replace(decision, reason=f"{decision.reason}; {kept}"), None
            reason = f"{decision.reason}; the last healthy state (step {target.step}) is restored first"
            return dataclasses.replace(decision, reason=reason), target
        return decision, None

    def _compound(self, decision: Decision, target: Snapshot) -> Decision:
        """A rollback's cut times the earlier rollbacks', relative to the cuts already in ``target``'s rates."""
        total = self.rollback_cut_ * (1.0 if decision.lr_factor is None else decision.lr_factor)
        factor = total / target.rollback_cut
        reason = decision.reason
        if factor != decision.lr_factor:
            reason += (
                f"; with the earlier rollbacks' cuts, x {total:.4g} of the rate before the first rollback "
                f"(x {factor:.4g} of the snapshot's)"
            )
        self.rollback_cut_ = total
        return dataclasses.replace(decision, lr_factor=factor, reason=reason)

    def _updates_undone(self, target: Snapshot, step: int) -> int:
        """The updates a rollback to ``target`` at ``step`` undoes (since the snapshot, or since the last rollback)."""
        last = self.last_rollback_step_
        return step - (target.step if last is None or last < target.step else last)

    # --- restoring ------------------------------------------------------------------------------------------

    def _roll_back(self, actuator: Actuator, target: Snapshot, step: int, decision: Decision, monitor: MonitorHooks,
                   confirmed: bool) -> str:  # fmt: skip
        """Restore ``target`` in place (every rank) and rewind the checks to it; what was done, in words.

        Before a stop the earlier rollbacks' compounded learning-rate cut is applied to the restored rates, so a run
        resumed from the stop's checkpoint goes on at the cut rate; no update is skipped. A rollback skips
        ``rollback_skip`` updates as its decision says (``Decision.skip``): now, not at all, or at the next check if
        the loss flags there (at once if it flagged at this check after an earlier rollback's skip was waiting).
        """
        undone = self._updates_undone(target, step)
        detail = actuator.restore(target.load())
        monitor.rewind(target.diagrams)
        self.healthy.store.drop_after(target.step)
        self.last_rollback_step_ = step
        self.lr_factor_ = target.lr_factor  # the rates are the snapshot's again (cuts since then are undone)
        if decision.action is Action.STOP:
            cut = ""
            if self.rollback_cut_ != target.rollback_cut:
                factor = self.rollback_cut_ / target.rollback_cut
                cut = f"; the rollbacks' cut kept: {actuator.scale_learning_rate(factor)}"
                self.lr_factor_ *= factor
            return (
                f"restored the last healthy state, the snapshot of step {target.step} ({undone} updates undone), "
                f"before stopping; {detail}{cut}"
            )
        skip = self.settings.rollback_skip
        when = "now" if confirmed else decision.skip
        self.pending_skip_ = bool(skip) and when == "later"
        skipped = "" if not skip or when != "now" else f"; {_skip_updates(actuator, skip)}"
        if self.pending_skip_:
            skipped = f"; {skip} updates will be skipped if the training loss flags again at the next check"
        return (
            f"rolled back to the snapshot of step {target.step}: {undone} updates undone and their batches not seen "
            f"again (training goes on with the next batch); {detail}{skipped}; {self.healthy.store.describe()}"
        )

    def _confirmed_skip(self, actuator: Actuator, step: int, monitor: MonitorHooks) -> InterventionRecord:
        """The skip a rollback left waiting, made now that the loss flagged again: the burst goes on."""
        skip = self.settings.rollback_skip
        entry = InterventionRecord(
            step=step,
            action="skip",
            reason=f"the training loss flagged again at the check after the rollback: the burst goes on, so the "
            f"rollback's skip of {skip} updates is made now (rollback_order 'skip_if_confirmed')",
            detail=_skip_updates(actuator, skip),
            lr_factor=self.lr_factor_,
        )
        monitor.emit(entry)
        return entry


def _snapshot(actuator: Actuator) -> Any:
    """``actuator.snapshot()``; SnapshotUnsupported for an actuator that takes none (snapshots are then off)."""
    take = getattr(actuator, "snapshot", None)
    if take is None:
        raise SnapshotUnsupported(
            f"{type(actuator).__name__} takes no snapshots: give it `snapshot()` and `restore()` "
            "(LoopActuator(..., model=model) has them)"
        )
    return take()


def _skip_updates(actuator: Actuator, count: int) -> str:
    """``actuator.skip_updates(count)``, with a clear error for an actuator that cannot skip."""
    skip = getattr(actuator, "skip_updates", None)
    if skip is None:
        raise InputError(
            f"`rollback_skip` is {count}, but {type(actuator).__name__} cannot skip updates: give it "
            "`skip_updates(count)` (LoopActuator has it: topocallbacks.interventions.skip_updates)"
        )
    return str(skip(count))


def _why_stop_keeps_weights(rule: PolicySettings, recent_losses: list[float], target: Snapshot) -> str | None:
    """Why a stop keeps its weights instead of restoring ``target``, or None when it restores.

    With ``stop_restores="if_better"`` a stop keeps them when the training loss of the last two checks
    (``recent_losses``) is not above the loss at the snapshot's check (a snapshot without a loss is restored).
    """
    if rule.stop_restores != "if_better" or target.loss is None or not recent_losses:
        return None
    recent = sum(recent_losses) / len(recent_losses)
    if recent > target.loss:
        return None
    return (
        f"the weights are kept, not the last healthy state (step {target.step}): the training loss of the last "
        f"checks ({recent:.4g}) is not above its value at that snapshot ({target.loss:.4g}; stop_restores "
        "'if_better')"
    )


def _no_snapshot(decision: Decision, instead: str, off: str | None = None) -> Decision:
    """A rollback with nothing to go back to becomes ``instead`` (a warning; for a diverged check, the escalation)."""
    onset = decision.step if decision.onset is None else decision.onset
    why = "" if off is None else f" (no snapshots are kept: {off})"
    return dataclasses.replace(
        decision,
        action=Action(instead),
        lr_factor=None,
        reason=f"{decision.reason}; no healthy snapshot before step {onset}{why}, so {instead}",
    )
