"""reference/checkpoint.md: the checkpoint file (fedkey.models.checkpoint.METADATA, the model config and
the model's tensors)."""

from __future__ import annotations

from tools.reference_pages.markup import GENERATED_NOTE, cell, code, paragraphs, table


def checkpoint_reference() -> str:
    """reference/checkpoint.md: what a checkpoint file holds (fedkey.models.checkpoint)."""
    import dataclasses

    from fedkey.models import checkpoint
    from fedkey.models.config import ModelConfig

    config = ModelConfig.preset("small", 10_000)
    shapes = checkpoint.expected_shapes(config)
    lines = [
        GENERATED_NOTE,
        "# Checkpoint format",
        "",
        paragraphs(checkpoint.__doc__),
        "",
        "A run's checkpoints are `RUN_DIR/checkpoints/round_NNNN.safetensors` (`round_0000` is "
        "the initial model); with a server optimizer its buffers are in "
        "`server_opt_NNNN.safetensors` beside them. `fedkey info` prints what one holds.",
        "",
        f"## Metadata (format {checkpoint.FORMAT_VERSION})",
        "",
        'The safetensors header\'s metadata has one key, `"fedkey"`, whose value is a JSON '
        "object with these keys:",
        "",
        *table(["key", "meaning"], [[code(k), cell(m)] for k, m in checkpoint.METADATA.items()]),
        "",
        "The model config (`model`):",
        "",
        *table(
            ["field", "default"],
            [
                [code(f.name), "" if f.default is dataclasses.MISSING else code(f.default)]
                for f in dataclasses.fields(ModelConfig)
            ],
        ),
        "",
        "## Tensors",
        "",
        "One tensor per parameter, named as in the model's `state_dict`; a tied model (the "
        "default) stores the matrix its embedding and output layer share once. The small preset "
        "(GRU, 300, tied) at a 10,000-word vocabulary:",
        "",
        *table(
            ["tensor", "shape", "dtype"],
            [
                [code(name), code(list(shape)), code(str(dtype).removeprefix("torch."))]
                for name, (shape, dtype) in shapes.items()
            ],
        ),
        "",
        "Loading a checkpoint whose tensors do not match its `model` config fails with a message "
        "naming the tensor.",
        "",
        "Read one in Python:",
        "",
        "```python",
        "import json",
        "from safetensors import safe_open",
        "",
        'with safe_open("runs/fedatt/checkpoints/round_0005.safetensors", "pt") as f:',
        '    meta = json.loads(f.metadata()["fedkey"])',
        "    tensors = {name: f.get_tensor(name) for name in f.keys()}",
        "```",
        "",
    ]
    return "\n".join(lines)
