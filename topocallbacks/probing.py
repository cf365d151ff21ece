"""The probe pass of a check: the fixed probe through the model, the watched layers' features, every rank's share.

Every rank runs an equal share of the probe (as sharded models need); rank 0 gets the features reassembled.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from .distributed import gather_probe_features
from .exceptions import InputError
from .pipeline import LayeredPipeline
from .probe import AutocastFactory, FeatureExtractor, Probe, ProbeSpec
from .settings import MonitorSettings

__all__ = ["ProbePass"]


class ProbePass:
    """The probe, the extractor of the watched layer(s), and the precision the probe pass runs in.

    Args:
        settings: the monitor's settings (``probe`` section, ``seed``).
        probe: probe inputs (see `Probe`), or None (set later with `set_probe`).
        tokenizer: a Hugging Face tokenizer for a probe of texts.

    Raises:
        InputError: a tokenizer without a probe, or a probe without a layer.
    """

    def __init__(self, settings: MonitorSettings, probe: Any = None, tokenizer: Any = None) -> None:
        self.settings = settings
        several = settings.probe.layers is not None
        self.extractor = None if settings.probe.layer is None and not several else FeatureExtractor(settings.probe)
        self.several = several
        self.loaded_spec: ProbeSpec | None = None  # the probe a loaded state was saved with
        self.probe: Probe | None = None
        self._source: tuple[Any, Any] | None = None  # the probe's source and tokenizer (for a smaller probe)
        self.size: int | None = settings.probe.size  # the samples kept (the overhead budget may lower it)
        if probe is not None:
            self.probe = self._new_probe(probe, tokenizer)
        elif tokenizer is not None:
            raise InputError("`tokenizer` is for a probe of texts; pass the texts as `probe`")
        if self.probe is not None and self.extractor is None:
            raise InputError("`layer` is required with a `probe`: name the module whose output to watch")
        self.autocast: AutocastFactory | None = None  # set by a training adapter: the trainer's precision

    def set_probe(self, source: Any, tokenizer: Any = None) -> None:
        """Set the probe (e.g. from a dataloader's dataset), checked against a loaded state's.

        Raises:
            InputError: a bad source, or one whose contents differ from the probe a loaded state was saved with.
        """
        probe = self._new_probe(source, tokenizer)
        self.probe = probe if self.loaded_spec is None else self._matching(probe, self.loaded_spec)

    def resize(self, n: int) -> None:
        """Keep ``n`` samples of the probe (a seeded subset of its source), for the overhead budget."""
        self.size = n
        if self._source is not None:
            self.probe = self._new_probe(*self._source)

    def _matching(self, probe: Probe, spec: ProbeSpec) -> Probe:
        """``probe`` verified against a saved ``spec``, first cut to its size when the budget had made it smaller."""
        if spec.n_samples < probe.spec.n_samples and self._source is not None:
            self.size = spec.n_samples
            probe = self._new_probe(*self._source)
        probe.verify(spec)
        return probe

    def _new_probe(self, source: Any, tokenizer: Any) -> Probe:
        s = self.settings
        self._source = (source, tokenizer)
        return Probe(source, tokenizer=tokenizer, max_length=s.probe.max_length, max_samples=self.size, seed=s.seed)

    def resolve(self, model: Any, layered: LayeredPipeline | None = None) -> list[str]:
        """The module names watched in ``model`` (the primary layer first).

        Args:
            model: the model.
            layered: the pipeline of several watched layers, if any (checked against what it watches).

        Raises:
            InputError: no layer, a name that designates no module (with the closest ones), an empty list or two
                entries for one module, a number of layers for ``policy.layer_rule`` larger than those watched, or
                other layers than a loaded state's.
        """
        if self.extractor is None:
            raise InputError("this monitor has no layer: pass `layer=` (or `layers=[...]`)")
        names = self.extractor.resolve(model)
        if layered is not None:
            if len(names) < 2:
                raise InputError(f"`layers` must designate at least 2 layers to watch several, got {names}")
            layered.required(len(names))
            known = layered.layers
            if known and known != names:
                raise InputError(f"the layers {names} of {type(model).__name__} differ from the watched {known}")
        return names

    def features(self, model: Any, indices: Any = None) -> Any:
        """The probe's features at the watched layer (all samples, or ``indices``): an ``(n, d)`` array.

        With several layers, a dict of them by layer name (the primary layer first), from one probe pass.

        Raises:
            InputError: no probe or no layer was given.
        """
        if self.probe is None or self.extractor is None:
            raise InputError("this monitor has no probe (and layer): pass features to process() instead")
        if self.several:
            return self.extractor.extract(model, self.probe, indices, autocast=self.autocast)
        return self.extractor(model, self.probe, indices, autocast=self.autocast)

    def gathered(self, model: Any) -> Any:
        """Every rank's share of the probe's features, reassembled (several layers travel as one array)."""
        if self.probe is None:
            raise InputError("this monitor has no probe (and layer): pass features to process() instead")
        if not self.several:
            return gather_probe_features(lambda idx: self.features(model, idx), len(self.probe))
        widths: dict[str, int] = {}

        def joined(indices: Any) -> NDArray[np.float32]:
            parts = self.features(model, indices)
            widths.clear()
            widths.update({name: part.shape[1] for name, part in parts.items()})
            return np.concatenate(list(parts.values()), axis=1)

        together = gather_probe_features(joined, len(self.probe))
        bounds = np.cumsum(list(widths.values()))[:-1]
        return dict(zip(widths, np.split(together, bounds, axis=1), strict=True))

    def take(
        self, model: Any, step: int, layered: LayeredPipeline | None = None, autocast: AutocastFactory | None = None
    ) -> tuple[Any, float]:
        """A check's probe pass in the ``autocast`` precision: the features (`gathered`), the milliseconds.

        Raises:
            InputError: no probe, or the pass failed; the message names the model, the layer and the step.
        """
        if self.probe is None:
            raise InputError("this monitor has no probe (and layer): pass features to process() instead")
        if not hasattr(model, "named_modules"):
            raise InputError(f"`model` must be a torch module, got {model!r:.80} of type {type(model).__name__}")
        start = time.perf_counter()
        self.autocast = autocast
        try:
            if layered is not None:
                self.resolve(model, layered)
            features = self.gathered(model)
        except InputError as exc:
            layer = self._watched() or None
            raise InputError(f"{exc} (model {type(model).__name__}, layer {layer!r}, step {step})") from exc
        except (RuntimeError, TypeError, ValueError, IndexError) as exc:
            if isinstance(exc, torch.OutOfMemoryError) or type(exc).__name__.startswith("Dist"):
                raise  # not the probe's fault: the device is full, or a collective failed
            layers = self._watched()
            shown = layers[0] if len(layers) == 1 else layers
            raise InputError(
                f"the probe pass of {type(model).__name__} failed at step {step} (layer {shown!r}): "
                f"{type(exc).__name__}: {exc}. The probe must be inputs that the model's forward takes; this is a "
                f"{self.probe.describe()}"
            ) from exc
        return features, (time.perf_counter() - start) * 1e3

    def _watched(self) -> list[str]:
        """The watched layer names (patterns as given), for messages."""
        return [] if self.extractor is None else list(self.extractor.settings.layers or self.extractor.layer)

    @property
    def spec_state(self) -> dict[str, Any] | None:
        """The probe's spec (source, indices, content hash), or a loaded state's while no probe is set."""
        spec = self.probe.spec if self.probe is not None else self.loaded_spec
        return None if spec is None else spec.as_dict()

    @spec_state.setter
    def spec_state(self, value: Mapping[str, Any] | None) -> None:
        spec = None if value is None else ProbeSpec.from_dict(value)
        if self.probe is not None and spec is not None:
            self.probe = self._matching(self.probe, spec)
        self.loaded_spec = spec

    def __getstate__(self) -> dict[str, Any]:
        # An autocast context factory does not pickle (ddp_spawn pickles callbacks): the adapter sets it again.
        return {**self.__dict__, "autocast": None}
