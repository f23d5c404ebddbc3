"""The one exception the verbs raise for bad input."""

from __future__ import annotations


class SurgeryError(ValueError):
    """Bad input for a surgery verb. Raised before anything changes, so the model is as it was."""
