"""Evaluation, apart from the product: the ``slicesched bench …`` commands (``bench_*.py``, loaded by name from
:mod:`services.cli.main`), the accuracy harnesses and the results pipeline (:mod:`bench.results`). It may import
``shared``, ``services`` and ``loadgen``; nothing there imports it."""
