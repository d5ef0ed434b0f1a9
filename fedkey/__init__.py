"""fedkey: a federated next-word keyboard.

The one namespace every part installs under. Each subpackage is a folder at the top of the
repository (this folder holds a link to each); the layers, each importing only those below it
(pyproject.toml [tool.importlinter], `make lint`):

    fedkey.cli           the `fedkey` command line
    fedkey.runners       what the commands run: the in-process simulation, loopback, audits
    fedkey.server        the federation service (FastAPI): devices, uploads, the round driver
    fedkey.device_sim    simulated phones: local training, the HTTP client, fleets
    fedkey.keyboard_web  the web keyboard serving an ONNX model
    fedkey.federation    the federation's algorithm: rounds, strategies, privacy, influence
    fedkey.export        a checkpoint to ONNX
    fedkey.corpora       the typing corpora and their partition into phones
    fedkey.models        the language model, its checkpoints and metrics
    fedkey.common        small shared helpers (files, text, the task)

fedkey.testing (tests/support in the checkout, not in the wheel) holds the helpers that the tests
and the research harness share.
"""

__version__ = "0.1.0"
