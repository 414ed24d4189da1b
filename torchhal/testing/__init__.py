"""The adapter conformance kit: certify that a VendorAdapter keeps the HAL's contract.

Library: `run_conformance("simasic")` or `run_conformance(MyAdapter())` returns a
`ConformanceReport` (`.ok`, `.to_json()`, `format_report(report)`). pytest:
`pytest -p torchhal.testing.pytest_plugin --torchhal-adapter NAME` makes each check a test.
"""

from torchhal.testing.report import CheckResult, CheckStatus, ConformanceReport, format_report
from torchhal.testing.suite import Check, ConformanceSuite, resolve_adapter, run_conformance

__all__ = [
    "Check",
    "CheckResult",
    "CheckStatus",
    "ConformanceReport",
    "ConformanceSuite",
    "format_report",
    "resolve_adapter",
    "run_conformance",
]
