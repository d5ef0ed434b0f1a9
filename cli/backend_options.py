"""The options of the commands whose phones train on a backend (simulate, train-central and
devices): this machine's processes or a Ray cluster, and the RayOptions built from them."""

from __future__ import annotations

import typer

from fedkey.cli.errors import UserError
from fedkey.device_sim.ray_cluster import RayOptions
from fedkey.device_sim.training.backends import BACKENDS, Backend

#: Where the phones train (fedkey.device_sim.training.backends): simulate, train-central and devices.
BACKEND = {
    "backend": (
        Backend,
        typer.Option(
            "local",
            "--backend",
            envvar="FEDKEY_BACKEND",
            help=f"Where the phones train: {', '.join(BACKENDS)}. local: this machine's "
            "processes (--workers); ray: long-lived trainer actors on a Ray cluster (--ray-*); "
            "stacked (simulate only): a round's phones trained together as stacked models in "
            "this process, on a GPU or the CPU (--device; in stacks of up to 100 phones on a GPU, "
            "of a few on the CPU, "
            "one thread: 1.5-1.8x the phones a second of one --backend local process with a "
            "96-unit model), or in --workers N processes side by side. "
            "Same seed, same weights (stacked: within 1e-6 in fp32, other dropout masks).",
        ),
    ),
    "ray_address": (
        str | None,
        typer.Option(
            None,
            "--ray-address",
            envvar="FEDKEY_RAY_ADDRESS",
            help="--backend ray: the cluster's head HOST:PORT, or 'auto' to join the one "
            "`ray start --head` runs on this machine (default: start a private Ray instance "
            "here, on 127.0.0.1).",
        ),
    ),
    "ray_cpus_per_worker": (
        float,
        typer.Option(
            1.0,
            "--ray-cpus-per-worker",
            min=0.0,
            help="--backend ray: CPUs each trainer actor reserves (one torch thread each).",
        ),
    ),
    "ray_gpus_per_worker": (
        float,
        typer.Option(
            0.0,
            "--ray-gpus-per-worker",
            min=0.0,
            help="--backend ray: GPUs each trainer actor reserves; a fraction (0.25) puts "
            "several trainers on one GPU.",
        ),
    ),
}


def refuse_stacked(opts: dict, command: str) -> None:
    """--backend stacked trains a round's cohort at once: a UserError for a command whose phones
    train one at a time."""
    if opts["backend"] == "stacked":
        raise UserError(
            f"--backend stacked trains a round's phones together, which `fedkey {command}` does "
            "not have; use --backend local or ray (or `fedkey simulate --backend stacked`)"
        )


def ray_options(opts: dict) -> RayOptions | None:
    """The RayOptions of a command's --ray-* options (None under --backend local); a value it
    refuses is a UserError. --workers, when the command has it, is the number of trainer
    actors (default: as many as the cluster's resources hold)."""
    if opts["backend"] != "ray":
        return None
    try:
        return RayOptions(
            address=opts["ray_address"],
            cpus_per_worker=opts["ray_cpus_per_worker"],
            gpus_per_worker=opts["ray_gpus_per_worker"],
            workers=opts.get("workers"),
        )
    except ValueError as e:
        raise UserError(str(e)) from None
