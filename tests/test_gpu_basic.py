"""phx.gpu on any machine: it imports, says whether it can work, and why."""
from __future__ import annotations

import numpy as np
import pytest

import phx
import phx.gpu


def test_is_available_says_why():
    ok, why = phx.gpu.is_available()
    assert isinstance(ok, bool) and isinstance(why, str) and why
    if not ok:
        with pytest.raises(RuntimeError, match="unavailable"):
            phx.gpu.context()


def test_host_buffers_are_not_device_buffers():
    assert not phx.gpu.is_device_buffer(bytearray(8))
    assert not phx.gpu.is_device_buffer(np.zeros(4))


def test_info_reports_cuda():
    info = phx.info()
    assert "cuda" in info and isinstance(info["cuda"]["reason"], str)
