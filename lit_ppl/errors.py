"""What counts as the user's mistake: one base class, reported as one line instead of a traceback, and its exit code.

lit-ppl's own checks raise :class:`UserError` subclasses (a bad value, a missing file, a model or layout that cannot
work, a rank that failed), each with a message that names the value and what would be valid. Anything else that
escapes a run — a ``ValueError`` from a library, a ``KeyError`` in lit-ppl — is a bug somewhere: the entry points
print its traceback and say so, instead of passing it off as the user's mistake (:func:`lit_ppl.run.exit_for`).
"""

from __future__ import annotations

import sys

EXIT_CONFIG = 2  # a config refused before anything ran (argparse's and jsonargparse's usage code)
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again" — the progress is saved


class UserError(Exception):
    """Bad input or a failed peer, found by lit-ppl: one line, no traceback. Subclasses also derive from the
    builtin error that code catching them expects (``ValueError``, ``RuntimeError``, ``ImportError``)."""

    exit_code = 1


class Preempted(Exception):
    """The run stopped on a signal after saving its progress; rerun with the same output_dir to resume."""


# Errors that mean "the input was wrong" or "a peer failed": reported as one line, without a traceback. lit-ppl's
# own all derive from UserError; a ValueError from elsewhere is a bug and keeps its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (
    UserError,
    FileNotFoundError,
    NotADirectoryError,
    PermissionError,
    FloatingPointError,
)


def input_error(err: BaseException) -> tuple[str, int] | None:
    """The one line and exit code of a preemption or of the input's mistake, or ``None`` (a failed peer or a bug:
    :func:`lit_ppl.run.exit_for`). Needs no library: an entry reports a bad input before it imports Lightning."""
    if isinstance(err, Preempted):
        return f"lit-ppl: {err}", EXIT_PREEMPTED
    # Lightning's word for a bad precision, accelerator or device count: only raised once Lightning is imported.
    lightning = sys.modules.get("lightning.fabric.utilities.exceptions")
    if isinstance(err, USER_ERRORS + ((lightning.MisconfigurationException,) if lightning else ())):
        return f"lit-ppl: error: {err}", getattr(err, "exit_code", 1)
    return None


class LitPplError(UserError, ValueError):
    """Bad input found by lit-ppl's own checks; a ``ValueError`` so that code (and tests) that catch a bad value
    keep working.

    Examples:
        >>> try:
        ...     raise LitPplError("eval.seq_len=0 must be >= 1")
        ... except ValueError as err:
        ...     print(err)
        eval.seq_len=0 must be >= 1
    """


def first_line(err: BaseException) -> str:
    """The first non-empty line of an exception's message (torch's collective errors span pages).

    Examples:
        >>> first_line(RuntimeError("\\n  gloo: connection reset\\nat frame 2"))
        'gloo: connection reset'
        >>> first_line(KeyError())
        'KeyError'
    """
    for line in str(err).splitlines():
        if line.strip():
            return line.strip()
    return type(err).__name__
