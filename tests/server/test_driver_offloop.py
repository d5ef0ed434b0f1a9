"""The round driver leaves the event loop free: an aggregated round's uploads are
deleted in a worker thread, and rounds complete in a child process (or, asked, one thread) at a
lower CPU priority."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import threading

import pytest

import fedkey.server.round_driver
import fedkey.server.runtime.worker_threads
from fedkey.testing.http import enroll_phones, make_settings, run_round, running, wait_round
from fedkey.testing.wait import wait_for


@pytest.mark.slow
def test_an_aggregated_rounds_uploads_are_deleted_off_the_event_loop(tmp_path, monkeypatch):
    calls: list[tuple[str, bool]] = []
    real_rmtree = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:  # no loop runs in this thread: a worker thread
            on_loop = False
        calls.append((str(path), on_loop))
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(fedkey.server.round_driver.shutil, "rmtree", rmtree)
    settings = make_settings(tmp_path, rounds=1, fraction=1.0, wait_devices=2)
    with running(settings) as client:
        phones = enroll_phones(client, 2)
        wait_for(lambda: all(p.current()["state"] == "open" for p in phones))
        run_round(phones)
        wait_round(client, 1)
        round_dir = tmp_path / "run" / "uploads" / "round_0001"
        # the metrics row is recorded before the uploads are deleted: wait for the deletion
        wait_for(lambda: not round_dir.exists())
    assert (str(round_dir), False) in calls, calls
    assert not any(on_loop for _, on_loop in calls), calls


@pytest.mark.skipif(sys.platform != "linux", reason="a per-thread nice value is Linux's")
def test_rounds_complete_in_one_thread_at_a_lower_cpu_priority_than_the_loop():
    def priority() -> tuple[str, int]:
        tid = threading.get_native_id()
        return threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, tid)

    ours = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    pool = fedkey.server.runtime.worker_threads.aggregation_executor()
    assert (
        pool is fedkey.server.runtime.worker_threads.aggregation_executor()
    )  # one for the process
    name, nice = pool.submit(priority).result(timeout=30)
    assert name.startswith("fedkey-aggregate")
    assert nice == min(19, ours + fedkey.server.runtime.worker_threads.AGGREGATION_NICE)
    # this thread (the event loop's, in the server) keeps its priority
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == ours


@pytest.mark.skipif(sys.platform != "linux", reason="a per-thread nice value is Linux's")
def test_the_loops_worker_threads_run_below_the_loops_priority(tmp_path):
    """asyncio.to_thread in the server (upload bodies, validation, database commits) runs in the
    coordinator's default executor, IO_NICE below the loop thread."""

    def priority() -> tuple[str, int]:
        tid = threading.get_native_id()
        return threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, tid)

    async def loop_and_worker() -> tuple[tuple[str, int], tuple[str, int]]:
        return priority(), await asyncio.to_thread(priority)

    with running(make_settings(tmp_path, rounds=1, wait_devices=2)) as client:
        (_, loop_nice), (name, nice) = client.portal.call(loop_and_worker)
    assert name.startswith("fedkey-io")
    assert nice == min(19, loop_nice + fedkey.server.runtime.worker_threads.IO_NICE)


def test_no_view_offers_an_aggregated_rounds_task_while_its_uploads_are_deleted(
    tmp_path, monkeypatch
):
    """Once round 1's model is served, no phone is told to train round 1 on round 0's model: the
    round is over for the devices before its uploads are deleted (which may take a while)."""
    deleting, release = threading.Event(), threading.Event()
    real_rmtree = shutil.rmtree

    def slow_rmtree(path, *args, **kwargs):
        deleting.set()
        release.wait(30)
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(fedkey.server.round_driver.shutil, "rmtree", slow_rmtree)
    settings = make_settings(tmp_path, rounds=2, fraction=1.0, wait_devices=2)
    with running(settings) as client:
        phones = enroll_phones(client, 2)
        try:
            run_round(phones)
            wait_for(deleting.is_set, what="the uploads were never deleted")
            assert client.get("/v1/model").headers["X-Fedkey-Round"] == "1"
            for p in phones:
                view = p.current()
                assert view["round"] != 1 or view["state"] != "open", view
                assert view["task"] is None or view["task"]["model_round"] == 1, view
        finally:
            release.set()
        wait_round(client, 1)


@pytest.mark.skipif(sys.platform != "linux", reason="nice values are Linux's here")
def test_rounds_are_aggregated_in_a_child_process_below_the_servers_priority(tmp_path):
    """The default: the aggregation runs in its own process (no GIL shared with the event loop),
    AGGREGATION_NICE below the server, and the round it completes is adopted by the server."""
    settings = make_settings(tmp_path, rounds=1, fraction=1.0, wait_devices=2)
    assert settings.aggregate_in == "process"
    with running(settings) as client:
        aggregator = client.app_ref.state.coordinator.aggregator
        child = aggregator.pid()
        assert child is not None and child != os.getpid()
        ours = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, child) == min(
            19, ours + fedkey.server.runtime.worker_threads.AGGREGATION_NICE
        )
        phones = enroll_phones(client, 2)
        wait_for(lambda: all(p.current()["state"] == "open" for p in phones))
        run_round(phones)
        rows = wait_round(client, 1)
        assert client.get("/v1/model").headers["X-Fedkey-Round"] == "1"
        assert aggregator.federation.round == 1 and rows[-1]["round"] == 1
        assert aggregator.pid() == child  # one process for the run


def test_ctrl_c_is_the_servers_to_handle_not_the_aggregation_processs(tmp_path):
    """A terminal's Ctrl-C reaches the server's whole process group. The aggregation process
    ignores it: the server finishes the round in progress and then stops that process itself (a
    child that died of it failed its round and printed a traceback into the server's log)."""
    settings = make_settings(tmp_path, rounds=1, fraction=1.0, wait_devices=2)
    with running(settings) as client:
        aggregator = client.app_ref.state.coordinator.aggregator
        child = aggregator.pid()
        os.kill(child, signal.SIGINT)
        phones = enroll_phones(client, 2)
        wait_for(lambda: all(p.current()["state"] == "open" for p in phones))
        run_round(phones)
        rows = wait_round(client, 1)
        assert rows[-1]["round"] == 1 and not rows[-1].get("failed")
        assert aggregator.pid() == child  # the same process: it did not die of the signal
