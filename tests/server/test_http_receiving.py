"""Upload bodies are read at most `settings.max_receiving` at a time: each body being
read holds up to a write batch in the server's memory, so 1,000 phones uploading at once must not
mean 1,000 buffers. The others wait their turn, their bytes in the kernel's socket buffers, and
are then read and answered as usual."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import fedkey.federation.updates.store
import fedkey.server.upload_inbox
from fedkey.testing.http import enroll_phones, make_settings, running
from fedkey.testing.wait import wait_for


@contextlib.contextmanager
def two_trained_phones(tmp_path):
    """A server reading one upload body at a time (max_receiving=1), its gate, and two phones
    selected in its one round and trained, ready to upload."""
    settings = make_settings(tmp_path, rounds=1, wait_devices=2, max_receiving=1)
    with running(settings) as client:
        phones = enroll_phones(client, 2)
        for p in phones:
            p.train(wait_for(lambda p=p: (v := p.current()) and v["state"] == "open" and v))
        yield client, client.app_ref.state.coordinator.parts.inbox.receiving, phones


def test_a_second_upload_body_waits_until_the_first_is_read(tmp_path, monkeypatch):
    inside, most, release = [0], [0], threading.Event()
    real = fedkey.federation.updates.store.receive

    async def held(*args, **kwargs):  # counts the bodies being read; holds them until released
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        try:
            await asyncio.to_thread(release.wait, 60)
            return await real(*args, **kwargs)
        finally:
            inside[0] -= 1

    monkeypatch.setattr(fedkey.federation.updates.store, "receive", held)
    with two_trained_phones(tmp_path) as (client, gate, phones):
        answers: dict[int, int] = {}

        def upload(i: int) -> None:
            answers[i] = phones[i].upload().status_code

        threads = [threading.Thread(target=upload, args=(i,)) for i in range(2)]
        try:
            threads[0].start()
            wait_for(lambda: inside[0] == 1, what="the first body was never read")
            threads[1].start()
            wait_for(lambda: len(gate._waiters or ()) == 1, what="the second never queued")
            assert inside[0] == 1 and most[0] == 1
        finally:
            release.set()
            for t in threads:
                t.join(60)
        assert answers == {0: 200, 1: 200} and most[0] == 1
        wait_for(lambda: client.get("/healthz").json()["state"] == "finished")


def test_an_upload_that_finds_no_slot_in_time_is_told_to_come_back(tmp_path, monkeypatch):
    """Past RECEIVE_WAIT without a slot: 503 + Retry-After, nothing read or stored (a phone
    retries it); the same upload once the slot is free is received as usual."""
    release = threading.Event()
    real = fedkey.federation.updates.store.receive

    async def held(*args, **kwargs):  # holds the one slot until released
        await asyncio.to_thread(release.wait, 60)
        return await real(*args, **kwargs)

    monkeypatch.setattr(fedkey.federation.updates.store, "receive", held)
    monkeypatch.setattr(fedkey.server.upload_inbox, "RECEIVE_WAIT", 0.5)
    with two_trained_phones(tmp_path) as (client, gate, phones):
        first: list[int] = []
        holder = threading.Thread(target=lambda: first.append(phones[0].upload().status_code))
        try:
            holder.start()
            wait_for(lambda: gate.locked(), what="the first body never took the slot")
            busy = phones[1].upload()
            assert busy.status_code == 503 and busy.headers["retry-after"] == "5"
            assert "no upload slot came free" in busy.json()["detail"]
            coordinator = client.app_ref.state.coordinator
            uploads = coordinator.parts.driver.current.uploads
            assert phones[1].name not in uploads  # nothing stored for it
            assert not any(tmp_path.glob(f"run/**/*{phones[1].name}*"))
        finally:
            release.set()
            holder.join(60)
        assert first == [200]
        assert phones[1].upload().status_code == 200  # the retry, once the slot is free
        wait_for(lambda: client.get("/healthz").json()["state"] == "finished")
