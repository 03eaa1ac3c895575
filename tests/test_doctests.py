"""Every ``>>>`` example in lit_ppl's docstrings runs and shows what it says (README's test command runs these)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import lit_ppl


def _modules_with_examples() -> list[str]:
    """The lit_ppl modules whose source holds a ``>>>`` (read, not imported: a ``__main__`` module would run)."""
    names = []
    for info in pkgutil.walk_packages(lit_ppl.__path__, "lit_ppl."):
        spec = info.module_finder.find_spec(info.name, None)
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            with open(spec.origin, encoding="utf-8") as source:
                if ">>>" in source.read():
                    names.append(info.name)
    return sorted(names)


MODULES = _modules_with_examples()


def test_the_examples_are_found():
    assert "lit_ppl.metrics.perplexity" in MODULES and len(MODULES) >= 10, MODULES


@pytest.mark.parametrize("name", MODULES)
def test_examples(name):
    module = importlib.import_module(name)
    runner, report = doctest.DocTestRunner(), []
    for test in doctest.DocTestFinder().find(module):
        runner.run(test, out=report.append)
    assert runner.tries > 0, f"{name} holds '>>>' outside any docstring doctest finds"
    assert runner.failures == 0, "".join(report)
