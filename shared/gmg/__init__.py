"""Global Mapping Graph: the cluster-wide picture (devices, memory, reservations, residency, leases, execution).

``GMGStore`` (atomic commits in Lua), ``LeaseStore`` (leases and weight staging), ``GMGFollower`` (snapshot +
change stream -> a local copy), ``GMGSnapshot`` (the GMG as pure data). Key layout: docs/redis-schema.md.
"""
from shared.gmg.keys import GMGKeys  # noqa: F401
from shared.gmg.store import Committed, GMGStore, Refused, Reservation, Resize, Room  # noqa: F401
from shared.gmg.lease_store import Lease, LeaseStore  # noqa: F401
from shared.gmg.snapshot import GMGSnapshot  # noqa: F401
from shared.gmg.follower import GMGFollower  # noqa: F401
