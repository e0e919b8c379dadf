"""Global Mapping Graph: the cluster-wide picture (devices, memory, reservations, residency, leases, execution)."""
from shared.gmg.keys import GMGKeys  # noqa: F401
from shared.gmg.store import GMGStore, Refused, Reservation, Resize  # noqa: F401
