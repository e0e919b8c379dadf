"""Global Mapping Graph: the cluster-wide picture (devices, memory, reservations, residency, leases, execution)."""
from shared.gmg.store import GMGStore, Refused, Reservation  # noqa: F401
