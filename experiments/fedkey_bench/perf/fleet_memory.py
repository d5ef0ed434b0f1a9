"""What an idle phone costs in a Ray phone host (10,000 idle phones in one actor
under 1 GB).

A `fedkey server` child (the demo corpus, waiting for one device more than the bench brings, so
no round ever opens) and one PhoneHost actor of fedkey.device_sim.fleets.ray_fleet on a local Ray instance. The
bench reads the actor's RSS (VmRSS) once it is up, then starts N phones in it: each enrolls and
long-polls GET /v1/rounds/current (`poll_wait` seconds at a time), exactly as a phone of
`fedkey devices --backend ray` waits for a round that does not select it. Once all are enrolled
the RSS is sampled every second for a whole long-poll cycle (so every phone has re-issued its
poll at least once); the report gives the peak, the growth over the empty actor and the growth per
phone. Every phone holds a one-sentence shard of its own: a real phone's shard comes on top.

    python -m fedkey_bench.perf.fleet_memory --phones 1000,10000

(also step fleet_memory of `fedkey-bench perf`).
"""

from __future__ import annotations

import argparse
import json
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from fedkey.device_sim.config import PhoneConfig
from fedkey.runners.processes import free_port, wait_healthy
from fedkey_bench.common.checkout import ROOT

HOST = "127.0.0.1"
MB = 2**20

__all__ = ["measure_idle_phones", "main"]


def _server(storage: Path, port: int, phones: int, secret: str) -> subprocess.Popen:
    """A fedkey server that never opens round 1 (it waits for one device more than `phones`)."""
    cmd = [
        sys.executable, "-m", "fedkey", "server", "--data", "demo", "--storage", str(storage),
        "--host", HOST, "--port", str(port), "--wait-devices", str(phones + 1),
        "--enrollment-secret", secret,
    ]  # fmt: skip
    log = (storage.parent / "server.log").open("w")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def measure_idle_phones(phones: int, poll_wait: float = 30.0, timeout: float = 900.0) -> dict:
    """N idle phones long-polling in one PhoneHost actor: its RSS empty and with them (bytes),
    the growth per phone, enrollment seconds. A local Ray instance and a server child are started
    and stopped here."""
    import ray

    from fedkey.device_sim.fleets.ray_fleet import PhoneHost
    from fedkey.device_sim.ray_cluster import RayOptions, connect

    secret = secrets.token_urlsafe(16)
    with tempfile.TemporaryDirectory(prefix="fleet-memory-") as tmp:
        port = free_port()
        proc = _server(Path(tmp) / "run", port, phones, secret)
        url = f"http://{HOST}:{port}"
        session = connect(RayOptions(num_cpus=1))  # a local instance on 127.0.0.1
        try:
            wait_healthy(url, proc, timeout=120)
            host = PhoneHost.remote(url, secret, 300.0)  # type: ignore[attr-defined]
            empty = ray.get(host.status.remote())
            phone = PhoneConfig(poll_wait=poll_wait, loss_wait=poll_wait, device="cpu")
            fleet = [(f"idle-{i:05d}", [[1, 2 + i % 50, 3]], phone) for i in range(phones)]
            run = host.run.remote(fleet, None)
            started = time.monotonic()
            status = empty
            with tqdm(total=phones, desc=f"{phones} phones enrolling", unit="phone") as bar:
                while status["enrolled"] < phones:
                    ready, _ = ray.wait([run], timeout=1.0)
                    if ready:  # the phones ended before they were all enrolled: say why
                        ray.get(run)
                        raise RuntimeError(f"the phones stopped early: {status}")
                    if time.monotonic() - started > timeout:
                        raise RuntimeError(f"not all phones enrolled in {timeout:.0f} s: {status}")
                    status = ray.get(host.status.remote())
                    bar.update(status["enrolled"] - bar.n)
            enrolled_s = time.monotonic() - started
            samples = []
            for _ in tqdm(range(int(poll_wait) + 5), desc="idle, sampling RSS", unit="s"):
                time.sleep(1.0)
                samples.append(ray.get(host.status.remote())["rss"])
            host.halt.remote()
            reports = ray.get(run, timeout=120)
        finally:
            session.close()
            _stop(proc)
    errors = sorted({r["error"] for r in reports.values() if r["error"]})
    peak = max(samples)
    return {
        "phones": phones,
        "poll_wait_s": poll_wait,
        "enroll_seconds": round(enrolled_s, 1),
        "actor_rss_empty_mb": round(empty["rss"] / MB, 1),
        "actor_rss_idle_peak_mb": round(peak / MB, 1),
        "actor_rss_idle_last_mb": round(samples[-1] / MB, 1),
        "per_phone_kb": round((peak - empty["rss"]) / phones / 1024, 1),
        "under_1_gb": peak < 2**30,
        "phone_errors": errors[:5],
    }


def main(argv: list[str] | None = None) -> list[dict]:
    """`python -m fedkey_bench.perf.fleet_memory --phones 1000,10000`: one row per count, printed as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phones", default="1000,10000", help="Comma-separated phone counts.")
    parser.add_argument("--poll-wait", type=float, default=30.0, help="Long-poll seconds.")
    parser.add_argument("--out", type=Path, help="Also write the rows to this JSON file.")
    args = parser.parse_args(argv)
    counts = [int(x) for x in args.phones.split(",") if x.strip()]
    rows = [measure_idle_phones(n, args.poll_wait) for n in counts]
    text = json.dumps(rows, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return rows


if __name__ == "__main__":
    main()
