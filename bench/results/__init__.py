"""Evaluation pipeline behind ``slicesched bench results``: run metadata (machine, date, commands), device
busy-time timelines from the mesh's event streams, and rendering of docs/results.md and the README headline."""
