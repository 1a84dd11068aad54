"""Errors a runner raises that say what its caller can still do."""

from __future__ import annotations


class RunnerUnusable(RuntimeError):
    """The runner cannot run another step (e.g. a tensor-parallel rank failed and the group is
    stopped): the engine must be restarted. A step that raises anything else was released, and the
    runner stays usable for later steps."""
