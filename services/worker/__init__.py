"""The worker: one per device; runs its home tenant's iterations (the driver role) and streams tokens."""
