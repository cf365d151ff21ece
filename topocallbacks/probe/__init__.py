"""The probe: a fixed set of inputs, and the features a named layer gives for them.

Parts: `inputs` (the probe set), `layers` (layer resolution), `pooling`, `text` (text probes,
attention masks), `hooks`, `extractor` (the probe pass) and `stream` (streaming capture).
"""

from .extractor import DEVICE_CACHE_BYTES, AutocastFactory, FeatureExtractor, autocast_for
from .hooks import is_fsdp1_wrapper, is_sharded, register_forward_hook
from .inputs import Probe, ProbeSpec
from .layers import WRAPPER_SEGMENTS, resolve_layer, resolve_layers, resolve_module
from .stream import StreamCapture

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
