"""Set-up shared by the test modules."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_finish(session):
    """A rank of ``run_ranks`` imports the module of the function it runs: here a test module, with
    pytest, pandas and the helpers it imports (0.3-0.5 s of CPU per rank, more than the rest of a small
    parity test's start). The forkserver that forks the ranks imports them once instead
    (:func:`mlmkit.distributed.preload_in_ranks`): the test modules that call ``run_ranks`` and the
    helper modules of this folder."""
    from mlmkit.distributed import preload_in_ranks

    tests = {item.module.__name__ for item in session.items
             if isinstance(item, pytest.Function) and "run_ranks" in vars(item.module)}
    helpers = {name for name, module in list(sys.modules.items())
               if not name.startswith("test_") and name != "conftest" and
               os.path.dirname(os.path.abspath(getattr(module, "__file__", None) or "/")) == HERE}
    if tests:
        preload_in_ranks(sorted(helpers) + sorted(tests))
