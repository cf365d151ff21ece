"""The probe set: a fixed set of inputs, so that point i at one check and point i at the next are the same sample.

It is described by a serialisable `ProbeSpec` (source, indices, content hash) so callback state can be saved
as JSON and checked on resume; the inputs themselves are never pickled into a checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..exceptions import InputError
from .text import column_length, tokenize

__all__ = ["Probe", "ProbeSpec"]


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
        """The inverse of `as_dict`."""
        indices = data.get("indices")
        return cls(
            data["source"], int(data["n_samples"]), None if indices is None else tuple(indices), data["content_hash"]
        )


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

    Examples:
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
        kind, length = _kind_of(source)
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
        items = _items(source, kind, chosen, tokenizer, max_length)
        if len(items) < 2:
            raise InputError(f"`probe` must hold at least 2 samples, got {len(items)}")
        _check_uniform(items, chosen)
        self.items = items
        self.spec = ProbeSpec(source=kind, n_samples=len(items), indices=indices, content_hash=_hash(items))

    def __len__(self) -> int:
        return len(self.items)

    def describe(self) -> str:
        """Its inputs in words: ``probe of shape (n, ...) and dtype ...``, or its columns' shapes and dtypes.

        Examples:
            >>> Probe(torch.zeros(10, 3)).describe()
            'probe of shape (10, 3) and dtype torch.float32'
        """
        first = self.items[0]
        if isinstance(first, dict):
            columns = ", ".join(f"{k} {(len(self), *v.shape)} {v.dtype}" for k, v in first.items())
            return f"probe of columns {columns}"
        return f"probe of shape {(len(self), *first.shape)} and dtype {first.dtype}"

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


def _kind_of(source: Any) -> tuple[str, int]:
    """The kind of a probe source (its `ProbeSpec.source`) and its number of samples."""
    if isinstance(source, str):
        raise InputError(f"`probe` is a single string ({source!r:.40}); pass a list of texts with `tokenizer=`")
    if isinstance(source, torch.Tensor):
        return "tensor", (int(source.shape[0]) if source.dim() else 0)
    if isinstance(source, Mapping):
        return "columns", column_length(source)
    if isinstance(source, torch.utils.data.Dataset) and hasattr(source, "__len__"):
        return f"dataset:{type(source).__name__}", len(source)
    if isinstance(source, (list, tuple)):
        texts = [isinstance(item, str) for item in source]
        if any(texts) and not all(texts):
            raise InputError("`probe` mixes strings and other inputs; pass a list of texts or of tensors")
        return ("texts" if texts and all(texts) else "list"), len(source)
    raise InputError(
        f"`probe` must be a tensor of inputs, a Dataset with __len__, a list of inputs or of texts, or a "
        f"mapping of input columns, got {type(source).__name__}"
    )


def _items(
    source: Any, kind: str, chosen: Sequence[int], tokenizer: Any, max_length: int | None
) -> list[torch.Tensor | dict[str, torch.Tensor]]:
    """The chosen samples of ``source`` as owned CPU tensors, or mappings of them."""
    if kind == "tensor":
        return [_check_tensor(source[i], "input") for i in chosen]
    if kind == "columns":
        columns = {str(k): _check_tensor(v, f"column {k!r}") for k, v in source.items()}
        return [{k: column[i] for k, column in columns.items()} for i in chosen]
    if kind == "texts":
        return tokenize([source[i] for i in chosen], tokenizer, max_length)
    if kind == "list":
        return [_as_item(source[i]) for i in chosen]
    items: list[torch.Tensor | dict[str, torch.Tensor]] = []
    for i in chosen:
        item = source[i]
        items.append(
            _as_item(item if isinstance(item, Mapping) else item[0] if isinstance(item, (tuple, list)) else item)
        )
    return items


def _check_tensor(value: Any, where: str) -> torch.Tensor:
    """``value`` as an owned CPU tensor.

    Raises:
        InputError: text, something that is not an array of numbers, or a tensor on the meta device.
    """
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
    """SHA-256 of the inputs' keys, shapes, dtypes and bytes."""
    digest = hashlib.sha256()
    for item in items:
        tensors = sorted(item.items()) if isinstance(item, dict) else [("", item)]
        for key, tensor in tensors:
            cpu = tensor.detach().to("cpu").contiguous()
            digest.update(f"{key}:{tuple(cpu.shape)}:{cpu.dtype};".encode())
            digest.update(cpu.view(torch.uint8).numpy().tobytes() if cpu.numel() else b"")
    return digest.hexdigest()


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
