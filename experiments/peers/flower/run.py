"""The `fedkey-bench peers` workload in Flower's Simulation Engine (Ray backend), run in its own
venv (.venv-peers/flower): .venv-peers/flower/bin/python experiments/peers/flower/run.py SHARDS.

A ServerApp runs Flower's message-API FedAvg (flwr.serverapp.strategy.FedAvg: C of the phones
sampled each round without replacement, the replies averaged weighted by their "num-examples",
here the words each phone predicts, as fedkey weights) with centralized evaluation of the global
model before the first round and after each (validation and test perplexity, as fedkey's server).
A ClientApp per phone (a SuperNode; its partition id is its phone) trains with peers/workload's
loop. Ray runs the ClientApps in `--workers` actors of one CPU and one torch thread each.
Prints one JSON line (workload.Clock.line) at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/peers: workload

import flwr
import torch
import workload
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.simulation import run_simulation

_SHARDS: dict[str, workload.Shards] = {}


def shards() -> workload.Shards:
    """The .npz, read once per process (the driver, each Ray actor); its path comes in the
    environment, which the actors inherit."""
    path = os.environ["PEERS_SHARDS"]
    if path not in _SHARDS:
        torch.set_num_threads(1)
        _SHARDS[path] = workload.Shards(path)
    return _SHARDS[path]


client = ClientApp()


@client.train()
def train(msg: Message, context: Context) -> Message:
    data = shards()
    phone = int(context.node_config["partition-id"])
    model = data.model()
    workload.load_state(model, msg.content["arrays"].to_torch_state_dict())
    rnd = int(msg.content["config"]["server-round"])
    sentences = data.phones[phone]
    workload.train_local(
        model, sentences, data.meta, seed=data.meta["seed"] * 1_000_003 + rnd * 1_009 + phone
    )
    reply = RecordDict(
        {
            "arrays": ArrayRecord(workload.federated_state(model)),
            "metrics": MetricRecord({"num-examples": workload.count_targets(sentences)}),
        }
    )
    return Message(content=reply, reply_to=msg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shards", help="the .npz fedkey_bench.peers.runner wrote")
    parser.add_argument("--workers", type=int, default=2, help="Ray actors (one CPU each)")
    args = parser.parse_args()
    os.environ["PEERS_SHARDS"] = str(Path(args.shards).resolve())
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    started = time.perf_counter()
    data = shards()
    meta = data.meta
    clock = workload.Clock(data)
    server = ServerApp()

    @server.main()
    def run(grid: Grid, context: Context) -> None:
        model = data.model()

        def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            workload.load_state(model, arrays.to_torch_state_dict())
            return MetricRecord(clock.evaluate(model))

        strategy = FedAvg(
            fraction_train=meta["fraction"],
            fraction_evaluate=0.0,
            min_available_nodes=meta["clients"],
            weighted_by_key="num-examples",
        )
        strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(workload.federated_state(model)),
            num_rounds=meta["rounds"],
            evaluate_fn=evaluate,
        )

    run_simulation(
        server_app=server,
        client_app=client,
        num_supernodes=meta["clients"],
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            # address "local": a Ray instance of its own, never a cluster that `ray start`
            # left running on the machine (ray.init's default would join it).
            "init_args": {"address": "local", "num_cpus": args.workers, "include_dashboard": False},
        },
    )
    print(clock.line("flower", flwr.__version__, started, workers=args.workers), flush=True)


if __name__ == "__main__":
    main()
