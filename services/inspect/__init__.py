"""Read-only views of a running mesh's Redis state for ``slicesched inspect`` (devices, tenants, leases, forecasts,
streams, one request's journey). Collectors return JSON-ready dicts; :mod:`services.inspect.render` draws tables."""
