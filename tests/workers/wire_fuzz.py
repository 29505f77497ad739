"""Feeds the control plane's decoder (ops/runtime/message.cc, through _core._wire_decode) valid,
truncated, bit-flipped and random messages; run in a process of its own by tests/test_wire.py,
so that a crash fails the test with its signal instead of ending pytest.

    wire_fuzz.py SEED ROUNDS

Prints `VALID <n>`, `REFUSED <n>` and `FUZZ OK` at the end; any decoder result that is neither
the input encoded again nor None is printed as `WRONG ...` and exits 1.
"""

from __future__ import annotations

import random
import struct
import sys

from worker_util import load_core

# The wire format, as ops/runtime/message.cc writes it (native byte order: little-endian here).


def ints(values: list[int]) -> bytes:
    return struct.pack(f"<I{len(values)}q", len(values), *values)


def string(text: bytes) -> bytes:
    return struct.pack("<I", len(text)) + text


def request(name: bytes, type_: int, dtype: int, op: int, shape: list[int],
            splits: list[int] = (), root: int = 0, set_id: int = 0) -> bytes:
    return (string(name) + struct.pack("<BBBidd", type_, dtype, op, root, 1.0, 0.5) +
            ints(shape) + ints(list(splits)) + struct.pack("<i", set_id))


def requests(items: list[bytes], flags: int = 0, set_change: int = 0,
             set_ranks: list[int] = (), set_id: int = 0) -> bytes:
    return (struct.pack("<BB", flags, set_change) + ints(list(set_ranks)) +
            struct.pack("<iI", set_id, len(items)) + b"".join(items))


def response(type_: int, names: list[bytes], dtype: int, op: int, sizes: list[int] = (),
             joined: list[int] = (), shape: list[int] = (), error: bytes = b"") -> bytes:
    return (struct.pack("<BI", type_, len(names)) + b"".join(string(n) for n in names) +
            struct.pack("<BBiddi", dtype, op, 0, 1.0, 1.0, 0) + ints(list(sizes)) +
            ints(list(joined)) + ints(list(shape)) + string(error))


def responses(items: list[bytes], progress: int = 1) -> bytes:
    return struct.pack("<BI", progress, len(items)) + b"".join(items)


VALID = {
    "requests": [
        requests([]),
        requests([request(b"grad/w", 0, 2, 1, [3, 4])], flags=2),
        requests([request(b"a", 1, 10, 0, [5]), request(b"b", 3, 8, 0, [4, 2], [1, 3])],
                 set_change=1, set_ranks=[0, 1]),
    ],
    "responses": [
        responses([]),
        responses([response(0, [b"grad/w", b"grad/b"], 2, 1, sizes=[12, 3], joined=[1])]),
        responses([response(1, [b"x"], 10, 0, sizes=[2, 3]), response(4, [b"y"], 2, 0,
                                                                      error=b"mismatch")]),
        responses([response(10, [], 0, 0, sizes=[1 << 20, 2500, 1])]),  # PERSEUS_AUTOTUNE's
    ],
}
# Each is valid but for one field: the decoder must refuse it.
INVALID = {
    "requests": [
        requests([request(b"a", 0, 11, 1, [1])]),    # dtype 11 does not exist
        requests([request(b"a", 0, 255, 1, [1])]),
        requests([request(b"a", 4, 2, 1, [1])]),     # collective 4
        requests([request(b"a", 0, 2, 5, [1])]),     # reduce op 5
        requests([request(b"a", 0, 2, 1, [-1])]),    # negative dimension
        requests([request(b"a", 3, 2, 1, [2], [-3, 5])]),
        requests([], flags=4),
        requests([], set_change=3),
        requests([], set_ranks=[-1]),
        requests([]) + b"\0",                        # bytes left over
        struct.pack("<BB", 0, 0) + ints([]) + struct.pack("<iI", 0, 0xFFFFFFFF),  # 4 G requests
        struct.pack("<BBI", 0, 0, 0x20000000),       # set_ranks longer than the message
    ],
    "responses": [
        responses([response(0, [b"a"], 11, 1)]),
        responses([response(11, [b"a"], 2, 1)]),   # response type 11
        responses([response(0, [b"a"], 2, 9)]),
        responses([response(1, [b"a"], 2, 0, sizes=[-5])]),
        responses([response(0, [b"a"], 2, 1, joined=[-1])]),
        responses([], progress=2),
        struct.pack("<BI", 1, 0xFFFFFFFF),
        struct.pack("<BIBI", 1, 1, 0, 0xFFFFFFFF),  # 4 G names
    ],
}


def main() -> None:
    seed, rounds = int(sys.argv[1]), int(sys.argv[2])
    core = load_core()
    rng = random.Random(seed)
    counts = {"valid": 0, "refused": 0}

    def check(which: str, data: bytes, expect: str | None) -> None:
        got = core._wire_decode(which, data)
        if got is None:
            counts["refused"] += 1
        elif got != data:
            print(f"WRONG {which}: {data.hex()} decoded and encoded as {got.hex()}", flush=True)
            sys.exit(1)
        else:
            counts["valid"] += 1
        if expect == "valid" and got is None or expect == "refused" and got is not None:
            print(f"WRONG {which}: {data.hex()} should be {expect}", flush=True)
            sys.exit(1)

    for which in ("requests", "responses"):
        for data in VALID[which]:
            check(which, data, "valid")
            for cut in range(len(data)):
                check(which, data[:cut], "refused")
        for data in INVALID[which]:
            check(which, data, "refused")
    for _ in range(rounds):
        which = rng.choice(("requests", "responses"))
        data = bytearray(rng.choice(VALID[which] + INVALID[which]))
        for _ in range(rng.randint(1, 8)):
            mutation = rng.randrange(4)
            if mutation == 0 and data:
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            elif mutation == 1 and data:
                data[rng.randrange(len(data))] = rng.randrange(256)
            elif mutation == 2:
                del data[rng.randrange(len(data) + 1):]
            else:
                at = rng.randrange(len(data) + 1)
                data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        check(which, bytes(data), None)
        check(which, bytes(rng.randrange(256) for _ in range(rng.randint(0, 96))), None)
    print(f"VALID {counts['valid']}\nREFUSED {counts['refused']}\nFUZZ OK", flush=True)


if __name__ == "__main__":
    main()
