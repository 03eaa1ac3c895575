"""What a run shows and keeps: the ``results.json`` document, the printed tables, plots, console progress,
experiment loggers, sweep summaries and the comparison of finished runs (``python -m lit_ppl.report``).

Imports :mod:`lit_ppl.runtime`, :mod:`lit_ppl.config` and :mod:`lit_ppl.metrics` only: it reads results, never
the model or the Trainer's internals.
"""
