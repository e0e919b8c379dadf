"""How much of a device its guest lanes ("sequences" leases) get while the device's own tenant has work: one rule for
the simulator's devices (``shared/sim/device.py``) and the workers' lanes (``services/worker/lanes.py``).

The own tenant comes first. While it has prompts waiting or being prefilled, no lane runs (its TTFT). Otherwise a
lane iteration never follows another while it decodes (its TPOT), and lanes get the share of the device the own
tenant can spare, :func:`own_yield`: what keeps its last iteration, stretched, within :data:`YIELD_MARGIN` × its TPOT
target, capped by the leases' shares — at least :data:`MIN_GUEST_SHARE`, balanced over :data:`LANE_WINDOW_S`. An
idle own tenant leaves the device to the lanes. Each heartbeat reports the yield (``guest_share``), which the
policy's snapshot reads as ``guest_yield`` in the live mesh as in the simulator.

Offloaded MLP segments ("segments" leases) run on a guest whenever a driver sends them; the time they take while the
guest has work of its own or a lane's is owed, and :func:`segment_payment` says how its next iterations pay it.
"""
from __future__ import annotations

MIN_GUEST_SHARE = 0.02  # a guest lane is paused, not stopped, while the device's own tenant's TPOT has no slack
LANE_WINDOW_S = 1.0  # guest vs own time is balanced over this window
YIELD_MARGIN = 0.8  # the own tenant's iteration, stretched by what it yields, stays within this × its TPOT target
MAX_YIELD = 0.95
MAX_OWED_S = 0.25  # offloaded segments' time a busy guest carries from one of its iterations to the next


def own_yield(lease_shares: float, own_step_s: float, tpot_s: float, margin: float = YIELD_MARGIN) -> float:
    """Share of the device guests get while its own tenant decodes: ``1 − own_step_s / (margin × tpot_s)`` (the
    slack of its last iteration, ``own_step_s``, against its TPOT target ``tpot_s``), within [0, the leases' shares
    and :data:`MAX_YIELD`]."""
    if tpot_s <= 0:
        return 0.0
    return max(0.0, min(lease_shares, MAX_YIELD, 1.0 - own_step_s / (margin * tpot_s)))


def segment_payment(owed_s: float, step_s: float, lease_shares: float) -> float:
    """Seconds a busy guest's next iteration (its own or a lane's), ``step_s`` long, is stretched to pay for
    ``owed_s`` of offloaded segments it ran while it had work: what it owes, at most ``share / (1 − share)`` of the
    iteration (the time a lease of ``share`` earns per second of the guest's other work; ``share`` is the
    segment leases' shares, within :data:`MAX_YIELD`). A segment run while the guest is idle costs nothing; what is
    owed beyond :data:`MAX_OWED_S` is not carried. One rule for the simulator (``shared/sim/device.py``) and the
    emulated worker (``services/worker/emulated_leases.py``)."""
    c = min(MAX_YIELD, lease_shares)
    if owed_s <= 0 or c <= 0 or step_s <= 0:
        return 0.0
    return min(owed_s, step_s * c / (1.0 - c))
