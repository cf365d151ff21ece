"""Text handling: probes of texts or of tokenized columns, and the attention masks that go with their batches.

Texts are tokenized once into padded ``input_ids``/``attention_mask`` rows; a mapping batch is passed to the model
as keyword inputs, and its attention mask tells the pooling which tokens are padding.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from ..exceptions import InputError

__all__ = ["attention_mask", "column_length", "forward", "tokenize"]


def tokenize(texts: list[str], tokenizer: Any, max_length: int | None) -> list[torch.Tensor | dict[str, torch.Tensor]]:
    """Texts as input_ids/attention_mask rows: truncated, padded to the longest on the tokenizer's side.

    Args:
        texts: the probe's texts.
        tokenizer: a Hugging Face tokenizer; its pad token pads (else its end-of-text token, else 0), on its
            ``padding_side``; ``token_type_ids`` are kept when it gives them.
        max_length: the truncation length (None: the tokenizer's ``model_max_length``, at most 512).

    Raises:
        InputError: the tokenizer fails, or a text gives no token.
    """
    if max_length is None:
        limit = getattr(tokenizer, "model_max_length", None)
        max_length = min(int(limit), 512) if isinstance(limit, int) and limit > 0 else 512
    try:
        encoded = tokenizer(list(texts), truncation=True, max_length=max_length, padding=False)
    except Exception as exc:
        raise InputError(f"`tokenizer` {type(tokenizer).__name__} failed on the probe's texts: {exc}") from exc
    rows = encoded["input_ids"]
    if not all(len(row) for row in rows):
        empty = next(i for i, row in enumerate(rows) if not len(row))
        raise InputError(f"`probe` text {empty} ({texts[empty]!r:.40}) gives no token")
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
    pad = 0 if pad is None else int(pad)
    width = max(len(row) for row in rows)
    left = getattr(tokenizer, "padding_side", "right") == "left"
    extra = ["token_type_ids"] if "token_type_ids" in encoded else []
    items: list[torch.Tensor | dict[str, torch.Tensor]] = []
    for i, row in enumerate(rows):
        fill = width - len(row)

        def padded(values: Any, value: int, fill: int = fill) -> torch.Tensor:
            body = torch.as_tensor(list(values), dtype=torch.long)
            pad_part = torch.full((fill,), value, dtype=torch.long)
            return torch.cat([pad_part, body] if left else [body, pad_part])

        item = {"input_ids": padded(row, pad), "attention_mask": padded([1] * len(row), 0)}
        for key in extra:
            item[key] = padded(encoded[key][i], 0)
        items.append(item)
    return items


def column_length(columns: Mapping[Any, Any]) -> int:
    """The common number of rows of a mapping of columns (e.g. a ``BatchEncoding``).

    Raises:
        InputError: an empty mapping, a column without a length, or columns of different lengths.
    """
    if not columns:
        raise InputError("`probe` is an empty mapping; pass columns such as input_ids and attention_mask")
    lengths = {}
    for key, value in columns.items():
        try:
            lengths[str(key)] = len(value)
        except TypeError as exc:
            raise InputError(
                f"`probe` column {key!r} must hold one row per sample, got {type(value).__name__}"
            ) from exc
    if len(set(lengths.values())) > 1:
        raise InputError(f"`probe` columns must have the same number of rows, got {lengths}")
    return next(iter(lengths.values()))


def attention_mask(batch: Any) -> torch.Tensor | None:
    """The attention mask of a probe batch (a mapping's ``attention_mask``), or None: every token counts."""
    return batch.get("attention_mask") if isinstance(batch, dict) else None


def forward(model: torch.nn.Module, batch: Any, said: set[tuple[str, ...]] | None = None) -> None:
    """Run ``model`` on a probe batch: a mapping as keyword inputs (``input_ids=``, ``attention_mask=``...).

    A mapping's keys that the model's ``forward`` does not take (a tokenizer's ``token_type_ids`` for a model whose
    ``forward(input_ids, attention_mask)``) are dropped, and said once per set of keys (``said`` remembers them).
    """
    if isinstance(batch, dict):
        accepted = accepted_inputs(model)
        dropped = tuple(sorted(k for k in batch if accepted is not None and k not in accepted))
        if dropped and said is not None and dropped not in said:
            said.add(dropped)
            warnings.warn(
                f"topocallbacks: {type(model).__name__}.forward takes no {', '.join(dropped)}: the probe passes "
                f"{', '.join(k for k in batch if k not in dropped)} only",
                RuntimeWarning,
                stacklevel=4,
            )
        model(**{k: v for k, v in batch.items() if k not in dropped})
    else:
        model(batch)


def accepted_inputs(model: torch.nn.Module) -> set[str] | None:
    """The keyword inputs ``model.forward`` takes, or None when it takes any (``**kwargs``).

    A wrapper whose forward takes anything (DDP, FSDP1, accelerate's) is looked through to the module it wraps.

    Examples:
        >>> class Encoder(torch.nn.Module):
        ...     def forward(self, input_ids, attention_mask=None):
        ...         return input_ids
        >>> sorted(accepted_inputs(Encoder()))
        ['attention_mask', 'input_ids']
        >>> class Anything(torch.nn.Module):
        ...     def forward(self, **inputs):
        ...         return inputs
        >>> accepted_inputs(Anything()) is None
        True
    """
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        inner = getattr(model, "module", None)
        return accepted_inputs(inner) if isinstance(inner, torch.nn.Module) else None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in parameters if p.kind in kinds}
