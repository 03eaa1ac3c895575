"""The model: what to load (:class:`~lit_ppl.model.spec.ModelSpec`), its tokenizer, the scorer that turns hidden
states into per-token NLL (chunked, vocabulary-parallel under tensor parallelism) and its self-check.

Imports :mod:`lit_ppl.runtime` and :mod:`lit_ppl.parallel` only.
"""
