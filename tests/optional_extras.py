"""Tests that need an optional extra, and the check that none of them skips where the extras are required.

A test that needs a package from an optional extra carries ``requires(module, extra)`` (a test, a parametrization,
or a whole module through ``pytestmark``): where the package is missing, each such test is skipped on its own and
``pytest -rs`` names the package and the extra that installs it. Every package the tests need this way is one the
``dev`` extra installs (lmms-eval: scripts/install.sh), so where the extras are required, a skip for a missing
package is an error: conftest.py registers ``RequiredExtras``, which fails the run (exit status 1, the skipped
tests listed) when CI=true (CI services set it) or VLMTRAIN_REQUIRE_EXTRAS=1 (scripts/test.sh sets it;
VLMTRAIN_REQUIRE_EXTRAS=0 turns the check off, e.g. for a CI job on a minimal install). Other skips (the ``gpu``
tests without CUDA or ``-m gpu``) stay skips.
"""

from __future__ import annotations

import importlib.util
import os
import re

import pytest

NOT_INSTALLED = "is not installed"  # in every reason requires() writes

# A skip for a missing package: ours, or pytest.importorskip's own reason ("could not import 'x': No module ...").
_MISSING_PACKAGE = re.compile(rf"{NOT_INSTALLED}|could not import|No module named")
_TRUE = ("1", "true", "yes")


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def requires(module: str, extra: str, install: str | None = None) -> pytest.MarkDecorator:
    """Skip where ``module`` cannot be imported; the reason names it and the install command (by default
    ``pip install 'vlmtrain[EXTRA]'``)."""
    how = install or f"pip install 'vlmtrain[{extra}]'"
    return pytest.mark.skipif(not installed(module), reason=f"{module} {NOT_INSTALLED} ({how})")


def extras_required() -> bool:
    """VLMTRAIN_REQUIRE_EXTRAS when set (1/0), else whether CI is true."""
    flag = os.environ.get("VLMTRAIN_REQUIRE_EXTRAS")
    if flag is None or not flag.strip():
        flag = os.environ.get("CI", "")
    return flag.strip().lower() in _TRUE


def _missing_package(report) -> str | None:
    """The reason of a skip for a missing package (test or collection report), else None."""
    if not report.skipped or hasattr(report, "wasxfail"):
        return None
    longrepr = report.longrepr
    reason = str(longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else longrepr)
    return reason.removeprefix("Skipped: ") if _MISSING_PACKAGE.search(reason) else None


class RequiredExtras:
    """A pytest plugin: with the extras required, a skip for a missing package fails the run. Under pytest-xdist
    the controller sees every worker's reports and decides; the workers leave it to it."""

    def __init__(self) -> None:
        self.missing: list[str] = []

    def _record(self, report) -> None:
        reason = _missing_package(report)
        if reason is not None:
            self.missing.append(f"{report.nodeid}: {reason}")

    def pytest_runtest_logreport(self, report) -> None:
        self._record(report)

    def pytest_collectreport(self, report) -> None:  # a module-level importorskip skips at collection
        self._record(report)

    def pytest_sessionfinish(self, session) -> None:
        if self.missing and extras_required() and not hasattr(session.config, "workerinput"):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.missing or not extras_required():
            return
        terminalreporter.section("skipped for a missing package: the dev extra installs it", red=True)
        for line in self.missing:
            terminalreporter.line(line)
        terminalreporter.line("The extras are required here (CI=true or VLMTRAIN_REQUIRE_EXTRAS=1): install them "
                              "(bash scripts/install.sh), or set VLMTRAIN_REQUIRE_EXTRAS=0 on purpose.")
