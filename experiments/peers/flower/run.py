"""The `fedkey-bench peers` workload in Flower's Simulation Engine (Ray backend), run in its own
venv (.venv-peers/flower): .venv-peers/flower/bin/python experiments/peers/flower/run.py SHARDS.

A ServerApp runs Flower's message-API FedAvg (flwr.serverapp.strategy.FedAvg: the replies
averaged weighted by their "num-examples", here the words each phone predicts, as fedkey weights)
with centralized evaluation of the global model before the first round and after each
(validation and test perplexity, as fedkey's server). One SuperNode per phone; Ray runs the
ClientApps in `--workers` actors of one CPU and one torch thread each.

Round r trains exactly the phones of the shards' cohort r (fedkey's selection, drawn by the
bench), not a draw of Flower's own: `SameCohorts.configure_train` sends each of them, by its
index, with its training seed of the round (fedkey's client_seed: batches in fedkey's order), to
one of the round's SuperNodes (the first K by node id: in the simulation they are
interchangeable, and Flower's server cannot see which partition a node id holds). The model is
kept per Ray actor (`worker_model`): built once in each actor's process, each phone's ClientApp
loads the round's weights into it, as fedkey's resident trainers keep theirs. Prints one JSON
line (workload.Clock.line) at the end, with the cohorts the replies say were trained.
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
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.simulation import run_simulation

_SHARDS: dict[str, workload.Shards] = {}
_MODEL: dict[str, workload.LanguageModel] = {}


def shards() -> workload.Shards:
    """The .npz, read once per process (the driver, each Ray actor); its path comes in the
    environment, which the actors inherit."""
    path = os.environ["PEERS_SHARDS"]
    if path not in _SHARDS:
        torch.set_num_threads(1)
        _SHARDS[path] = workload.Shards(path)
    return _SHARDS[path]


def worker_model() -> workload.LanguageModel:
    """The model of this process (a Ray actor runs many phones' ClientApps one after another):
    built once; each phone loads the round's weights into it."""
    path = os.environ["PEERS_SHARDS"]
    if path not in _MODEL:
        _MODEL[path] = shards().model()
    return _MODEL[path]


client = ClientApp()


@client.train()
def train(msg: Message, context: Context) -> Message:
    data = shards()
    config = msg.content["config"]
    phone, rnd = int(config["phone"]), int(config["server-round"])
    model = worker_model()
    workload.load_state(model, msg.content["arrays"].to_torch_state_dict())
    sentences = data.phones[phone]
    workload.train_local(model, sentences, data.meta, seed=int(config["seed"]))
    reply = RecordDict(
        {
            "arrays": ArrayRecord(workload.federated_state(model)),
            "metrics": MetricRecord({"num-examples": workload.count_targets(sentences)}),
            "trained": ConfigRecord({"phone": phone, "server-round": rnd}),
        }
    )
    return Message(content=reply, reply_to=msg)


class SameCohorts(FedAvg):
    """FedAvg whose round r trains the shards' cohort r (see the module's docstring); the phones
    the replies name are kept in `trained` (round -> phones)."""

    def __init__(self, data: workload.Shards, **kwargs) -> None:
        super().__init__(**kwargs)
        self.data = data
        self.trained: dict[int, list[int]] = {}

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> list[Message]:
        cohort = self.data.cohorts[server_round - 1]
        seeds = self.data.cohort_seeds[server_round - 1]
        nodes = sorted(grid.get_node_ids())[: len(cohort)]
        messages = []
        for node, phone, seed in zip(nodes, cohort, seeds, strict=True):
            given = ConfigRecord({**config, "server-round": server_round, "phone": phone,
                                  "seed": seed})  # fmt: skip
            content = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: given})
            messages.append(
                Message(content=content, message_type=MessageType.TRAIN, dst_node_id=node)
            )
        return messages

    def aggregate_train(self, server_round: int, replies):
        replies = list(replies)
        self.trained[server_round] = sorted(
            int(m.content["trained"]["phone"]) for m in replies if not m.has_error()
        )
        return super().aggregate_train(server_round, replies)


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
    strategies: list[SameCohorts] = []  # the one the ServerApp runs (in this process)

    @server.main()
    def run(grid: Grid, context: Context) -> None:
        model = data.model()

        def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            workload.load_state(model, arrays.to_torch_state_dict())
            return MetricRecord(clock.evaluate(model))

        strategy = SameCohorts(
            data,
            fraction_train=meta["fraction"],
            fraction_evaluate=0.0,
            min_available_nodes=meta["clients"],
            weighted_by_key="num-examples",
        )
        strategies.append(strategy)
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
    trained = strategies[0].trained if strategies else {}
    done = [trained.get(r, []) for r in range(1, meta["rounds"] + 1)]
    print(clock.line("flower", flwr.__version__, started, workers=args.workers, cohorts=done),
          flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
