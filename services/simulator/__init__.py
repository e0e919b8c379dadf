"""The simulator service: a twin of the live cluster, forecasts, and what-if RPCs (DESIGN §3, §5)."""
