"""Parametrizes a test over every model family the engine supports."""

from __future__ import annotations

import pytest

from workers.checkpoint import Arch

ARCHS = pytest.mark.parametrize("arch", list(Arch), ids=lambda a: a.value)
