"""`fedkey export`: what a user runs on a checkpoint."""

import json

from typer.testing import CliRunner

from fedkey.cli import app
from fedkey.export.metadata import load_metadata


def test_export_command_writes_model_and_reports_int8(make_checkpoint, tmp_path):
    out = tmp_path / "model.onnx"
    result = CliRunner().invoke(
        app,
        [
            "export",
            "--checkpoint",
            str(make_checkpoint()),
            "--out",
            str(out),
            "--int8",
            "--data",
            "demo",
            "--eval-sentences",
            "50",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{") :])
    assert report["int8"] and report["bytes"] < report["fp32_bytes"]
    assert report["parity_max_abs_diff"] <= 1e-4
    assert report["held_out_ppl_int8"] > 1 and report["held_out_ppl_fp32"] > 1
    meta = load_metadata(out)
    assert meta["round"] == 7 and meta["strategy"] == "fedatt" and meta["int8"]


def test_export_of_a_missing_checkpoint_is_refused(tmp_path):
    result = CliRunner().invoke(app, ["export", "--checkpoint", str(tmp_path / "nope.safetensors")])
    assert result.exit_code != 0 and "does not exist" in result.output
