"""A chaos workload process: seeded client operations on a shared key space, each recorded.

    python -m kvpool.chaos.workload --masters A,B,C --process-id 1 --seed 7 --duration 60 \\
        --keys 256 --out /tmp/run/history-1.jsonl [--mix put=3,get=4,remove=1,...] \\
        [--timeout-s 2] [--rate 200]

Every process draws keys from the same key space (``<prefix>/k00000`` …), so processes overlap
and concurrent puts of one key happen. Values come from :func:`~kvpool.chaos.values.make_value`
with this process's id as writer and a per-process sequence number; get_or_compute's compute
function returns a value with the negative "computed" writer id of this process, so every byte
read can be traced. The client runs in strict mode so that each outcome can be classified
(:mod:`kvpool.chaos.history` has the rules). The history file is written as it goes (see
:class:`~kvpool.chaos.history.HistoryWriter`); SIGTERM or SIGINT end the run after the current
operation, cleanly. The plan of operations (kinds, keys, sizes, value ids) is a pure function of
``(seed, process id)``: :class:`Planner`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvpool.chaos.history import (
    MUTATING_KINDS,
    HistoryWriter,
    KeyResult,
    Op,
    OpKind,
    Outcome,
    Receipt,
)
from kvpool.chaos.values import (
    CONTENT_WRITER,
    Corruption,
    SizeDistribution,
    ValueId,
    computed_writer,
    decode_value,
    make_value,
)
from kvpool.client.core import PutReceipt
from kvpool.client.sync import Client
from kvpool.errors import BlockMissError, ChecksumMismatchError, InvalidArgumentError
from kvpool.logs import bind_process, configure_logging
from kvpool.units import parse_duration, parse_size

MIX_KINDS: tuple[str, ...] = ("put", "get", "remove", "get_or_compute", "batch")
ERROR_TEXT_MAX = 300


@dataclass(frozen=True)
class Mix:
    """Relative weights of the operation kinds; ``batch`` is split evenly between batch_put
    and batch_get."""

    put: float = 0.35
    get: float = 0.30
    remove: float = 0.05
    get_or_compute: float = 0.15
    batch: float = 0.15

    def __post_init__(self) -> None:
        weights = [getattr(self, k) for k in MIX_KINDS]
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"mix weights must be >= 0 with a positive sum, not {self}")

    @classmethod
    def parse(cls, text: str) -> Mix:
        """``put=3,get=5,batch=1``; kinds not named weigh 0."""
        weights = dict.fromkeys(MIX_KINDS, 0.0)
        for part in text.split(","):
            if not part.strip():
                continue
            name, sep, value = part.partition("=")
            name = name.strip()
            if not sep or name not in weights:
                raise ValueError(f"mix: {part!r} is not KIND=WEIGHT with KIND in {MIX_KINDS}")
            try:
                weights[name] = float(value)
            except ValueError:
                raise ValueError(f"mix: weight of {name} is not a number: {value!r}") from None
        return cls(**weights)

    def choose(self, rng: random.Random) -> OpKind:
        kind = rng.choices(MIX_KINDS, weights=[getattr(self, k) for k in MIX_KINDS])[0]
        if kind == "batch":
            return "batch_put" if rng.random() < 0.5 else "batch_get"
        return kind  # type: ignore[return-value]


def key_space(keys: int, prefix: str = "chaos", *, content: bool = False) -> list[str]:
    """The keys every workload process of a run shares; ``content``: in the form of kvpool's
    key scheme (``kv1/<32 hex>/<32 hex>``), keys that name their content — each has one value
    (:data:`~kvpool.chaos.values.CONTENT_WRITER`), and clients read them by content, from the
    node the ring places them on without a Lookup first."""
    if content:
        space = hashlib.blake2b(f"kvpool-chaos/{prefix}".encode(), digest_size=16).hexdigest()
        return [f"kv1/{space}/{i:032x}" for i in range(keys)]
    return [f"{prefix}/k{i:05d}" for i in range(keys)]


@dataclass(frozen=True)
class WorkloadConfig:
    masters: tuple[str, ...]
    process_id: int
    seed: int
    duration_s: float
    keys: int
    out: Path
    mix: Mix = field(default_factory=Mix)
    timeout_s: float = 2.0
    rate: float | None = None
    key_prefix: str = "chaos"
    sizes: SizeDistribution = field(default_factory=SizeDistribution)
    batch_size: int = 4
    replicas: int = 1
    content_keys: bool = False  # key_space(content=True): one value per key

    def __post_init__(self) -> None:
        problems = []
        if not self.masters:
            problems.append("masters: at least one address")
        if self.process_id < 0:
            problems.append("process_id: must be >= 0")
        if self.duration_s <= 0 or self.timeout_s <= 0:
            problems.append("duration_s and timeout_s: must be > 0")
        if self.keys < 1 or self.batch_size < 1:
            problems.append("keys and batch_size: must be >= 1")
        if self.rate is not None and self.rate <= 0:
            problems.append("rate: must be > 0 when given")
        if problems:
            raise ValueError("invalid workload settings: " + "; ".join(problems))


@dataclass(frozen=True, slots=True)
class PlannedOp:
    """One operation to run: keys, and for writes the value id and size of each key's value
    (for get_or_compute: of the value its compute function will return)."""

    index: int
    kind: OpKind
    keys: tuple[str, ...]
    written: tuple[ValueId | None, ...]
    sizes: tuple[int, ...]


class Planner:
    """The seeded plan of one process: what it does does not depend on what the cluster
    answers, so a run replays."""

    def __init__(self, config: WorkloadConfig) -> None:
        self._config = config
        self._rng = random.Random(f"kvpool-chaos/{config.seed}/{config.process_id}")
        self._keys = key_space(config.keys, config.key_prefix, content=config.content_keys)
        self._index = 0
        self._seq = 0

    def _value(self, key: str, writer: int) -> tuple[ValueId, int]:
        if self._config.content_keys:  # one value per key, whoever writes it
            size = self._config.sizes.draw(random.Random(f"kvpool-chaos/{key}"))
            return ValueId(CONTENT_WRITER, 0), size
        self._seq += 1
        return ValueId(writer, self._seq), self._config.sizes.draw(self._rng)

    def next(self) -> PlannedOp:
        cfg = self._config
        kind = cfg.mix.choose(self._rng)
        self._index += 1
        if kind in ("batch_put", "batch_get"):
            keys = tuple(self._rng.sample(self._keys, min(cfg.batch_size, len(self._keys))))
        else:
            keys = (self._rng.choice(self._keys),)
        written: list[ValueId | None] = []
        sizes: list[int] = []
        for key in keys:
            if kind in ("put", "batch_put", "get_or_compute"):
                writer = computed_writer(cfg.process_id) if kind == "get_or_compute" else None
                value, size = self._value(key, cfg.process_id if writer is None else writer)
                written.append(value)
                sizes.append(size)
            else:
                written.append(None)
                sizes.append(0)
        return PlannedOp(self._index, kind, keys, tuple(written), tuple(sizes))


class ClientLike(Protocol):
    """The part of :class:`kvpool.Client` the workload uses (strict mode)."""

    def put_receipt(self, key: str, value: bytes) -> PutReceipt | None: ...
    def batch_put_receipts(self, items: Sequence[tuple[str, bytes]]) -> list[PutReceipt | None]: ...
    def get(self, key: str) -> bytes | None: ...
    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]: ...
    def remove(self, key: str) -> bool: ...
    def get_or_compute(self, key: str, fn: Callable[[], bytes]) -> bytes | None: ...


def _receipt(r: PutReceipt | None) -> Receipt | None:
    if r is None:
        return None
    return Receipt(r.version, r.write_id, r.revision, tuple(r.replicas), tuple(r.member_ids))


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:ERROR_TEXT_MAX]


def _decoded(key: str, data: bytes) -> tuple[ValueId | None, Corruption | None]:
    decoded = decode_value(key, data)
    return (decoded, None) if isinstance(decoded, ValueId) else (None, decoded)


class Executor:
    """Runs planned operations on a client and turns what happened into history records."""

    def __init__(
        self,
        client: ClientLike,
        process_id: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.process_id = process_id
        self._clock = clock
        self._wall = wall_clock

    def invocation(self, planned: PlannedOp, invoke_t: float) -> Op:
        """The record of ``planned`` before it runs (outcome unknown)."""
        results = tuple(
            KeyResult(k, "unknown", written=w)
            for k, w in zip(planned.keys, planned.written, strict=True)
        )
        return Op(
            self.process_id,
            planned.index,
            planned.kind,
            "unknown",
            invoke_t,
            None,
            self._wall(),
            results,
        )

    def values(self, planned: PlannedOp) -> list[bytes]:
        """The bytes of each planned write (built before the call, outside its timing)."""
        out = []
        for key, value, size in zip(planned.keys, planned.written, planned.sizes, strict=True):
            if value is not None and planned.kind != "get_or_compute":
                out.append(make_value(key, value.writer, value.seq, size))
        return out

    def execute(self, planned: PlannedOp, on_invoke: Callable[[Op], None] | None = None) -> Op:
        """Run ``planned``; ``on_invoke`` hears the invocation record just before the call."""
        values = self.values(planned)
        invocation = self.invocation(planned, self._clock())
        if on_invoke is not None:
            on_invoke(invocation)
        run = getattr(self, f"_{planned.kind}")
        outcome, results, error = run(planned, values)
        return Op(
            self.process_id,
            planned.index,
            planned.kind,
            outcome,
            invocation.invoke_t,
            self._clock(),
            invocation.wall_t,
            tuple(results),
            error,
        )

    # --- one method per kind: (outcome, per-key results, error text) -----------------------

    def _put(self, p: PlannedOp, values: list[bytes]) -> tuple[Outcome, list[KeyResult], str]:
        (key,), (written,) = p.keys, p.written
        try:
            receipt = self.client.put_receipt(key, values[0])
        except InvalidArgumentError as e:
            return "fail", [KeyResult(key, "fail", written=written)], _error_text(e)
        except Exception as e:
            return "unknown", [KeyResult(key, "unknown", written=written)], _error_text(e)
        outcome: Outcome = "ok" if receipt is not None else "unknown"
        return outcome, [KeyResult(key, outcome, written=written, receipt=_receipt(receipt))], ""

    def _batch_put(self, p: PlannedOp, values: list[bytes]) -> tuple[Outcome, list[KeyResult], str]:
        pairs = list(zip(p.keys, p.written, strict=True))
        try:
            receipts = self.client.batch_put_receipts(list(zip(p.keys, values, strict=True)))
        except InvalidArgumentError as e:
            return "fail", [KeyResult(k, "fail", written=w) for k, w in pairs], _error_text(e)
        except Exception as e:
            return (
                "unknown",
                [KeyResult(k, "unknown", written=w) for k, w in pairs],
                (_error_text(e)),
            )
        results = []
        for key, written, receipt in zip(p.keys, p.written, receipts, strict=True):
            # An item not committed while the call returned may still have been applied.
            outcome: Outcome = "ok" if receipt is not None else "unknown"
            results.append(KeyResult(key, outcome, written=written, receipt=_receipt(receipt)))
        return "ok", results, ""

    def _get(self, p: PlannedOp, values: list[bytes]) -> tuple[Outcome, list[KeyResult], str]:
        (key,) = p.keys
        try:
            data = self.client.get(key)
        except BlockMissError as e:
            return "ok", [KeyResult(key, "ok", miss=e.reason)], ""
        except ChecksumMismatchError as e:
            return "ok", [KeyResult(key, "ok", miss="checksum_mismatch")], _error_text(e)
        except Exception as e:
            return "fail", [KeyResult(key, "fail")], _error_text(e)
        if data is None:
            return "ok", [KeyResult(key, "ok", miss="absent")], ""
        read, corruption = _decoded(key, data)
        return "ok", [KeyResult(key, "ok", read=read, corruption=corruption)], ""

    def _batch_get(self, p: PlannedOp, values: list[bytes]) -> tuple[Outcome, list[KeyResult], str]:
        try:
            answers = self.client.batch_get(list(p.keys))
        except Exception as e:
            return "fail", [KeyResult(k, "fail") for k in p.keys], _error_text(e)
        results = []
        for key, data in zip(p.keys, answers, strict=True):
            if data is None:
                results.append(KeyResult(key, "ok"))
            else:
                read, corruption = _decoded(key, data)
                results.append(KeyResult(key, "ok", read=read, corruption=corruption))
        return "ok", results, ""

    def _remove(self, p: PlannedOp, values: list[bytes]) -> tuple[Outcome, list[KeyResult], str]:
        (key,) = p.keys
        try:
            removed = self.client.remove(key)
        except InvalidArgumentError as e:
            return "fail", [KeyResult(key, "fail")], _error_text(e)
        except Exception as e:
            return "unknown", [KeyResult(key, "unknown")], _error_text(e)
        return "ok", [KeyResult(key, "ok", removed=bool(removed))], ""

    def _get_or_compute(
        self, p: PlannedOp, values: list[bytes]
    ) -> tuple[Outcome, list[KeyResult], str]:
        (key,), (written,), (size,) = p.keys, p.written, p.sizes
        assert written is not None

        def compute() -> bytes:
            return make_value(key, written.writer, written.seq, size)

        try:
            data = self.client.get_or_compute(key, compute)
        except Exception as e:
            return "fail", [KeyResult(key, "fail", written=written)], _error_text(e)
        if data is None:  # the contract says never; record it for the checker to judge
            return "ok", [KeyResult(key, "ok", written=written)], ""
        read, corruption = _decoded(key, data)
        return "ok", [KeyResult(key, "ok", written=written, read=read, corruption=corruption)], ""


# --- the process --------------------------------------------------------------------------------


def run_workload(
    config: WorkloadConfig,
    stop: threading.Event,
    *,
    client: ClientLike | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
    """Run until ``duration_s`` passed or ``stop`` is set; write the history; a summary."""
    writer = HistoryWriter(config.out, clock=clock)
    own_client: Client | None = None
    try:
        if client is None:
            own_client = Client(
                list(config.masters),
                timeout_s=config.timeout_s,
                replicas=config.replicas,
                strict=True,
            )
            client = own_client
        return _run(config, stop, client=client, own_client=own_client, writer=writer, clock=clock)
    finally:
        writer.close()
        if own_client is not None:
            own_client.close()


def _run(
    config: WorkloadConfig,
    stop: threading.Event,
    *,
    client: ClientLike,
    own_client: Client | None,
    writer: HistoryWriter,
    clock: Callable[[], float],
) -> dict[str, Any]:
    planner = Planner(config)
    executor = Executor(client, config.process_id, clock=clock)
    start_t = clock()
    writer.meta(
        process=config.process_id,
        pid=os.getpid(),
        seed=config.seed,
        masters=list(config.masters),
        keys=config.keys,
        key_prefix=config.key_prefix,
        mix=asdict(config.mix),
        timeout_s=config.timeout_s,
        rate=config.rate,
        sizes=[config.sizes.min_bytes, config.sizes.max_bytes],
        batch_size=config.batch_size,
        start_t=start_t,
        start_wall=time.time(),
    )
    counts: dict[str, dict[str, int]] = {}
    ops = 0
    deadline = start_t + config.duration_s
    while not stop.is_set() and clock() < deadline:
        planned = planner.next()
        on_invoke = writer.invoke if planned.kind in MUTATING_KINDS else None
        op = executor.execute(planned, on_invoke)
        writer.complete(op)
        ops += 1
        by = counts.setdefault(op.kind, {})
        by[op.outcome] = by.get(op.outcome, 0) + 1
        if config.rate is not None:
            wait_s = start_t + ops / config.rate - clock()
            if wait_s > 0:
                stop.wait(min(wait_s, max(0.0, deadline - clock())))
    summary: dict[str, Any] = {
        "process": config.process_id,
        "ops": ops,
        "counts": counts,
        "elapsed_s": round(clock() - start_t, 3),
        "stopped": stop.is_set(),
    }
    if own_client is not None:
        summary["client_stats"] = own_client.stats
    writer.end(**summary, end_t=clock())
    return summary


def parse_args(argv: Sequence[str] | None = None) -> WorkloadConfig:
    parser = argparse.ArgumentParser(
        prog="python -m kvpool.chaos.workload", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--masters", required=True, help="comma-separated master gRPC addresses")
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--duration", required=True, help="how long to run: 60, 30s, 2m")
    parser.add_argument("--keys", type=int, required=True, help="size of the shared key space")
    parser.add_argument("--out", required=True, help="the history file to write (JSON lines)")
    parser.add_argument("--mix", default="", help="put=W,get=W,remove=W,get_or_compute=W,batch=W")
    parser.add_argument("--timeout-s", type=float, default=2.0, help="per-call client timeout")
    parser.add_argument("--rate", type=float, default=None, help="operations per second (max)")
    parser.add_argument("--key-prefix", default="chaos")
    parser.add_argument("--size-min", default=str(SizeDistribution().min_bytes))
    parser.add_argument("--size-max", default="1MiB")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument(
        "--content-keys",
        action="store_true",
        help="keys of kvpool's scheme form with one value each (read by content, no Lookup)",
    )
    args = parser.parse_args(argv)
    try:
        return WorkloadConfig(
            masters=tuple(a.strip() for a in args.masters.split(",") if a.strip()),
            process_id=args.process_id,
            seed=args.seed,
            duration_s=parse_duration(args.duration),
            keys=args.keys,
            out=Path(args.out),
            mix=Mix.parse(args.mix) if args.mix else Mix(),
            timeout_s=args.timeout_s,
            rate=args.rate,
            key_prefix=args.key_prefix,
            sizes=SizeDistribution(parse_size(args.size_min), parse_size(args.size_max)),
            batch_size=args.batch_size,
            replicas=args.replicas,
            content_keys=args.content_keys,
        )
    except ValueError as e:
        parser.error(str(e))  # exits


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    configure_logging("warning", "json", stream=sys.stderr)
    bind_process(role="workload", process_id=config.process_id)
    stop = threading.Event()

    def on_signal(_signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    summary = run_workload(config, stop)
    print(json.dumps(summary, separators=(",", ":")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
