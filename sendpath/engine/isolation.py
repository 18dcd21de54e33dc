"""One request cannot stop the engine: a step that fails is run again one request at a
time, and only the requests that fail alone fail.

When every request of a step fails and the runner's ``probe()`` fails too, the fault is
the device's, not any request's: then ``EngineFaultError`` stops the engine.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from sendpath.engine.scheduler import RunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from sendpath.engine.core import Runner

__all__ = ["EngineFaultError", "execute_isolated"]

logger = logging.getLogger("sendpath.engine")


class EngineFaultError(RuntimeError):
    """A step failed for every request in it and the device cannot compute a plain token
    either: not any request's fault. The engine stops."""


def execute_isolated(runner: Runner, plan: SchedulerOutput) -> RunnerOutput:
    """The runner's result for ``plan``; when it raises, each request's own result, with
    the requests that fail alone in ``failed``."""
    try:
        return runner.execute(plan)
    except Exception as exc:
        if plan.is_empty:
            raise
        errors: dict[str, Exception] = {}
        result = RunnerOutput()
        if len(plan.requests) == 1:
            errors[plan.requests[0].request_id] = exc
        else:  # again, one at a time: same slots, same tokens, rewritten
            for item in plan.requests:
                try:
                    result.merge(runner.execute(SchedulerOutput([item])))
                except Exception as alone_exc:
                    errors[item.request_id] = alone_exc
    if len(errors) == len(plan.requests):
        try:
            runner.probe()
        except Exception as fault:
            raise EngineFaultError(f"the device cannot compute: {fault}") from fault
    for request_id, error in errors.items():
        logger.error("request %s: a step failed on it", request_id, exc_info=error)
        result.failed[request_id] = f"{type(error).__name__}: {error}"
    return result
