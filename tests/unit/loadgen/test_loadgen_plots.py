"""Plot helpers write real PNG files and refuse empty input."""
from __future__ import annotations

import pytest

from loadgen.plots import plot_device_timeline, plot_rate_sweep

PNG = b"\x89PNG\r\n\x1a\n"


def test_rate_sweep_png(tmp_path):
    out = plot_rate_sweep({"container": [(1, 100.0, 0.0), (2, 180.0, 0.05), (4, 200.0, 0.3)],
                           "slice": [(1, 100.0, 0.0), (2, 200.0, 0.01), (4, 320.0, 0.08)]},
                          tmp_path / "sub" / "sweep.png", title="alpha 1.3")
    data = out.read_bytes()
    assert data[:8] == PNG and len(data) > 5000
    with pytest.raises(ValueError):
        plot_rate_sweep({}, tmp_path / "x.png")


def test_device_timeline_png(tmp_path):
    iv = [("gpu0", 0.0, 0.5, "t00"), ("gpu0", 0.6, 0.7, "guest:t01"), ("gpu1", 0.1, 0.9, "t01")]
    data = plot_device_timeline(iv, tmp_path / "tl.png").read_bytes()
    assert data[:8] == PNG and len(data) > 3000
    with pytest.raises(ValueError):
        plot_device_timeline([], tmp_path / "y.png")
