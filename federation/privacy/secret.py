"""The server's secret: where differential privacy's noise and its sampled cohorts come from.

DP's guarantee holds only while nobody can predict the noise. A generator seeded by the run's
seed (which phones are told) or by any 32-bit number (torch's CPU generator keeps 32 bits of
whatever seed it is given) can be replayed by anyone who reads this code, and the published noise
std then lets them subtract the noise exactly. So every draw of DP comes from 256 bits that the
operating system gives the server (``secrets.token_bytes``), kept beside the run:

    RUN_DIR/secret.key   32 bytes, mode 0600, made when a run starts, read when it resumes,
                         never sent to a phone, never in a row, a checkpoint or a log

Each draw is a keyed function of the secret and what it is for (HMAC-SHA-256, RFC 2104): a
round's Gaussian noise, a tree node's, the BLT's t-th draw, the adaptive clip's count noise, a DP
cohort. The noise's bits are SHAKE-256 (FIPS 202) of that key, turned into N(0, 1) through the
inverse normal CDF of 53-bit uniforms, so the stream is a cryptographic one and a resumed run draws
what an uninterrupted one would.

Research runs that must be reproducible name the secret (``--dp-secret``, any passphrase: its
SHA-256 is the key); their rows say ``noise_reproducible: true``, and their epsilon bounds nothing
against whoever knows the passphrase.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from fedkey.common.files import atomic_write
from fedkey.federation.storage import SECRET_FILE

KEY_BYTES = 32
_DOMAIN = b"fedkey-dp/"


def passphrase_key(passphrase: str) -> bytes:
    """The key of an explicit ``--dp-secret``: the SHA-256 of its text."""
    return hashlib.sha256(passphrase.encode()).digest()


class SecretKey:
    """256 secret bits and the draws keyed by them (see the module's docstring)."""

    def __init__(self, key: bytes, reproducible: bool = False) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a DP secret is {KEY_BYTES} bytes, not {len(key)}")
        self._key = key
        self.reproducible = reproducible

    @classmethod
    def fresh(cls) -> SecretKey:
        """A new secret from the operating system."""
        return cls(secrets.token_bytes(KEY_BYTES))

    def __repr__(self) -> str:  # never the key itself
        return f"SecretKey(fingerprint={self.fingerprint!r}, reproducible={self.reproducible})"

    def derive(self, *label: object) -> bytes:
        """The 32-byte key of one stream: HMAC-SHA-256(secret, the label's parts)."""
        message = _DOMAIN + "/".join(str(part) for part in label).encode()
        return hmac.new(self._key, message, hashlib.sha256).digest()

    @property
    def fingerprint(self) -> str:
        """A public name of the secret (a keyed hash: it tells nothing of the key), which a
        run's state records so that a resume with another secret is refused."""
        return self.derive("fingerprint").hex()[:16]

    def uniforms(self, n: int, *label: object) -> np.ndarray:
        """`n` uniforms in (0, 1), float64 with 53 random bits each, from the label's stream."""
        raw = np.frombuffer(hashlib.shake_256(self.derive(*label)).digest(8 * n), dtype="<u8")
        return ((raw >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53

    def normals(self, n: int, *label: object) -> Tensor:
        """`n` independent N(0, 1) draws, float64, from the label's stream."""
        return torch.special.ndtri(torch.from_numpy(self.uniforms(n, *label)))

    def normal_state(self, template: Mapping[str, Tensor], *label: object) -> dict[str, Tensor]:
        """N(0, 1) on every floating entry of `template` (float64, on the CPU), one stream
        filled key by key in sorted order, so the draw does not depend on the dict's order."""
        keys = [k for k in sorted(template) if torch.is_floating_point(template[k])]
        flat = self.normals(sum(template[k].numel() for k in keys), *label)
        out: dict[str, Tensor] = {}
        start = 0
        for k in keys:
            shape = template[k].shape
            out[k] = flat[start : start + template[k].numel()].reshape(shape)
            start += template[k].numel()
        return out

    def rng(self, *label: object) -> np.random.Generator:
        """A numpy generator for a DP cohort's draw, seeded by the label's 256-bit key."""
        return np.random.default_rng(int.from_bytes(self.derive(*label), "big"))


class RunSecret:
    """A run's secret, read or made on first use (so a run directory emptied for a fresh start
    gets a new one): an explicit passphrase (reproducible), else RUN_DIR/secret.key, else, with
    no run directory, one for this process alone."""

    def __init__(self, root: str | Path | None = None, passphrase: str | None = None) -> None:
        self.path = Path(root) / SECRET_FILE if root is not None else None
        self.passphrase = passphrase
        self._key: SecretKey | None = None

    @property
    def reproducible(self) -> bool:
        return self.passphrase is not None

    def exists(self) -> bool:
        """Whether the secret is already fixed: named, loaded, or on disk."""
        return self.reproducible or self._key is not None or bool(self.path and self.path.exists())

    def key(self) -> SecretKey:
        if self._key is None:
            self._key = self._load()
        return self._key

    def _load(self) -> SecretKey:
        if self.passphrase is not None:
            return SecretKey(passphrase_key(self.passphrase), reproducible=True)
        if self.path is None:
            return SecretKey.fresh()
        if self.path.exists():
            stored = self.path.read_bytes()
            if len(stored) != KEY_BYTES:
                raise ValueError(
                    f"{self.path} is not a DP secret ({KEY_BYTES} bytes): restore the run's own, "
                    "or start the run again"
                )
            return SecretKey(stored)
        fresh = secrets.token_bytes(KEY_BYTES)
        write_secret(self.path, fresh)
        return SecretKey(fresh)


def write_secret(path: Path, key: bytes) -> None:
    """Write `key` to `path` atomically, readable by its owner alone from the moment it exists."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, key, mode=0o600)
