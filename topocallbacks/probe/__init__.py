"""The probe: a fixed set of inputs, and the features a named layer gives for them.

The same inputs at every check, so that point i at one check and point i at the next are the same sample. The
probe is described by a serialisable :class:`ProbeSpec` (source, indices, content hash) so callback state can be
saved as JSON and checked on resume; the inputs themselves are never pickled into a checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from ..exceptions import InputError
from ..settings import ProbeSettings
from .hooks import is_fsdp1_wrapper, is_sharded, register_forward_hook
from .layers import WRAPPER_SEGMENTS, resolve_layer, resolve_layers, resolve_module
from .pooling import pooled_features
from .text import attention_mask, column_length, forward, tokenize

__all__ = [
    "DEVICE_CACHE_BYTES",
    "WRAPPER_SEGMENTS",
    "AutocastFactory",
    "FeatureExtractor",
    "Probe",
    "ProbeSpec",
    "StreamCapture",
    "autocast_for",
    "is_fsdp1_wrapper",
    "is_sharded",
    "register_forward_hook",
    "resolve_layer",
    "resolve_layers",
    "resolve_module",
]


@dataclasses.dataclass(frozen=True)
class ProbeSpec:
    """A serialisable description of a probe.

    Attributes:
        source: what the inputs came from (``"tensor"``, ``"list"``, or ``"dataset:<class name>"``).
        n_samples: number of probe samples.
        indices: indices of the samples in the source, or None when the whole source is used.
        content_hash: SHA-256 of the inputs (shapes, dtypes and bytes), to check a resumed run uses the same probe.
    """

    source: str
    n_samples: int
    indices: tuple[int, ...] | None
    content_hash: str

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        result = dataclasses.asdict(self)
        result["indices"] = None if self.indices is None else list(self.indices)
        return result

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ProbeSpec:
        """The inverse of :meth:`as_dict`."""
        indices = data.get("indices")
        return cls(
            data["source"], int(data["n_samples"]), None if indices is None else tuple(indices), data["content_hash"]
        )


def _check_tensor(value: Any, where: str) -> torch.Tensor:
    if isinstance(value, str):
        raise InputError(f"`probe` {where} is text ({value!r:.40}): pass a list of texts with `tokenizer=`")
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(np.asarray(value))
        except (TypeError, ValueError) as exc:
            raise InputError(
                f"`probe` {where} must be a tensor or an array of numbers, got {type(value).__name__} that is not "
                f"({exc}); ragged token lists: pad them (tokenizer(..., padding=True)) or pass texts with `tokenizer=`"
            ) from exc
    if value.device.type == "meta":
        raise InputError(f"`probe` {where} is on the meta device (shape only, no data); pass real tensors")
    # An owned CPU copy: a view would keep (and pickle, e.g. for ddp_spawn) the whole source tensor alive.
    tensor: torch.Tensor = value.detach().to("cpu").clone()
    return tensor


def _as_item(item: Any) -> torch.Tensor | dict[str, torch.Tensor]:
    """One probe input: a tensor, or a mapping of tensors (e.g. input_ids and attention_mask)."""
    if isinstance(item, Mapping):
        return {str(k): _check_tensor(v, f"input {k!r}") for k, v in item.items()}
    return _check_tensor(item, "input")


def _hash(items: Sequence[torch.Tensor | dict[str, torch.Tensor]]) -> str:
    digest = hashlib.sha256()
    for item in items:
        tensors = sorted(item.items()) if isinstance(item, dict) else [("", item)]
        for key, tensor in tensors:
            cpu = tensor.detach().to("cpu").contiguous()
            digest.update(f"{key}:{tuple(cpu.shape)}:{cpu.dtype};".encode())
            digest.update(cpu.view(torch.uint8).numpy().tobytes() if cpu.numel() else b"")
    return digest.hexdigest()


class Probe:
    """A fixed probe set.

    Args:
        source: the probe inputs, one of

            * a tensor ``(n, ...)`` of inputs;
            * a ``torch.utils.data.Dataset`` (the first element of each item is the input; a mapping item is used
              whole, e.g. tokenizer output);
            * a list of inputs: tensors of one shape, or mappings of tensors with the same keys and shapes;
            * a mapping of columns with ``n`` rows each, e.g. a tokenizer's ``BatchEncoding`` or
              ``{"input_ids": ids, "attention_mask": mask}``;
            * a list of strings, with ``tokenizer``.
        tokenizer: a Hugging Face tokenizer for a text probe: the texts are truncated to ``max_length`` tokens and
            padded to the longest (with the pad token, else the end-of-text token), with an attention mask that
            the pooling respects.
        max_length: the truncation length of a text probe (None: the tokenizer's ``model_max_length``, at most 512).
        max_samples: keep at most this many samples, a seeded random subset (None: all).
        seed: seed of that subset.

    Raises:
        InputError: an empty source, a source of another kind, text without a tokenizer, inputs of different
            shapes (ragged token lists: pad them, or pass the texts with ``tokenizer``), or inputs on the meta
            device.

    Example:
        >>> import torch
        >>> probe = Probe(torch.zeros(10, 3), max_samples=4)
        >>> probe.spec.n_samples, probe.spec.source
        (4, 'tensor')
        >>> Probe({"input_ids": torch.zeros(5, 7, dtype=torch.long)}).spec.source
        'columns'
    """

    def __init__(
        self,
        source: Any,
        *,
        tokenizer: Any = None,
        max_length: int | None = None,
        max_samples: int | None = None,
        seed: int = 0,
    ) -> None:
        if max_samples is not None and (
            isinstance(max_samples, bool) or not isinstance(max_samples, int) or max_samples < 1
        ):
            raise InputError(f"`max_samples` must be None or an integer >= 1, got {max_samples!r}")
        if isinstance(source, str):
            raise InputError(f"`probe` is a single string ({source!r:.40}); pass a list of texts with `tokenizer=`")
        if isinstance(source, torch.Tensor):
            kind, length = "tensor", (int(source.shape[0]) if source.dim() else 0)
        elif isinstance(source, Mapping):
            kind, length = "columns", column_length(source)
        elif isinstance(source, torch.utils.data.Dataset) and hasattr(source, "__len__"):
            kind, length = f"dataset:{type(source).__name__}", len(source)
        elif isinstance(source, (list, tuple)):
            texts = [isinstance(item, str) for item in source]
            kind = "texts" if texts and all(texts) else "list"
            if any(texts) and not all(texts):
                raise InputError("`probe` mixes strings and other inputs; pass a list of texts or of tensors")
            length = len(source)
        else:
            raise InputError(
                f"`probe` must be a tensor of inputs, a Dataset with __len__, a list of inputs or of texts, or a "
                f"mapping of input columns, got {type(source).__name__}"
            )
        if length == 0:
            raise InputError(f"`probe` is empty ({kind} with 0 samples); pass at least 2 inputs")
        if kind == "texts" and tokenizer is None:
            raise InputError(
                f"`probe` holds text ({source[0]!r:.40}, ...): pass `tokenizer=` (e.g. AutoTokenizer.from_pretrained"
                f"(...)) so that the texts can be tokenized"
            )
        if tokenizer is not None and kind != "texts":
            raise InputError(f"`tokenizer` is for a probe of texts (a list of strings); this probe is a {kind}")
        indices = None
        if max_samples is not None and max_samples < length:
            indices = tuple(
                int(i) for i in np.sort(np.random.default_rng(seed).choice(length, max_samples, replace=False))
            )
        chosen = list(range(length) if indices is None else indices)
        items: list[torch.Tensor | dict[str, torch.Tensor]]
        if kind == "tensor":
            items = [_check_tensor(source[i], "input") for i in chosen]
        elif kind == "columns":
            columns = {str(k): _check_tensor(v, f"column {k!r}") for k, v in source.items()}
            items = [{k: column[i] for k, column in columns.items()} for i in chosen]
        elif kind == "texts":
            items = tokenize([source[i] for i in chosen], tokenizer, max_length)
        elif kind == "list":
            items = [_as_item(source[i]) for i in chosen]
        else:
            items = []
            for i in chosen:
                item = source[i]
                items.append(
                    _as_item(
                        item if isinstance(item, Mapping) else item[0] if isinstance(item, (tuple, list)) else item
                    )
                )
        if len(items) < 2:
            raise InputError(f"`probe` must hold at least 2 samples, got {len(items)}")
        _check_uniform(items, chosen)
        self.items = items
        self.spec = ProbeSpec(kind, len(items), indices, _hash(items))

    def __len__(self) -> int:
        return len(self.items)

    def batches(self, batch_size: int, indices: Sequence[int] | None = None) -> Iterator[Any]:
        """Batches of the inputs (stacked tensors, or dicts of stacked tensors), in probe order."""
        order = range(len(self.items)) if indices is None else indices
        order = list(order)
        for start in range(0, len(order), batch_size):
            chunk = [self.items[i] for i in order[start : start + batch_size]]
            if isinstance(chunk[0], dict):
                yield {key: torch.stack([item[key] for item in chunk]) for key in chunk[0]}  # type: ignore[index]
            else:
                yield torch.stack(chunk)  # type: ignore[arg-type]

    def verify(self, spec: ProbeSpec) -> None:
        """Raise if ``spec`` (e.g. from a checkpoint) describes other inputs than this probe's.

        Raises:
            InputError: the content hashes differ.
        """
        if spec.content_hash != self.spec.content_hash:
            raise InputError(
                f"the probe differs from the one this state was saved with ({self.spec.source}, "
                f"{self.spec.n_samples} samples, hash {self.spec.content_hash[:12]} vs {spec.source}, "
                f"{spec.n_samples} samples, hash {spec.content_hash[:12]}): resuming would compare other points"
            )


def _check_uniform(items: Sequence[torch.Tensor | dict[str, torch.Tensor]], chosen: Sequence[int]) -> None:
    """Every probe input has the first one's shape (and keys): ragged inputs cannot be batched."""

    def layout(item: torch.Tensor | dict[str, torch.Tensor]) -> Any:
        if isinstance(item, dict):
            return {k: tuple(v.shape) for k, v in item.items()}
        return tuple(item.shape)

    first = layout(items[0])
    for position, item in enumerate(items[1:], start=1):
        other = layout(item)
        if other != first:
            raise InputError(
                f"`probe` inputs must all have the same shape to be batched: sample {chosen[0]} has {first}, sample "
                f"{chosen[position]} has {other}; pad them (e.g. tokenizer(..., padding=True)) or pass the texts "
                f"with `tokenizer=`"
            )


class _StopForward(Exception):
    """Raised by the probe's hook once the watched layer has run: nothing after it needs to."""


#: Probes up to this many bytes stay on the model's device between checks; larger ones in pinned host memory.
DEVICE_CACHE_BYTES = 256 * 2**20

AutocastFactory = Callable[[], contextlib.AbstractContextManager[Any]]


def _device_of(model: torch.nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def autocast_for(precision: str, device: torch.device) -> AutocastFactory:
    """The context a probe pass runs in for a precision setting.

    ``"bf16"``/``"16"``: autocast on ``device``; ``"32"`` and ``"auto"`` (no adapter to ask): none.

    Example:
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
    :data:`DEVICE_CACHE_BYTES`), pooled on the device, and one copy of the ``(n, d)`` float32 features to the host
    (one synchronisation per check). Every module's mode is restored and the hook removed afterwards, whatever
    happens; an exception that is not the pass's own stop signal is re-raised.

    Args:
        settings: the probe settings: ``layer`` (a module name or name patterns, see :func:`resolve_layer`),
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
        modules = dict(model.named_modules())
        device = _device_of(model)
        context = autocast or autocast_for(self.settings.precision, device)
        captured: dict[str, list[torch.Tensor]] = {name: [] for name in names}
        seen: set[str] = set()  # the layers that ran in the current batch's forward
        current_mask: list[torch.Tensor | None] = [None]
        pooling, stop = self.settings.pooling, self.settings.stop_at_layer and not is_sharded(model)

        def hook_for(name: str) -> Callable[..., None]:
            def hook(_module: torch.nn.Module, _inputs: Any, output: Any) -> None:
                if name in seen:  # a layer called twice per forward: its first call counts
                    return
                seen.add(name)
                captured[name].append(pooled_features(output, pooling, current_mask[0]))
                if stop and len(seen) == len(names):  # the deepest watched layer has run: nothing after it counts
                    raise _StopForward

            return hook

        modes = {m: m.training for m in model.modules()}
        handles = [register_forward_hook(modules[name], hook_for(name)) for name in names]
        try:
            model.eval()
            with torch.no_grad(), context():
                for batch in self._batches(probe, indices, device):
                    seen.clear()
                    try:
                        current_mask[0] = attention_mask(batch)
                        forward(model, batch)
                    except _StopForward:
                        pass
        finally:
            for handle in handles:
                handle.remove()
            for submodule, training in modes.items():
                submodule.training = training
        missing = [name for name in names if not captured[name]]
        if missing:
            if len(names) == 1:
                shown = self.layer[0] if len(self.layer) == 1 else list(self.layer)
                raise InputError(f"`layer` {shown!r} was never called during the forward pass of the probe")
            raise InputError(f"`layers` {missing} were never called during the forward pass of the probe")
        # One synchronisation: every layer's features leave the device together.
        pooled = [torch.cat(captured[name]) for name in names]
        host = torch.cat(pooled, dim=1).cpu().numpy() if len(pooled) > 1 else pooled[0].cpu().numpy()
        sizes = np.cumsum([p.shape[1] for p in pooled])[:-1]
        parts = np.split(host, sizes, axis=1) if len(pooled) > 1 else [host]
        return {name: np.ascontiguousarray(part) for name, part in zip(names, parts, strict=True)}

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


def _nbytes(batch: Any) -> int:
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


class StreamCapture:
    """Streaming mode: keeps a pooled subset of the watched layer's output during the model's *training* forwards.

    ``attach`` registers a forward hook on the watched module (forwards in eval mode, such as a probe pass or
    validation, are ignored). Per training forward the hook pools the output on its device, keeps a seeded random
    subset of at most ``points_per_batch`` rows there and nothing more: no copy to the host, no synchronisation.
    :meth:`take` returns what was kept since the last call (still on the device) and forgets it.

    Args:
        pooling: how the layer's output becomes one vector per sample (see :class:`ProbeSettings`).
        points_per_batch: rows kept per forward (None: all).
        seed: seed of the subsets (with a per-forward counter).
    """

    def __init__(self, pooling: str = "auto", points_per_batch: int | None = None, seed: int = 0) -> None:
        self.pooling = pooling
        self.points_per_batch = points_per_batch
        self.seed = seed
        self._captured: list[torch.Tensor] = []
        self._handle: Any = None
        self._forwards = 0

    @property
    def attached(self) -> bool:
        """Whether the hook is registered."""
        return self._handle is not None

    def attach(self, model: torch.nn.Module, layer: str | Sequence[str]) -> None:
        """Register the hook on the module ``layer`` designates (once).

        Raises:
            InputError: no such module (with the closest names).
        """
        if self._handle is None:
            self._handle = register_forward_hook(resolve_module(model, layer), self._hook)

    def detach(self) -> None:
        """Remove the hook and drop anything captured."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._captured = []

    def take(self) -> torch.Tensor | None:
        """The ``(n, d)`` float32 rows kept since the last call, on the model's device (None if none)."""
        captured, self._captured = self._captured, []
        if not captured:
            return None
        return captured[0] if len(captured) == 1 else torch.cat(captured)

    def _hook(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        if not module.training:
            return
        with torch.no_grad():
            pooled = pooled_features(output, self.pooling, None)
            limit = self.points_per_batch
            if limit is not None and pooled.shape[0] > limit:
                generator = torch.Generator(device=pooled.device)
                generator.manual_seed(self.seed * 1_000_003 + self._forwards)
                rows = torch.randperm(pooled.shape[0], device=pooled.device, generator=generator)[:limit]
                pooled = pooled[rows.sort().values]
            self._captured.append(pooled)
        self._forwards += 1

    def __getstate__(self) -> dict[str, Any]:
        # Hooks are registered again by the adapter (ddp_spawn pickles callbacks); captured tensors are transient.
        return {**self.__dict__, "_handle": None, "_captured": []}
