"""SliceScheduler's own library: config, messages, streams, GMG, model, cost model, simulator, policies, transport.

Nothing in here imports from ``services`` or ``loadgen``.
"""
