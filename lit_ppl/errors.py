"""The one exception lit-ppl raises for bad input: what gets a one-line message instead of a traceback.

Only lit-ppl's own checks raise :class:`LitPplError` (a bad value, a missing file, a model or layout that cannot
work), each with a message that names the value and what would be valid. Anything else that escapes a run — a
``ValueError`` from a library, a ``KeyError`` in lit-ppl — is a bug somewhere: the entry points print its traceback
and say so, instead of passing it off as the user's mistake.
"""

from __future__ import annotations


class LitPplError(ValueError):
    """Bad input found by lit-ppl's own checks: reported as one line, without a traceback.

    A ``ValueError`` so that code (and tests) that catch a bad value keep working.

    Examples:
        >>> try:
        ...     raise LitPplError("eval.seq_len=0 must be >= 1")
        ... except ValueError as err:
        ...     print(err)
        eval.seq_len=0 must be >= 1
    """
