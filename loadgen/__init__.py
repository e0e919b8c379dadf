"""SliceScheduler's load generator: trace readers, declarative workloads, open-loop replay, reports and plots.

Entry points: :func:`loadgen.workload.load_workload` (a workload file → :class:`shared.workload.Workload`),
:func:`loadgen.report.summarize` (metrics from request records) and the ``loadgen`` command (:mod:`loadgen.cli`).
"""
