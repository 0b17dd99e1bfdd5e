"""The KV-cache key scheme: token ids cut into fixed blocks, one key per full block.

Part of the wire contract: every engine that shares a pool must build the same key for the same
tokens, in any process on any machine, and two engines whose KV blocks are not interchangeable
must never build the same key. ``docs/keys.md`` specifies it byte for byte, with test vectors.

* A :class:`KeyNamespace` names everything that makes KV blocks interchangeable or not: model,
  revision, dtype, KV layout, block size (tokens per block), tensor-parallel rank and size, and
  an ``extra`` string (a LoRA adapter, a quantisation recipe…). Its *fingerprint* is BLAKE2b-128
  of a canonical, length-prefixed encoding of those fields.
* Block ``i``'s hash is BLAKE2b-128 over a domain tag, its parent's 16-byte hash (block 0's parent
  is the namespace fingerprint), the block's token count and its token ids as unsigned 32-bit
  little-endian integers. A block's hash therefore names its whole prefix and its namespace.
* A block's key is ``kv1/<fingerprint hex>/<block hash hex>`` (69 ASCII characters).
* Only full blocks get keys: a trailing partial block is never cached.

BLAKE2b, not a fast non-cryptographic hash: a prompt crafted to collide with another tenant's
block would make the pool serve that tenant's KV (a wrong read). Never Python's ``hash()``, which
is salted per process. Pure: no I/O, no clocks, no global state.
"""

from __future__ import annotations

import hashlib
import operator
import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

KEY_SCHEME_VERSION = 1
"""Bumped on any change to the encodings below; it is the ``kv1`` in every key."""
KEY_PREFIX = f"kv{KEY_SCHEME_VERSION}"
HASH_BYTES = 16
"""128-bit hashes: BLAKE2b with ``digest_size=16``."""
MAX_BLOCK_TOKENS = 1 << 20
MAX_TOKEN_ID = (1 << 32) - 1

NAMESPACE_TAG = b"kvpool/keys/v1/namespace\x00"
BLOCK_TAG = b"kvpool/keys/v1/block\x00"

DTYPE_ALIASES: dict[str, str] = {
    "fp32": "float32",
    "float": "float32",
    "f32": "float32",
    "fp16": "float16",
    "half": "float16",
    "f16": "float16",
    "bf16": "bfloat16",
    "fp64": "float64",
    "double": "float64",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}
"""Spellings of one dtype that must not split the pool (``torch.float16``, ``fp16`` and
``float16`` are one dtype): see :func:`canonical_dtype`."""


def canonical_dtype(name: str) -> str:
    """A dtype's canonical name: lower case, without a ``torch.``/``numpy.``/``np.`` prefix,
    aliases resolved (``fp16``, ``half`` → ``float16``; ``bf16`` → ``bfloat16``…)."""
    d = name.strip().lower()
    for prefix in ("torch.", "numpy.", "np."):
        if d.startswith(prefix):
            d = d[len(prefix) :]
    return DTYPE_ALIASES.get(d, d)


def _text(field: str, value: object) -> bytes:
    if not isinstance(value, str):
        raise TypeError(f"{field}: expected a str, got {type(value).__name__}")
    try:
        raw = value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{field}: not encodable as UTF-8: {e.reason}") from None
    return struct.pack("<I", len(raw)) + raw


def _count(field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{field}: expected an int, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class KeyNamespace:
    """What makes two engines' KV blocks interchangeable. Equal namespaces ⇔ equal fingerprints
    (up to BLAKE2b-128 collisions); engines whose namespaces differ never share a block."""

    model: str
    """The model's name, e.g. ``meta-llama/Llama-3.1-8B-Instruct``."""
    dtype: str
    """The KV cache's dtype; canonicalised (``torch.float16`` = ``fp16`` = ``float16``)."""
    kv_layout: str
    """How a block's bytes are laid out, e.g. ``hf-llama:layers,kv,heads,tokens,dim``."""
    block_size: int
    """Tokens per block."""
    revision: str = ""
    """The weights' revision (a commit hash, a version)."""
    tp_rank: int = 0
    tp_size: int = 1
    extra: str = ""
    """Anything else that changes the KV: a LoRA adapter, a quantisation recipe, a salt."""
    _fingerprint: bytes = field(default=b"", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        for name in ("model", "dtype", "kv_layout"):
            if not getattr(self, name):
                raise ValueError(f"{name}: must not be empty")
        block_size = _count("block_size", self.block_size)
        if not 1 <= block_size <= MAX_BLOCK_TOKENS:
            raise ValueError(f"block_size: must be in [1, {MAX_BLOCK_TOKENS}], got {block_size}")
        tp_size = _count("tp_size", self.tp_size)
        tp_rank = _count("tp_rank", self.tp_rank)
        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise ValueError(
                f"tp_rank/tp_size: need 0 <= tp_rank < tp_size, got {tp_rank}/{tp_size}"
            )
        digest = hashlib.blake2b(self.encode(), digest_size=HASH_BYTES).digest()
        object.__setattr__(self, "_fingerprint", digest)

    def encode(self) -> bytes:
        """The canonical encoding the fingerprint hashes (docs/keys.md, "Namespace")."""
        return b"".join(
            (
                NAMESPACE_TAG,
                _text("model", self.model),
                _text("revision", self.revision),
                _text("dtype", self.dtype),
                _text("kv_layout", self.kv_layout),
                struct.pack("<QQQ", self.block_size, self.tp_rank, self.tp_size),
                _text("extra", self.extra),
            )
        )

    @property
    def fingerprint(self) -> bytes:
        """BLAKE2b-128 of :meth:`encode`: 16 bytes, the parent of every chain's first block."""
        return self._fingerprint

    @property
    def prefix(self) -> str:
        """``kv1/<fingerprint hex>``: every key of this namespace starts with it and a ``/``."""
        return f"{KEY_PREFIX}/{self.fingerprint.hex()}"


def full_blocks(n_tokens: int, block_size: int) -> int:
    """How many full blocks ``n_tokens`` tokens make (the partial tail gets no key)."""
    return n_tokens // block_size


def _first_bad(token_ids: Sequence[Any]) -> object:
    for t in token_ids:
        try:
            value = operator.index(t)
        except TypeError:
            return t
        if not 0 <= value <= MAX_TOKEN_ID:
            return t
    return None


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """One block's 16-byte hash from its parent's hash and its token ids."""
    if len(parent) != HASH_BYTES:
        raise ValueError(f"a parent hash is {HASH_BYTES} bytes, got {len(parent)}")
    n = len(token_ids)
    try:
        tokens = struct.pack(f"<{n}I", *token_ids)
    except struct.error:
        raise ValueError(
            f"token ids must be integers in [0, {MAX_TOKEN_ID}], got {_first_bad(token_ids)!r}"
        ) from None
    h = hashlib.blake2b(BLOCK_TAG, digest_size=HASH_BYTES)
    h.update(parent)
    h.update(struct.pack("<I", n))
    h.update(tokens)
    return h.digest()


def chain_hashes(
    namespace: KeyNamespace, token_ids: Sequence[int], *, parent: bytes | None = None
) -> list[bytes]:
    """The hash of every full block of ``token_ids``, in order.

    ``parent``: the hash of the block just before ``token_ids[0]`` when continuing a chain
    (``token_ids`` must then start on a block boundary); by default the chain starts at the
    namespace fingerprint, i.e. ``token_ids`` is a whole prompt.
    """
    tokens = token_ids if isinstance(token_ids, Sequence) else list(token_ids)
    size = namespace.block_size
    previous = namespace.fingerprint if parent is None else parent
    out: list[bytes] = []
    for start in range(0, full_blocks(len(tokens), size) * size, size):
        previous = block_hash(previous, tokens[start : start + size])
        out.append(previous)
    return out


KEY_LENGTH = len(KEY_PREFIX) + 2 + 4 * HASH_BYTES
"""Characters in every key of this scheme: ``kv1/`` + 32 hex + ``/`` + 32 hex (69)."""
_SCHEME_KEY = re.compile(f"{KEY_PREFIX}/[0-9a-f]{{{2 * HASH_BYTES}}}/[0-9a-f]{{{2 * HASH_BYTES}}}")


def is_scheme_key(key: str) -> bool:
    """Whether ``key`` has the form of this scheme's keys (:func:`key_for`): such a key names
    its content — one key, one value, in every process that builds it — which is what lets a
    client read it from the node the ring places it on without asking the index."""
    return len(key) == KEY_LENGTH and _SCHEME_KEY.fullmatch(key) is not None


def key_for(namespace: KeyNamespace, hash_: bytes) -> str:
    """The key of the block whose hash is ``hash_``."""
    if len(hash_) != HASH_BYTES:
        raise ValueError(f"a block hash is {HASH_BYTES} bytes, got {len(hash_)}")
    return f"{namespace.prefix}/{hash_.hex()}"


def block_keys(
    namespace: KeyNamespace,
    token_ids: Sequence[int] | Iterable[int],
    *,
    parent: bytes | None = None,
) -> list[str]:
    """The key of every full block of ``token_ids`` (see :func:`chain_hashes`)."""
    tokens = token_ids if isinstance(token_ids, Sequence) else list(token_ids)
    return [key_for(namespace, h) for h in chain_hashes(namespace, tokens, parent=parent)]
