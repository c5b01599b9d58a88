"""Project exception types. Every error a user can trigger is one of these, with a message that
names the bad value and what was expected."""

from __future__ import annotations

__all__ = [
    "OffgraphError",
    "SpecError",
    "CacheOverflowError",
    "ExportError",
    "ArtifactError",
    "StepRefused",
    "StepFailed",
    "CheckFailed",
    "first_line",
]


def first_line(exc: BaseException) -> str:
    """The first non-empty line of ``exc``'s message, or its type's name when it has none (for
    one-line reports of an error raised by code we called)."""
    for line in str(exc).splitlines():
        if line.strip():
            return line.strip()
    return type(exc).__name__


class OffgraphError(Exception):
    """Base class of every offgraph-export error."""


class SpecError(OffgraphError, ValueError):
    """A compile spec or manifest is malformed or inconsistent."""


class CacheOverflowError(OffgraphError, RuntimeError):
    """A step would write past a cache's hard capacity."""


class ExportError(OffgraphError, RuntimeError):
    """A model could not be exported or a pass rejected the traced graph."""


class ArtifactError(OffgraphError, RuntimeError):
    """A package is missing, corrupt, or disagrees with its own specs."""


class StepRefused(OffgraphError, ValueError):
    """The runtime refused a step before launching the compiled program."""


class StepFailed(OffgraphError, RuntimeError):
    """The compiled program raised during a step; the cache was not advanced."""


class CheckFailed(OffgraphError, AssertionError):
    """A compiled step disagreed with its spec or with the eager oracle.

    ``report`` carries the full check report (a pydantic model)."""

    def __init__(self, message: str, report: object | None = None) -> None:
        super().__init__(message)
        self.report = report
