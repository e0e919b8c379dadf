"""Discrete-event simulator (pure library) and the analytical what-if."""
from shared.sim.metrics import SimResult
from shared.sim.simulator import SimConfig, Simulator

__all__ = ["SimConfig", "SimResult", "Simulator"]
