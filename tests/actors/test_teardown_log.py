"""Ray's compiled-graph teardown traceback for a dead member actor becomes one INFO line; other
records of that logger pass unchanged (Ray-free: records made by hand)."""

from __future__ import annotations

import logging
import sys

import ray

from actors.teardown import DeadMemberCancelFilter, quiet_dead_member_teardown

RAY_LOGGER = "ray.dag.compiled_dag_node"


def _record(msg: str, error: BaseException | None, level: int = logging.ERROR) -> logging.LogRecord:
    exc_info = None
    if error is not None:
        try:
            raise error
        except BaseException:
            exc_info = sys.exc_info()
    return logging.LogRecord(RAY_LOGGER, level, "compiled_dag_node.py", 2192, msg, None, exc_info)


def test_a_dead_members_cancel_error_is_one_info_line():
    error = ray.exceptions.RayActorError(error_msg="The actor is dead because it was killed by `ray.kill`.\nmore")
    record = _record("Error cancelling worker task", error)
    assert DeadMemberCancelFilter().filter(record)
    assert (record.levelno, record.levelname, record.exc_info) == (logging.INFO, "INFO", None)
    assert record.getMessage() == ("compiled graph teardown: a member actor was already gone "
                                   "(RayActorError: The actor is dead because it was killed by `ray.kill`.)")
    assert "Traceback" not in logging.Formatter().format(record)


def test_other_records_pass_unchanged_and_the_filter_is_installed_once():
    other = _record("Error cancelling worker task", ValueError("a bug"))
    plain = _record("Tearing down compiled DAG", None, logging.INFO)
    for record in (other, plain):
        before = (record.msg, record.levelno, record.exc_info)
        assert DeadMemberCancelFilter().filter(record)
        assert (record.msg, record.levelno, record.exc_info) == before
    quiet_dead_member_teardown()
    quiet_dead_member_teardown()
    assert sum(isinstance(f, DeadMemberCancelFilter) for f in logging.getLogger(RAY_LOGGER).filters) == 1
