"""The scheduler's steering settings: on by default, ``SLICESCHED_SIM_STEERING=0`` turns it off, and a malformed
value is a ConfigError naming the variable (the scheduler exits with status 2)."""
from __future__ import annotations

import pytest

from services.scheduler.steering import steering_settings
from shared.config import ConfigError


def test_steering_settings_from_the_environment():
    assert steering_settings({}) == (True, 5.0)
    assert steering_settings({"SLICESCHED_SIM_STEERING": "0", "SLICESCHED_SIM_STEERING_STALE_S": "2.5"}) == (False, 2.5)
    for name, raw in (("SLICESCHED_SIM_STEERING", "yes"), ("SLICESCHED_SIM_STEERING", "2"),
                      ("SLICESCHED_SIM_STEERING_STALE_S", "0")):
        with pytest.raises(ConfigError) as ei:
            steering_settings({name: raw})
        assert ei.value.field_path == name
