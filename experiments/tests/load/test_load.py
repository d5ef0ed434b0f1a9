"""`fedkey-bench load`: a small real run (a server and fake phones over HTTP), its resume, its
failures as one line, and the upload bodies the fake phones send."""

from __future__ import annotations

import asyncio
import json
import shlex
import socket
import time

import numpy as np
import pytest
from safetensors.numpy import load, save
from typer.testing import CliRunner

import fedkey_bench.load.runner as load_bench
from fedkey_bench.cli import app
from fedkey_bench.load.phones import ModelBodies, make_variants, percentile
from fedkey_bench.load.runner import Cell, Options, cohort_size, command, run_load


@pytest.mark.slow
def test_a_small_real_run_completes_every_round_without_errors(tmp_path, monkeypatch, capsys):
    out = tmp_path / "load"
    [r] = run_load([20], 2, label="test", out=out, phones_nice=3, progress=False)
    assert r["phones_nice"] == 3
    assert r["phones"] == 20 and r["rounds"] == 2 and r["rounds_completed"] == 2
    assert r["cohort"] == cohort_size(20) == 2  # 10% of the phones
    assert r["uploads_per_round"] == [2, 2]
    for p in r["per_round"]:
        assert p["selected"] == p["uploads"] == p["uploads_accepted"] == 2
        assert p["seconds"] > 0 and p["healthz"]["n"] > 0
    assert r["errors_total"] == 0 and r["errors"] == {}, r["errors"]
    assert r["phones_finished"] == 20 and r["phones_gave_up"] == 0
    assert r["problem"] is None and r["event_stream_error"] is None
    assert r["healthz"]["n"] > 0 and 0 < r["healthz"]["p50"] <= r["healthz"]["p99"]
    assert r["server_peak_rss"] > 100 * 2**20
    assert 0 < r["server_peak_pss"] <= r["server_peak_rss"]  # shared pages counted once
    assert r["enroll_seconds"] > 0 and len(r["seconds_per_round"]) == 2
    assert r["loop_lag"]["n"] > 10 and r["loop_lag"]["p99_at_most"] > 0  # the server's measure
    assert r["statuses"]["POST /v1/rounds/{n}/update 200"] == 4
    assert "stopped by SIGTERM" in r["server_stop"]
    assert r["command"] == "fedkey-bench load --phones 20 --rounds 2 --label test --phones-nice 3"

    data = json.loads((out / "results.json").read_text())
    assert [x["id"] for x in data["runs"]] == ["test-20-phones-2-rounds-phones-nice-3"]
    md = (out / "results.md").read_text()
    assert "/healthz p50 / p99 / max" in md and "server peak RSS" in md
    assert "| test (phones nice +3) | sqlite | 20 | 2 |" in md
    rounds = (out / "rounds.csv").read_text().splitlines()
    assert len(rounds) == 3 and rounds[2].startswith(f"{r['id']},test,sqlite,20,")

    # Resumable: the same cell again runs nothing.
    def never(*args, **kwargs):
        raise AssertionError("a cell already in results.json ran again")

    monkeypatch.setattr(load_bench, "run_cell", never)
    again = run_load([20], 2, label="test", out=out, phones_nice=3, progress=False)
    assert [x["id"] for x in again] == [r["id"]]


def test_dry_run_prints_each_cells_command(tmp_path, capsys, monkeypatch):
    for name in load_bench.server_overrides():
        monkeypatch.delenv(name)
    run_load([200, 1000], 3, label="baseline", out=tmp_path, dry_run=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "fedkey-bench load --phones 200 --rounds 3 --label baseline",
        "fedkey-bench load --phones 1000 --rounds 3 --label baseline",
    ]
    assert not (tmp_path / "results.json").exists()
    assert command(Cell(10, 1, "x"), Options(drivers=2))[-2:] == ["--drivers", "2"]
    fewer = Cell(10_000, 1, "x", fraction=0.01)
    assert command(fewer, Options())[-2:] == ["--fraction", "0.01"]
    assert fewer.id.endswith("-fraction-0.01") and cohort_size(10_000, 0.01) == 100
    nicer = Cell(10, 1, "x", phones_nice=10)
    assert command(nicer, Options())[-2:] == ["--phones-nice", "10"]
    assert nicer.id != Cell(10, 1, "x").id  # another cell, not a rerun of the same one
    assert Options().driver_count(10_000) == 2 and Options().driver_count(3) == 1
    # a server setting from the environment (it reaches the server) is part of the command
    monkeypatch.setenv("FEDKEY_ADMIT_PER_TICK", "0")
    monkeypatch.setenv("FEDKEY_STORAGE", "/elsewhere")  # the bench's own: not passed on
    assert shlex.join(command(Cell(10, 1, "x"), Options())).startswith(
        "FEDKEY_ADMIT_PER_TICK=0 fedkey-bench load --phones 10 "
    )


def test_cohort_is_the_servers_ten_percent():
    assert [cohort_size(n) for n in (1, 5, 20, 200, 1000, 3000, 10_000)] == [
        1, 1, 2, 20, 100, 300, 1000,
    ]  # fmt: skip


def test_a_busy_port_is_one_error_line(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        result = CliRunner().invoke(
            app, ["load", "--phones", "5", "--port", str(port), "--out", str(tmp_path)]
        )
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot listen on 127.0.0.1:"), lines
    assert "Traceback" not in result.output


def test_bad_phones_and_server_tree_are_one_error_line(tmp_path):
    bad = CliRunner().invoke(app, ["load", "--phones", "a,b", "--out", str(tmp_path)])
    assert bad.exit_code == 1 and bad.stderr.startswith("error: --phones a,b")
    tree = CliRunner().invoke(app, ["load", "--phones", "5", "--server-tree", str(tmp_path)])
    assert tree.exit_code == 1 and "not a fedkey checkout" in tree.stderr


def test_upload_bodies_are_the_checkpoint_plus_noise():
    state = {"w": np.ones((3, 4), np.float32), "n": np.arange(3, dtype=np.int64)}
    bodies = make_variants(save(state, metadata={"fedkey": "{}"}), 3, 1e-3, seed=1)
    assert len(set(bodies)) == 3
    for body in bodies:
        got = load(body)
        assert set(got) == {"w", "n"} and got["w"].dtype == np.float32
        assert 0 < np.abs(got["w"] - 1).max() < 0.01 and (got["n"] == state["n"]).all()


def test_one_phone_builds_a_versions_bodies_the_others_wait():
    async def go():
        models = ModelBodies(variants=2)
        assert models.claim('"v1"') and not models.claim('"v1"')
        waiter = asyncio.create_task(models.wait('"v1"', 5))
        await models.build('"v1"', save({"w": np.zeros(2, np.float32)}))
        assert await waiter and not models.claim('"v1"')
        assert models.body('"v1"', 0) != models.body('"v1"', 1)
        models.claim('"v2"')
        models.release('"v2"')  # its download failed: the next one builds
        assert not await models.wait('"v2"', 1) and models.claim('"v2"')

    asyncio.run(go())


def test_percentile_is_nearest_rank():
    assert percentile([], 99) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([float(x) for x in range(1, 101)], 99) == 99.0


def test_the_database_is_part_of_the_cell_and_its_command(tmp_path, capsys):
    run_load([100, 1000], 3, label="postgres", out=tmp_path, dry_run=True, database="postgresql")
    assert capsys.readouterr().out.splitlines() == [
        "fedkey-bench load --phones 100 --rounds 3 --label postgres --database postgresql",
        "fedkey-bench load --phones 1000 --rounds 3 --label postgres --database postgresql",
    ]
    # SQLite stays the default: its cells keep their ids and commands (results.json resumes)
    assert Cell(100, 3, "x").id == "x-100-phones-3-rounds"
    assert Cell(100, 3, "x", "postgresql").id == "x-100-phones-3-rounds-postgresql"
    assert "--database" not in command(Cell(100, 3, "x"), Options())
    url = "postgresql+psycopg://fedkey@127.0.0.1:5/fedkey"
    argv = load_bench.server_argv(Cell(5, 1, "x", "postgresql"), 80, tmp_path, "s", url)
    assert argv[-2:] == ["--database-url", url]
    assert "--database-url" not in load_bench.server_argv(Cell(5, 1), 80, tmp_path, "s")


def test_the_database_option_reaches_the_cells(tmp_path):
    ok = CliRunner().invoke(
        app,
        ["load", "--phones", "5", "--database", "postgresql", "--dry-run"]
        + ["--out", str(tmp_path)],
    )
    assert ok.exit_code == 0, ok.output
    assert "--database postgresql" in ok.output
    bad = CliRunner().invoke(app, ["load", "--database", "mysql", "--dry-run"])
    assert bad.exit_code != 0 and "'sqlite', 'postgresql'" in bad.output


def test_an_unknown_database_or_a_missing_postgres_is_a_load_error(tmp_path, monkeypatch):
    with pytest.raises(load_bench.LoadError, match="--database mysql: choose one of sqlite"):
        run_load([5], 1, out=tmp_path, database="mysql")
    monkeypatch.setattr(load_bench.postgres, "pg_bin", lambda: None)
    with pytest.raises(load_bench.LoadError, match="initdb not found; install it"):
        load_bench.run_cell(Cell(5, 1, "x", "postgresql"), progress=False)
    assert not (tmp_path / "results.json").exists()


def test_the_report_has_a_database_column(tmp_path):
    row = {
        "id": "p-5-phones-1-rounds-postgresql", "label": "p", "database": "postgresql",
        "phones": 5, "rounds": 1, "uploads_per_round": [1], "seconds_per_round": [1.5],
        "aggregation_seconds": 0.5, "healthz": {"n": 3, "p50": 0.01, "p99": 0.02, "max": 0.03},
        "server_peak_rss": 2**30, "enroll_seconds": 1.0, "errors_total": 0, "errors": {},
        "statuses": {}, "machine": "m", "git_commit": "abc",
        "per_round": [{"round": 1, "selected": 1, "uploads": 1, "seconds": 1.5,
                       "server_seconds": 1.2, "healthz": {"p50": 0.01, "p99": 0.02, "max": 0.03}}],
    }  # fmt: skip
    load_bench.write_report([row], tmp_path, ["fedkey-bench load --database postgresql"])
    md = (tmp_path / "results.md").read_text()
    assert "| label | database | phones |" in md and "| p | postgresql | 5 | 1 | 1.5 |" in md
    rounds = (tmp_path / "rounds.csv").read_text().splitlines()
    assert rounds[1].startswith("p-5-phones-1-rounds-postgresql,p,postgresql,5,0.1,0,1,1,1,")


def test_healthz_is_split_into_collecting_and_aggregating():
    watch = load_bench.Watch()
    offset = time.time() - time.monotonic()
    # round 1: opened at 10, last upload at 20, aggregated at 30 (server clock = monotonic + offset)
    watch.opened_at[1], watch.last_upload_at[1], watch.aggregated_at[1] = (
        10 + offset, 20 + offset, 30 + offset,
    )  # fmt: skip
    watch.health += [
        (5.0, 0.01, None, "waiting"),  # before the round: neither
        (12.0, 0.02, 1, "open"),
        (19.0, 2.0, 1, "open"),  # started collecting, stalled into the aggregation
        (25.0, 0.5, 1, "aggregating"),
    ]
    got = load_bench.split_by_phase(watch, 1)
    assert got == {"collecting": [0.02], "aggregating": [2.0, 0.5]}


def test_a_fraction_outside_0_to_1_is_refused_before_anything_runs(tmp_path):
    from fedkey_bench.load.runner import LoadError

    for bad in (0.0, 1.5):
        with pytest.raises(LoadError, match="share of the phones"):
            run_load([10], 1, out=tmp_path, fraction=bad, dry_run=True)
    assert not (tmp_path / "results.json").exists()


def test_a_rounds_time_never_sets_a_late_event_against_a_timely_probe():
    """Round 2's "opened" event was dropped by a lagging event stream (its "aggregated" came 40 s
    late): both ends come from the /healthz samples, never one from each (a negative time)."""
    from fedkey_bench.load.watch import Watch, round_times

    w = Watch()
    t0 = w.t0
    w.health = [(t0 + 1, 0.01, 1, "open"), (t0 + 5, 0.01, 2, "open"), (t0 + 9, 0.01, 3, "open")]
    w.aggregated = {2: t0 + 49.0}  # arrived late
    w.opened = {}
    times = round_times(w, 2)
    assert times[2] == (t0 + 5, t0 + 9)
    assert all(done >= opened for opened, done in times.values())


def test_loop_lag_is_read_from_the_servers_histogram():
    prometheus = "\n".join(
        [
            "# HELP fedkey_event_loop_lag_seconds ...",
            "# TYPE fedkey_event_loop_lag_seconds histogram",
            'fedkey_event_loop_lag_seconds_bucket{le="0.005"} 950.0',
            'fedkey_event_loop_lag_seconds_bucket{le="0.05"} 985.0',
            'fedkey_event_loop_lag_seconds_bucket{le="0.1"} 989.0',
            'fedkey_event_loop_lag_seconds_bucket{le="0.25"} 998.0',
            'fedkey_event_loop_lag_seconds_bucket{le="+Inf"} 1000.0',
            "fedkey_event_loop_lag_seconds_count 1000.0",
            "fedkey_event_loop_lag_seconds_sum 12.5",
            "# TYPE fedkey_aggregation_seconds histogram",
            "fedkey_aggregation_seconds_count 3.0",
            "fedkey_aggregation_seconds_sum 7.5",
        ]
    )
    h = load_bench._histograms(prometheus, *load_bench.HISTOGRAMS)
    assert h["fedkey_aggregation_seconds"]["sum"] == 7.5
    lag = load_bench.loop_lag(h["fedkey_event_loop_lag_seconds"])
    # 11 wake-ups came over 0.1 s late; 990 of 1,000 is first reached by the 0.25 s bucket
    assert lag == {"n": 1000, "over_0.1": 11, "p99_at_most": 0.25}
    assert load_bench.loop_lag({})["n"] == 0  # a server from before the histogram


def test_the_health_prober_runs_in_its_own_process_and_hands_its_samples_back():
    """A /healthz server on 127.0.0.1 that answers 200 twice, then 503: the prober's samples and
    its error count reach the Watch; a prober killed before it answers leaves prober_died."""
    import http.server
    import os
    import threading

    from fedkey_bench.load.watch import HealthProber, Watch

    seen: list[int] = []
    third = threading.Event()

    class Health(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):  # noqa: N802 (the http.server name)
            seen.append(os.getpid())
            ok = len(seen) <= 2
            body = json.dumps({"round": 1, "state": "collecting"}).encode() if ok else b"{}"
            self.send_response(200 if ok else 503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            if len(seen) >= 3:
                third.set()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        prober = HealthProber(server.server_address[1])
        prober.start()
        assert third.wait(timeout=60), "the prober never asked three times"
        assert prober.proc.pid != os.getpid()
        watch = Watch()
        prober.finish(watch)
        assert [s[3] for s in watch.health[:2]] == ["collecting", "collecting"]
        assert watch.health[0][2] == 1 and watch.health[0][1] > 0
        assert watch.health_errors["http_503"] == len(watch.health) - 2 >= 1

        dead = HealthProber(server.server_address[1])
        dead.start()
        dead.proc.kill()
        dead.proc.join(timeout=10)
        lost = Watch()
        dead.finish(lost, timeout=1.0)
        assert lost.health == [] and lost.health_errors == {"prober_died": 1}
    finally:
        server.shutdown()
