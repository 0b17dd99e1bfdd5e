"""The key scheme (kvpool.keys / proto/keys.py) against docs/keys.md: its test vectors, its worked
example, an independent reimplementation from the page's prose, and two interpreters with
different hash seeds."""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpool.errors import InvalidArgumentError
from kvpool.keys import (
    KeyNamespace,
    block_keys,
    chain_hashes,
    full_blocks,
    key_for,
    namespace,
)
from kvpool.proto import keys as proto_keys

DOC = Path(__file__).resolve().parents[2] / "docs" / "keys.md"


def _doc() -> str:
    return DOC.read_text(encoding="utf-8")


def _vectors() -> list[dict[str, Any]]:
    text = _doc().split("## Test vectors", 1)[1]
    match = re.search(r"```json\n(.*?)\n```", text, re.S)
    assert match, "docs/keys.md has no ```json block under '## Test vectors'"
    vectors: list[dict[str, Any]] = json.loads(match.group(1))
    return vectors


def _fenced_hex(after: str) -> bytes:
    text = _doc().split(after, 1)[1]
    match = re.search(r"```\n([0-9a-f\n]+)```", text)
    assert match, f"no hex block after {after!r}"
    return bytes.fromhex(match.group(1).replace("\n", ""))


# --- an independent implementation, written from the prose of docs/keys.md -----------------


def _ref_str(s: str) -> bytes:
    raw = s.encode("utf-8")
    return len(raw).to_bytes(4, "little") + raw


def _ref_fingerprint(ns: dict[str, Any], dtype: str) -> bytes:
    data = b"kvpool/keys/v1/namespace\x00"
    data += _ref_str(ns["model"]) + _ref_str(ns.get("revision", ""))
    data += _ref_str(dtype) + _ref_str(ns["kv_layout"])
    for name, default in (("block_size", 0), ("tp_rank", 0), ("tp_size", 1)):
        data += int(ns.get(name, default)).to_bytes(8, "little")
    data += _ref_str(ns.get("extra", ""))
    return hashlib.blake2b(data, digest_size=16).digest()


def _ref_keys(fingerprint: bytes, block_size: int, tokens: list[int], parent: bytes) -> list[str]:
    out = []
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size]
        message = b"kvpool/keys/v1/block\x00" + parent + block_size.to_bytes(4, "little")
        message += b"".join(t.to_bytes(4, "little") for t in block)
        parent = hashlib.blake2b(message, digest_size=16).digest()
        out.append(f"kv1/{fingerprint.hex()}/{parent.hex()}")
    return out


# --- the vectors ------------------------------------------------------------------------------


VECTORS = _vectors()


def test_the_doc_has_vectors_for_every_field() -> None:
    names = {v["name"] for v in VECTORS}
    assert {"basic", "tp-rank-1", "dtype-alias", "all-fields", "short-prompt"} <= names
    assert len(VECTORS) >= 6


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_vector(vector: dict[str, Any]) -> None:
    ns = KeyNamespace(**vector["namespace"])
    assert ns.dtype == vector["canonical_dtype"]
    assert ns.fingerprint.hex() == vector["fingerprint"]
    parent = bytes.fromhex(vector["parent"]) if "parent" in vector else None
    assert block_keys(ns, vector["tokens"], parent=parent) == vector["keys"]
    # The same from numpy token arrays (what tokenizers often return).
    arr = np.array(vector["tokens"], dtype=np.int64)
    assert block_keys(ns, arr, parent=parent) == vector["keys"]
    assert len(vector["keys"]) == full_blocks(len(vector["tokens"]), ns.block_size)


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_vector_matches_an_independent_reimplementation(vector: dict[str, Any]) -> None:
    fingerprint = _ref_fingerprint(vector["namespace"], vector["canonical_dtype"])
    assert fingerprint.hex() == vector["fingerprint"]
    parent = bytes.fromhex(vector["parent"]) if "parent" in vector else fingerprint
    block_size = vector["namespace"]["block_size"]
    assert _ref_keys(fingerprint, block_size, vector["tokens"], parent) == vector["keys"]


def test_worked_example_bytes() -> None:
    ns = KeyNamespace(model="kvpool-test", dtype="float16", kv_layout="hf:L,2,H,T,D", block_size=4)
    assert ns.encode() == _fenced_hex("Namespace encoding")
    message = _fenced_hex("The message hashed for block 0")
    assert message == proto_keys.BLOCK_TAG + ns.fingerprint + struct.pack("<5I", 4, 0, 1, 2, 3)
    first = hashlib.blake2b(message, digest_size=16).digest()
    assert block_keys(ns, [0, 1, 2, 3])[0] == key_for(ns, first)


_CHILD = """
import json, sys
from kvpool.keys import KeyNamespace, block_keys
vectors = json.loads(sys.stdin.read())
out = []
for v in vectors:
    ns = KeyNamespace(**v["namespace"])
    parent = bytes.fromhex(v["parent"]) if "parent" in v else None
    out.append([ns.fingerprint.hex(), block_keys(ns, v["tokens"], parent=parent),
                hash("salted") & 0xFFFF])
print(json.dumps(out))
"""


def test_identical_in_two_interpreters_with_different_hash_seeds() -> None:
    results = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run(
            [sys.executable, "-c", _CHILD],
            input=json.dumps(VECTORS),
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=True,
        )
        results.append(json.loads(done.stdout))
    # The interpreters really were salted differently (Python's hash() differs) ...
    assert [r[2] for r in results[0]] != [r[2] for r in results[1]]
    # ... and the keys are the same, and the documented ones.
    assert [r[:2] for r in results[0]] == [r[:2] for r in results[1]]
    assert [r[1] for r in results[0]] == [v["keys"] for v in VECTORS]


# --- properties -------------------------------------------------------------------------------


NS = KeyNamespace(model="m", dtype="float32", kv_layout="hf:L,2,H,T,D", block_size=8)


def test_a_prompt_extended_keeps_its_leading_keys() -> None:
    tokens = list(range(100, 140))
    assert block_keys(NS, tokens[:24]) == block_keys(NS, tokens)[:3]
    assert block_keys(NS, tokens[:23]) == block_keys(NS, tokens)[:2]  # partial tail: no key


def test_a_changed_token_changes_its_block_and_every_later_one() -> None:
    tokens = list(range(40))
    changed = [*tokens[:10], 999, *tokens[11:]]
    a, b = block_keys(NS, tokens), block_keys(NS, changed)
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:], strict=True))


@pytest.mark.parametrize(
    "field",
    [
        {"model": "m2"},
        {"revision": "r2"},
        {"dtype": "float16"},
        {"kv_layout": "other"},
        {"tp_rank": 1, "tp_size": 2},
        {"tp_size": 2},
        {"extra": "lora-a"},
    ],
)
def test_every_namespace_field_separates_the_keys(field: dict[str, Any]) -> None:
    base = {"model": "m", "dtype": "float32", "kv_layout": "hf:L,2,H,T,D", "block_size": 8}
    other = KeyNamespace(**{**base, **field})
    tokens = list(range(16))
    assert not set(block_keys(NS, tokens)) & set(block_keys(other, tokens))


def test_length_prefixes_keep_fields_apart() -> None:
    a = KeyNamespace(model="ab", revision="c", dtype="f", kv_layout="x", block_size=1)
    b = KeyNamespace(model="a", revision="bc", dtype="f", kv_layout="x", block_size=1)
    assert a.fingerprint != b.fingerprint


def test_a_continued_chain_equals_the_whole_chain() -> None:
    tokens = list(range(64))
    whole = chain_hashes(NS, tokens)
    tail = chain_hashes(NS, tokens[16:], parent=whole[1])
    assert whole[2:] == tail


def test_dtype_spellings_are_one_dtype() -> None:
    spellings = ["float16", "fp16", "half", "torch.float16", "FP16", "numpy.float16"]
    prints = {
        KeyNamespace(model="m", dtype=d, kv_layout="x", block_size=4).fingerprint for d in spellings
    }
    assert len(prints) == 1


@pytest.mark.parametrize(
    ("tokens", "message"),
    [([1, -1], "-1"), ([1, 1 << 32], str(1 << 32)), ([1.5], "1.5"), (["a"], "'a'")],
)
def test_bad_token_ids_are_refused(tokens: list[Any], message: str) -> None:
    ns = KeyNamespace(model="m", dtype="f", kv_layout="x", block_size=len(tokens))
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        block_keys(ns, tokens)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"model": ""},
        {"dtype": ""},
        {"kv_layout": ""},
        {"block_size": 0},
        {"block_size": True},
        {"tp_rank": 2, "tp_size": 2},
        {"tp_rank": -1},
        {"model": "\ud800"},
    ],
)
def test_bad_namespaces_are_refused(kwargs: dict[str, Any]) -> None:
    base: dict[str, Any] = {"dtype": "f", "kv_layout": "x", "block_size": 4}
    with pytest.raises(InvalidArgumentError, match="key namespace"):
        namespace(**{"model": "m", **base, **kwargs})


def test_keys_fit_the_wire_limit() -> None:
    key = block_keys(NS, list(range(8)))[0]
    assert len(key) == 69
    assert key.startswith(NS.prefix + "/")
    assert key.isascii()


def test_only_keys_of_the_scheme_are_taken_to_name_their_content() -> None:
    """A key read by content (no Lookup) must be exactly one of the scheme's keys: anything
    near it — another case, a trailing newline, digits of another script, another version —
    is read through the index."""
    key = key_for(
        namespace("m", dtype="float16", kv_layout="mha", block_size=16),
        hashlib.blake2b(b"x", digest_size=16).digest(),
    )
    head, _, tail = key.rpartition("/")
    assert proto_keys.is_scheme_key(key)
    near = [
        "",
        key[:-1],
        key + "0",
        key + "\n",
        key.upper(),
        key.replace("kv1/", "kv2/", 1),
        head + "/" + tail[:-1] + "\u0663",  # ARABIC-INDIC DIGIT THREE: a digit, not hex
        head + ":" + tail,
        "kv1/" + "g" * 32 + "/" + tail,
    ]
    assert [k for k in near if proto_keys.is_scheme_key(k)] == []
