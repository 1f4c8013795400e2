"""Exporting a model to other runtimes' file formats."""

from astrai.export.gguf import GGUF_TYPES, GGUFExportError, gguf_arch, gguf_tensors, save_gguf

__all__ = ["GGUF_TYPES", "GGUFExportError", "gguf_arch", "gguf_tensors", "save_gguf"]
