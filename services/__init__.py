"""SliceScheduler's services: gateway, gmg, simulator, scheduler, worker, and the ``slicesched`` CLI."""
