"""The history steps of W&B offline run files (`run-<id>.wandb`): W&B's record log, read with its own protobufs.

The file is a 7-byte header, then 32 KiB blocks of records, each a 7-byte header (CRC, little-endian length,
type: 1 whole, 2 first, 3 middle, 4 last part) and its bytes; a record is a serialized `wandb_internal_pb2.Record`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
HEADER = 7


def history(path: Path) -> list[tuple[int, dict]]:
    """(step, {key: value}) of each history record of one offline run file."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for raw in _records(path.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
            rows.append((record.history.step.num, items))
    return rows


def _records(data: bytes):
    position, pending = HEADER, b""
    while position + HEADER <= len(data):
        left = BLOCK - position % BLOCK
        if left < HEADER:  # a block's tail too short for a header is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + HEADER])
        if length == 0 and kind == 0:
            return
        chunk = data[position + HEADER : position + HEADER + length]
        position += HEADER + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk
