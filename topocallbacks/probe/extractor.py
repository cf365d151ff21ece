"""The feature extractor: runs the probe through a model and returns the watched layers' features on the host.

The pass runs without gradients, in eval mode and the trainer's precision, stops once the watched layers have run,
pools on the device and copies the ``(n, d)`` float32 features to the host once; modes and hooks are restored.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from ..exceptions import InputError
from ..settings import ProbeSettings
from .hooks import is_sharded, register_forward_hook
from .inputs import Probe
from .layers import resolve_layer, resolve_layers
from .pooling import pooled_features
from .text import attention_mask, forward

__all__ = ["DEVICE_CACHE_BYTES", "AutocastFactory", "FeatureExtractor", "autocast_for"]

#: Probes up to this many bytes stay on the model's device between checks; larger ones in pinned host memory.
DEVICE_CACHE_BYTES = 256 * 2**20

AutocastFactory = Callable[[], contextlib.AbstractContextManager[Any]]


def autocast_for(precision: str, device: torch.device) -> AutocastFactory:
    """The context a probe pass runs in for a precision setting.

    ``"bf16"``/``"16"``: autocast on ``device``; ``"32"`` and ``"auto"`` (no adapter to ask): none.

    Examples:
        >>> import torch
        >>> with autocast_for("bf16", torch.device("cpu"))():
        ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
        torch.bfloat16
    """
    dtypes = {"bf16": torch.bfloat16, "16": torch.float16}
    if precision not in dtypes:
        return contextlib.nullcontext
    dtype = dtypes[precision]
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


class FeatureExtractor:
    """Runs the probe through a model and returns the features at the watched layer.

    The pass runs at training speed: without gradients, in eval mode, in the trainer's precision (``autocast``),
    stopped as soon as the watched layer has run (``stop_at_layer``: nothing after it is computed), with the probe's
    batches kept on the model's device between checks (pinned host memory for probes over
    `DEVICE_CACHE_BYTES`), pooled on the device, and one copy of the ``(n, d)`` float32 features to the host
    (one synchronisation per check). Every module's mode is restored and the hook removed afterwards, whatever
    happens; an exception that is not the pass's own stop signal is re-raised.

    Args:
        settings: the probe settings: ``layer`` (a module name or name patterns, see `resolve_layer`),
            ``pooling``, ``batch_size``, ``precision`` and ``stop_at_layer``.
        **overrides: any of them by name, e.g. ``FeatureExtractor(layer="backbone", batch_size=64)``.

    Raises:
        InputError: a bad value, or no layer.
    """

    def __init__(self, settings: ProbeSettings | None = None, /, **overrides: Any) -> None:
        base = ProbeSettings() if settings is None else settings
        self.settings: ProbeSettings = base.replace(**overrides) if overrides else base
        if self.settings.layer is None and self.settings.layers is None:
            raise InputError("`layer` is required with a `probe`: name the module whose output to watch")
        self.layer: tuple[str, ...] = self.settings.layer or ()
        self._cache: dict[Any, list[Any]] = {}
        self._said: set[tuple[str, ...]] = set()  # the probe keys the model's forward does not take, said once

    @property
    def several(self) -> bool:
        """Whether several layers are watched (``settings.layers``)."""
        return self.settings.layers is not None

    def resolve(self, model: torch.nn.Module) -> list[str]:
        """The module names watched in ``model``: the one layer, or the primary layer first and then the others.

        Raises:
            InputError: a name that designates no module (with the closest ones), or two entries for one module.
        """
        s = self.settings
        if s.layers is None:
            return [resolve_layer(model, self.layer)]
        return resolve_layers(model, s.layers, primary=s.layer, shortcuts=s.shortcuts)

    def __call__(
        self,
        model: torch.nn.Module,
        probe: Probe,
        indices: Sequence[int] | None = None,
        *,
        autocast: AutocastFactory | None = None,
    ) -> NDArray[np.float32]:
        """Features ``(n, d)`` of the probe samples (all, or ``indices``) at the watched layer.

        Args:
            model: the model (its mode is restored afterwards).
            probe: the probe.
            indices: the samples to run (a distributed shard), or all.
            autocast: the precision context of the pass (the training adapter's); default from
                ``settings.precision`` on the model's device.

        Raises:
            InputError: the layer is not a module of ``model``, or was never called by its forward pass.
        """
        if self.several:
            raise InputError("this extractor watches several layers: call extract() for their features")
        self.resolved_layer_ = self.resolve(model)[0]
        return self._run(model, probe, indices, autocast, [self.resolved_layer_])[self.resolved_layer_]

    def extract(
        self,
        model: torch.nn.Module,
        probe: Probe,
        indices: Sequence[int] | None = None,
        *,
        autocast: AutocastFactory | None = None,
    ) -> dict[str, NDArray[np.float32]]:
        """Features ``(n, d_layer)`` of every watched layer, by module name (the primary layer first), in one pass.

        One forward pass per probe batch, one hook per layer; with ``stop_at_layer`` the pass ends as soon as every
        watched layer has run (at the deepest one).

        Raises:
            InputError: a layer is not a module of ``model``, or was never called by its forward pass.
        """
        self.resolved_layers_ = self.resolve(model)
        self.resolved_layer_ = self.resolved_layers_[0]
        return self._run(model, probe, indices, autocast, self.resolved_layers_)

    def _run(
        self,
        model: torch.nn.Module,
        probe: Probe,
        indices: Sequence[int] | None,
        autocast: AutocastFactory | None,
        names: list[str],
    ) -> dict[str, NDArray[np.float32]]:
        """One pass of the probe through ``model`` with a hook on each of ``names``; their features on the host."""
        modules = dict(model.named_modules())
        device = _device_of(model)
        context = autocast or autocast_for(self.settings.precision, device)
        stop = self.settings.stop_at_layer and not is_sharded(model)
        capture = _PassCapture(names, self.settings.pooling, stop)
        modes = {m: m.training for m in model.modules()}
        handles = [register_forward_hook(modules[name], capture.hook_for(name)) for name in names]
        try:
            model.eval()
            with torch.no_grad(), context():
                for batch in self._batches(probe, indices, device):
                    capture.start_batch(attention_mask(batch))
                    with contextlib.suppress(_StopForward):
                        forward(model, batch, self._said)
        finally:
            for handle in handles:
                handle.remove()
            for submodule, training in modes.items():
                submodule.training = training
        self._check_called(names, capture.captured)
        return _to_host(names, capture.captured)

    def _check_called(self, names: list[str], captured: dict[str, list[torch.Tensor]]) -> None:
        """Raise if a watched layer never ran during the pass."""
        missing = [name for name in names if not captured[name]]
        if missing:
            if len(names) == 1:
                shown = self.layer[0] if len(self.layer) == 1 else list(self.layer)
                raise InputError(f"`layer` {shown!r} was never called during the forward pass of the probe")
            raise InputError(f"`layers` {missing} were never called during the forward pass of the probe")

    def _batches(self, probe: Probe, indices: Sequence[int] | None, device: torch.device) -> list[Any]:
        """The probe's batches on ``device`` (kept there between checks), or pinned on the host, copied each pass."""
        key = (probe.spec.content_hash, None if indices is None else tuple(indices), str(device))
        if key not in self._cache:
            self._cache.clear()  # one probe at a time (a new shard or device replaces the old one)
            batches = list(probe.batches(self.settings.batch_size, indices))
            size = sum(_nbytes(batch) for batch in batches)
            on_device = device.type == "cpu" or size <= DEVICE_CACHE_BYTES
            self._cache[key] = [_move(batch, device if on_device else None) for batch in batches]
        cached = self._cache[key]
        return [_move(batch, device) for batch in cached]

    def __getstate__(self) -> dict[str, Any]:
        # Cached device tensors are rebuilt in the process that uses them (ddp_spawn pickles callbacks).
        return {**self.__dict__, "_cache": {}}


class _StopForward(Exception):
    """Raised by the probe's hook once the watched layer has run: nothing after it needs to."""


class _PassCapture:
    """The hooks of one probe pass: each watched layer's pooled output per batch, and the stop once all have run.

    Args:
        names: the watched modules' names.
        pooling: how an output becomes one vector per sample (see `pool`).
        stop: whether to end a batch's forward (raise `_StopForward`) once every watched layer has run.
    """

    def __init__(self, names: list[str], pooling: str, stop: bool) -> None:
        self.names = names
        self.pooling = pooling
        self.stop = stop
        self.captured: dict[str, list[torch.Tensor]] = {name: [] for name in names}
        self.seen: set[str] = set()  # the layers that ran in the current batch's forward
        self.mask: torch.Tensor | None = None

    def start_batch(self, mask: torch.Tensor | None) -> None:
        """Get ready for the next batch's forward, whose attention mask is ``mask``."""
        self.seen.clear()
        self.mask = mask

    def hook_for(self, name: str) -> Callable[..., None]:
        """The forward hook of the module ``name``."""

        def hook(_module: torch.nn.Module, _inputs: Any, output: Any) -> None:
            if name in self.seen:  # a layer called twice per forward: its first call counts
                return
            self.seen.add(name)
            self.captured[name].append(pooled_features(output, self.pooling, self.mask))
            if self.stop and len(self.seen) == len(self.names):  # the deepest watched layer has run
                raise _StopForward

        return hook


def _to_host(names: list[str], captured: dict[str, list[torch.Tensor]]) -> dict[str, NDArray[np.float32]]:
    """Every layer's pooled features on the host, by name, in one synchronisation (they leave the device together)."""
    pooled = [torch.cat(captured[name]) for name in names]
    host = torch.cat(pooled, dim=1).cpu().numpy() if len(pooled) > 1 else pooled[0].cpu().numpy()
    sizes = np.cumsum([p.shape[1] for p in pooled])[:-1]
    parts = np.split(host, sizes, axis=1) if len(pooled) > 1 else [host]
    return {name: np.ascontiguousarray(part) for name, part in zip(names, parts, strict=True)}


def _device_of(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter (CPU for a model without parameters)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _nbytes(batch: Any) -> int:
    """The size of a batch's tensors in bytes."""
    tensors = batch.values() if isinstance(batch, dict) else [batch]
    return sum(t.numel() * t.element_size() for t in tensors)


def _move(batch: Any, device: torch.device | None) -> Any:
    """``batch`` on ``device`` (no copy when it is there already), or in pinned host memory for ``None``."""

    def one(tensor: torch.Tensor) -> torch.Tensor:
        if device is None:
            return tensor.pin_memory() if torch.cuda.is_available() else tensor
        return tensor.to(device, non_blocking=True)

    if isinstance(batch, dict):
        return {k: one(v) for k, v in batch.items()}
    return one(batch)
