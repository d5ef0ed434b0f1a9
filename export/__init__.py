"""ONNX export of a fedkey checkpoint for the web keyboard.

`export_checkpoint` (torch, onnxruntime) lives in :mod:`fedkey.export.onnx_export`; `load_metadata`
(standard library + onnx only) in :mod:`fedkey.export.metadata`, so a serving process that imports
`fedkey.export.metadata` never imports torch. This package module imports neither eagerly.
"""

from __future__ import annotations

__all__ = ["ExportParityError", "ExportReport", "export_checkpoint", "load_metadata"]


def __getattr__(name: str):
    if name in ("ExportParityError", "ExportReport", "export_checkpoint"):
        from fedkey.export import onnx_export

        return getattr(onnx_export, name)
    if name == "load_metadata":
        from fedkey.export.metadata import load_metadata

        return load_metadata
    raise AttributeError(f"module 'export' has no attribute {name!r}")
