"""Joining a Ray cluster (or starting one on this machine) for the phones' training and fleets.

`connect(RayOptions(...))` is the one way fedkey reaches Ray: the in-process simulation
(fedkey.device_sim.training.ray_pool), train-central and `fedkey devices` all go through it, so the address
rules and the error a person sees are the same everywhere:

    address None     start a private Ray instance on this machine, bound to 127.0.0.1
    address "auto"   join the cluster `ray start --head` left running here (RAY_ADDRESS or
                     Ray's address file)
    "HOST:PORT"      join the cluster whose head listens there
    "ray://..."      Ray Client, passed through as is

A session shuts down only what it started: a driver that was already connected (a test's, a
caller's) stays connected; one we connected is disconnected; the instance we started is stopped.

Token authentication (Ray 2.60): `ray start --head` turns it on when it finds a token
(RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token, which a local ray.init writes), and a
local instance always has it. Ray's driver picks the token up by itself only for
ray.init(address="auto"); connect() does the same for any address (a token Ray finds turns
RAY_AUTH_MODE=token on unless RAY_AUTH_MODE is set), then asks the head once, so a missing or
wrong token is one line (RayUnavailable) instead of a minute of retries. The mode is fixed for
the process once set: one process should not switch between clusters with different modes.

Ray rewrites a loopback bootstrap address to the machine's outward IP before connecting
(ray-project/ray#59110). `ray start --head --node-ip-address 127.0.0.1` does the same to its own
node (its head listens on every interface), so that works; a head really bound to 127.0.0.1
only (ray.cluster_utils.Cluster, the tests' cluster) cannot be joined that way, and there the
driver connects as a loopback node (Ray's own single-machine mode), which such a cluster needs.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = [
    "RayOptions",
    "RaySession",
    "RayUnavailable",
    "cluster_capacity",
    "connect",
    "resolve_address",
]

#: What a person is told to do when no cluster answers.
_HINT = "start one with `ray start --head` or omit --ray-address"
LOCALHOST = "127.0.0.1"


class RayUnavailable(RuntimeError):
    """No Ray cluster could be reached or started; the message is one line saying what to do."""


@dataclass(frozen=True)
class RayOptions:
    """How the ray backend reaches its cluster and sizes its trainer actors.

    address: None starts a local instance (127.0.0.1); "auto" joins the running cluster on this
    machine; otherwise HOST:PORT of a head (or a ray:// Ray Client address).
    cpus_per_worker / gpus_per_worker: the resources each long-lived trainer actor reserves
    (a fraction of a GPU lets several phones' trainers share one).
    workers: trainer actors to start (None: as many as the cluster's resources hold).
    num_cpus: CPUs of a local instance (None: this machine's); ignored when joining a cluster.
    """

    address: str | None = None
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    workers: int | None = None
    num_cpus: int | None = None

    def __post_init__(self) -> None:
        if self.cpus_per_worker < 0 or self.gpus_per_worker < 0:
            raise ValueError("--ray-cpus-per-worker and --ray-gpus-per-worker cannot be negative")
        if self.cpus_per_worker == 0 and self.gpus_per_worker == 0:
            raise ValueError("a trainer actor needs some CPU or GPU: --ray-cpus-per-worker > 0")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"--workers {self.workers}: the ray backend needs at least one actor")


def _split(address: str) -> tuple[str, int] | None:
    """HOST:PORT (or [v6]:PORT) as (host, port); None when it is not of that form."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve_address(address: str) -> str:
    """The HOST:PORT that `address` names: "auto" is RAY_ADDRESS, else the cluster `ray start`
    recorded on this machine; RayUnavailable when there is none."""
    if address != "auto":
        return address
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    # Where `ray start --head` records its address for `ray.init(address="auto")`.
    from ray._private.services import get_ray_address_from_environment

    found = get_ray_address_from_environment("auto", None)
    if not found:
        raise RayUnavailable(f"no Ray cluster is running on this machine: {_HINT}")
    return str(found)


def _check_reachable(address: str, timeout: float = 5.0) -> None:
    """Fail fast (Ray itself retries for minutes) when nothing listens at HOST:PORT."""
    parts = _split(address)
    if parts is None:
        raise RayUnavailable(f"--ray-address {address!r} is not HOST:PORT, 'auto' or ray://...")
    try:
        with socket.create_connection(parts, timeout=timeout):
            pass
    except OSError as e:
        raise RayUnavailable(f"no Ray cluster at {address} ({e.strerror or e}): {_HINT}") from None


def _listens(host: str, port: int, timeout: float = 5.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Ray's C++ client logs each refused request to fd 2 itself; the caller says it in one line."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _authenticate(address: str) -> None:
    """Token auth as Ray's own ray.init(address="auto") sets it up, for any address, then one
    request to the head; RayUnavailable, one line, when it wants a token we lack or another one.
    (Asking without a token in token mode would abort the process in Ray's C++ loader.)"""
    from ray._private.authentication import authentication_token_setup as auth
    from ray._raylet import AuthenticationTokenLoader, GcsClient  # type: ignore[attr-defined]
    from ray.exceptions import AuthenticationError

    mode = os.environ.get(auth.AUTH_MODE_ENV_VAR)
    have = AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True)
    if have and mode is None:
        auth._enable_token_auth()  # what maybe_enable_token_auth_if_token_available does
        mode = "token"
    path = auth._get_default_token_path()
    todo = (
        "export RAY_AUTH_TOKEN=<what `ray get-auth-token` prints on the head>, "
        f"or run where `ray start` wrote {path}"
    )
    token_mode = mode is not None and mode.lower() == "token"
    if token_mode and not have:
        raise RayUnavailable(f"RAY_AUTH_MODE=token but no Ray auth token was found: {todo}")
    try:
        with _quiet_stderr():
            GcsClient(address=address)
    except AuthenticationError:
        if token_mode:
            env = [v for v in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH") if os.environ.get(v)]
            problem = f"refused the auth token in {(env or [str(path)])[0]}"
        elif mode is None:
            problem = "wants an auth token and none was found"
        else:
            todo = f"unset RAY_AUTH_MODE (or set it to token) and {todo}"
            problem = f"wants an auth token but RAY_AUTH_MODE={mode}"
        raise RayUnavailable(f"the Ray cluster at {address} {problem}: {todo}") from None


@contextlib.contextmanager
def _loopback_driver(host: str, port: int) -> Iterator[dict[str, Any]]:
    """ray.init's extra arguments for the head at `host`; for one bound to loopback only, Ray's
    loopback node mode while the driver connects (the module docstring: ray-project/ray#59110)."""
    from ray._private.services import resolve_ip_for_localhost

    rewritten = resolve_ip_for_localhost(host) if _is_loopback(host) else host
    if rewritten == host or _listens(rewritten, port):  # where Ray's rewrite sends the driver
        yield {}
        return
    from ray._private import ray_constants

    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False  # loopback stays loopback in ray.init
    try:
        yield {"_node_ip_address": LOCALHOST}
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


class RaySession:
    """A driver's connection to Ray; `close()` undoes only what `connect` did."""

    def __init__(self, opts: RayOptions, address: str | None, owned: bool) -> None:
        self.opts = opts
        self.address = address  # the head's HOST:PORT (None: a local instance we started)
        self.owned = owned  # we called ray.init, so close() calls ray.shutdown()

    def close(self) -> None:
        """Disconnect (and, for the local instance connect started, stop it); a connection
        that existed before connect() is left as it was."""
        if self.owned:
            import ray

            if ray.is_initialized():
                ray.shutdown()
            self.owned = False

    def __enter__(self) -> RaySession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(opts: RayOptions) -> RaySession:
    """Connect this process to the cluster `opts.address` names (start a local instance when
    None); RayUnavailable, one line, when it cannot. Reuses a connection already open."""
    try:
        import ray
    except ImportError:  # pragma: no cover - ray is a pinned dependency
        raise RayUnavailable("the ray backend needs Ray: pip install 'ray==2.60.0'") from None

    if ray.is_initialized():
        return RaySession(opts, opts.address, owned=False)
    common: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
    if opts.address is None:
        try:
            ray.init(
                address="local",  # a new instance, never one found in RAY_ADDRESS or /tmp/ray
                num_cpus=opts.num_cpus,
                num_gpus=None,
                _node_ip_address=LOCALHOST,
                **common,
            )
        except Exception as e:  # Ray's start-up errors are long; keep the first line
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RayUnavailable(f"could not start a local Ray instance: {first}") from None
        return RaySession(opts, None, owned=True)
    if opts.address.startswith("ray://"):
        try:
            ray.init(address=opts.address, **common)
        except ConnectionError as e:
            raise RayUnavailable(f"no Ray Client server at {opts.address} ({e})") from None
        return RaySession(opts, opts.address, owned=True)
    address = resolve_address(opts.address)
    _check_reachable(address)
    parts = _split(address)
    assert parts is not None  # _check_reachable refused anything else
    _authenticate(address)
    with _loopback_driver(*parts) as extra:
        try:
            ray.init(address=address, **common, **extra)
        except ConnectionError as e:
            first = str(e).strip().splitlines()[0]
            raise RayUnavailable(f"no Ray cluster at {address} ({first}): {_HINT}") from None
    return RaySession(opts, address, owned=True)


def cluster_capacity(opts: RayOptions) -> int:
    """How many trainer actors of `opts`' size the connected cluster holds (at least 1)."""
    import ray

    resources = ray.cluster_resources()
    counts = []
    if opts.cpus_per_worker > 0:
        counts.append(int(resources.get("CPU", 0) // opts.cpus_per_worker))
    if opts.gpus_per_worker > 0:
        gpus = resources.get("GPU", 0)
        if gpus <= 0:
            raise RayUnavailable(
                "--ray-gpus-per-worker was given but the Ray cluster has no GPU; "
                "drop it or add a GPU node (`ray start --address ... --num-gpus N`)"
            )
        counts.append(int(gpus // opts.gpus_per_worker))
    return max(1, min(counts))
