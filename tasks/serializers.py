"""Result serializer for Arrow tables: IPC stream bytes, base64 so they fit Prefect's JSON result record."""

import base64
from typing import Literal

import pyarrow as pa
from prefect.serializers import Serializer


class ArrowIPCSerializer(Serializer):
    type: Literal["arrow-ipc"] = "arrow-ipc"

    def dumps(self, obj: pa.Table) -> bytes:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, obj.schema) as writer:
            writer.write_table(obj)
        return base64.b64encode(sink.getvalue().to_pybytes())

    def loads(self, blob: bytes) -> pa.Table:
        return pa.ipc.open_stream(pa.py_buffer(base64.b64decode(blob))).read_all()
