"""Checkpoints on disk, in diffusers' layout: atomic folder swaps, reading and writing safetensors, save, load, convert.
"""

from surgery.io import atomic, safetensors_writer, checkpoint, saving, loading  # noqa: F401  (in layer order)
