"""The aggregation page leads with the answer: the slower strategy's wall and CPU ratios to the
read at the target's size, against the target."""

from fedkey_bench.aggregation.report import answer, page


def run(uploads, fedavg, fedatt):
    rows = [
        {"server": "this checkout", "what": "read", "per_read": 1.0, "cpu_per_read": 1.0},
        {"server": "this checkout", "what": "fedavg", "per_read": fedavg[0], "cpu_per_read": fedavg[1]},
        {"server": "this checkout", "what": "fedatt", "per_read": fedatt[0], "cpu_per_read": fedatt[1]},
        {"server": "base", "what": "fedavg", "per_read": 99.0, "cpu_per_read": 99.0},
    ]  # fmt: skip
    for r in rows:
        r.update(seconds=1.0, cpu_seconds=1.0, peak_rss_mb=1)
    return {
        "uploads": uploads, "parameters": 1_143_800, "upload_bytes": 4_600_000, "repeats": 2,
        "git_commit": "abcdef1234567", "baseline_commit": None, "machine": "m", "date": "d",
        "command": "fedkey-bench aggregation -n 1000", "rows": rows,
    }  # fmt: skip


def test_the_answer_is_the_slower_strategys_wall_and_cpu_ratio_at_the_targets_size():
    got = answer([run(500, (30.0, 30.0), (2.0, 2.0)), run(1000, (12.5, 11.0), (14.0, 12.25))])
    assert got == (
        "**The slower strategy's aggregation took 14.0x the read (12.2x its CPU seconds) at "
        "1,000 uploads of 1,143,800 parameters (over the target, commit abcdef1234).**"
    )
    assert "within the target" in answer([run(1000, (2.5, 2.0), (3.0, 2.9))])
    assert answer([run(500, (1.0, 1.0), (1.0, 1.0))]).startswith("No run of 1,000")
    assert page([run(1000, (2.5, 2.0), (3.0, 2.9))]).startswith("# Aggregation")
