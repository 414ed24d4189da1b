"""The conformance report: one result per check, never fewer, and how it prints.

Every planned check appears in the report with a status and a reason, passed checks
included (their reason says what was verified), so a reader can tell "verified" from
"not applicable here" from "broken" without reading the kit's source.
"""

from __future__ import annotations

import enum
import json
import textwrap
from dataclasses import dataclass, field
from typing import Any


class CheckStatus(str, enum.Enum):
    PASSED = "passed"
    FAILED = "failed"
    NOT_APPLICABLE = "not_applicable"  # capability absent, hardware absent, or blocked by a failed check


@dataclass(frozen=True, slots=True)
class CheckResult:
    check: str  # stable id, e.g. "device.memory_accounting", "dtype.bf16", "kernel.matmul/simasic/simasic0"
    title: str
    mandatory: bool  # False: applies only when the adapter declares the capability
    status: CheckStatus
    reason: str
    duration_s: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "title": self.title,
            "mandatory": self.mandatory,
            "status": self.status.value,
            "reason": self.reason,
            "duration_s": round(self.duration_s, 6),
        }


@dataclass(frozen=True, slots=True)
class ConformanceReport:
    adapter: str
    vendor: str
    devices: tuple[dict[str, Any], ...]  # id, name, arch, device_type, simulated of each discovered device
    torch_version: str
    torchhal_version: str
    hal_api_version: int
    seed: int  # pass it back to run_conformance(seed=...) to replay the same random inputs
    checks: tuple[CheckResult, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        """True when no check failed (not-applicable checks do not fail an adapter)."""
        return not self.failed()

    def summary(self) -> dict[str, int]:
        counts = {status.value: 0 for status in CheckStatus}
        for result in self.checks:
            counts[result.status.value] += 1
        return {**counts, "total": len(self.checks)}

    def failed(self) -> tuple[CheckResult, ...]:
        return tuple(c for c in self.checks if c.status is CheckStatus.FAILED)

    def result(self, check: str) -> CheckResult:
        """The result of one check by id; KeyError naming the known ids otherwise."""
        for result in self.checks:
            if result.check == check:
                return result
        raise KeyError(
            f"no check {check!r} in this report; checks: {', '.join(c.check for c in self.checks)}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "adapter": self.adapter,
            "vendor": self.vendor,
            "devices": [dict(d) for d in self.devices],
            "torch_version": self.torch_version,
            "torchhal_version": self.torchhal_version,
            "hal_api_version": self.hal_api_version,
            "seed": self.seed,
            "ok": self.ok,
            "summary": self.summary(),
            "checks": [c.to_dict() for c in self.checks],
        }

    def to_json(self, indent: int | None = 2) -> str:
        """The report as a JSON document (what `torchhal conformance ADAPTER --json` prints)."""
        return json.dumps(self.to_dict(), indent=indent)


_MARKS = {CheckStatus.PASSED: "PASS", CheckStatus.FAILED: "FAIL", CheckStatus.NOT_APPLICABLE: "N/A"}


def format_report(report: ConformanceReport, *, width: int = 110) -> str:
    """A plain-text table: one row per check (status, id, reason), a header and a summary line."""
    devices = ", ".join(
        f"{d['id']} ({d['name']}, {d['arch']}{', simulated' if d['simulated'] else ''})"
        for d in report.devices
    )
    lines = [
        f"torchhal conformance: adapter {report.adapter!r} (vendor {report.vendor!r})",
        f"devices: {devices or 'none'}",
        f"torch {report.torch_version}, torchhal {report.torchhal_version}, "
        f"HAL API {report.hal_api_version}, seed {report.seed}",
        "",
    ]
    id_width = max([len("CHECK"), *(len(c.check) for c in report.checks)])
    lines.append(f"{'STATUS':<6}  {'CHECK':<{id_width}}  REASON")
    indent = " " * (6 + 2 + id_width + 2)
    reason_width = max(30, width - len(indent))
    for result in report.checks:
        wrapped = textwrap.wrap(result.reason, reason_width) or [""]
        lines.append(f"{_MARKS[result.status]:<6}  {result.check:<{id_width}}  {wrapped[0]}")
        lines.extend(indent + more for more in wrapped[1:])
    counts = report.summary()
    verdict = "CONFORMS" if report.ok else "DOES NOT CONFORM"
    if report.ok and not report.devices:
        verdict += " (no device present: only the adapter object and its probe were checked)"
    lines += [
        "",
        f"{counts['passed']} passed, {counts['failed']} failed, {counts['not_applicable']} not applicable "
        f"of {counts['total']} checks: {verdict}",
    ]
    return "\n".join(lines)
