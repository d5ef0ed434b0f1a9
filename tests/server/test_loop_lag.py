"""/metrics shows a stalled event loop: fedkey_event_loop_lag_seconds (fedkey.server.runtime.prometheus)."""

import time

from fedkey.testing.http import make_settings, running
from fedkey.testing.wait import wait_for


def lag_over(client, bound: str) -> float:
    """Observations of the loop's lag above `bound` seconds (a bucket's le)."""
    counts = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("fedkey_event_loop_lag_seconds_bucket"):
            le = line.split('le="')[1].split('"')[0]
            counts[le] = float(line.split()[-1])
    return counts["+Inf"] - counts[bound]


def observed(client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("fedkey_event_loop_lag_seconds_count"):
            return float(line.split()[-1])
    raise AssertionError("no fedkey_event_loop_lag_seconds in /metrics")


def test_a_stalled_loop_is_counted_in_the_lag_histogram(tmp_path):
    with running(make_settings(tmp_path, wait_devices=5)) as client:
        wait_for(lambda: observed(client) > 0, 10)  # the watcher runs
        before = lag_over(client, "0.5")
        client.portal.call(time.sleep, 0.8)  # a callback that holds the loop for 0.8 s
        assert wait_for(lambda: lag_over(client, "0.5") >= before + 1, 10)
