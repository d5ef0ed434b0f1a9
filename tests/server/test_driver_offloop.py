"""The round driver's slow file work stays off the event loop (issue 16, a free event loop): the
uploads of an aggregated round are deleted in a worker thread, and are gone afterwards."""

from __future__ import annotations

import asyncio
import shutil

import pytest

import server.driver
from tests.support.http import enroll_phones, make_settings, run_round, running, wait_round
from tests.support.wait import wait_for


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

    monkeypatch.setattr(server.driver.shutil, "rmtree", rmtree)
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
