"""Shared pytest setup: GPU tests skip cleanly on machines without CUDA; under pytest-xdist the cores
are shared out between the workers; under `tools/test.sh` (`VOLTLLM_REQUIRE_IMPORTS=1`) a test
skipped because a module does not import fails instead, and the run ends with the reasons of every
skip that was not for want of a GPU."""

from __future__ import annotations

import os
from collections import Counter

import pytest

GPU_SKIP_REASON = "needs a CUDA device"
# pytest.importorskip's message: "could not import 'name': ...".
IMPORT_SKIP_PREFIX = "could not import"


def pytest_configure(config: pytest.Config) -> None:
    """An xdist worker computes on its share of the cores (and so do the processes it starts): torch's
    OpenMP threads, one per core by default, spin while they wait, and two workers each running a
    full set made every step several times slower on the 2-core CI machine."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # inherited by the servers and scripts it starts
        try:
            import torch
        except ImportError:
            return
        torch.set_num_threads(threads)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip_gpu = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    longrepr = report.longrepr  # (path, line, reason); a list once it has crossed from an xdist worker
    if isinstance(longrepr, (tuple, list)) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _fail_missing_imports(report: pytest.CollectReport | pytest.TestReport) -> None:
    """The test environment is built from pyproject.toml's extras alone: a module a test needs that
    does not import is a missing dependency there, not a reason to skip."""
    if os.environ.get("VOLTLLM_REQUIRE_IMPORTS") == "1" and report.skipped:
        reason = _skip_reason(report)
        if reason.startswith(IMPORT_SKIP_PREFIX):
            report.outcome = "failed"
            report.longrepr = f"{reason}: declare it in pyproject.toml (the test extra) or the test command"


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    report = yield
    _fail_missing_imports(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    _fail_missing_imports(report)
    return report


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """Count the skips by reason, leaving out the GPU ones: a skip nobody expected shows here."""
    reasons = Counter(
        _skip_reason(report)
        for report in terminalreporter.stats.get("skipped", [])
        if _skip_reason(report) != GPU_SKIP_REASON
    )
    if reasons:
        terminalreporter.section("skipped, not for want of a GPU")
        for reason, count in reasons.most_common():
            terminalreporter.write_line(f"{count:4d}  {reason}")
