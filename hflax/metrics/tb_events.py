"""TensorBoard event files for scalars, written directly: no TensorFlow, tensorboardX or
protobuf dependency.

tensorboardX would do this, but it imports torch whenever torch is installed (the test
extra installs it): seconds of start-up and a second framework's thread pools inside
the JAX process, for the ~60 lines below.

Format (what TensorBoard's reader expects): a file named *.tfevents.* holding TFRecords
  u64 length | u32 masked_crc32c(length bytes) | data | u32 masked_crc32c(data)
each `data` a serialized tensorflow.Event (tensorflow/core/util/event.proto):
  Event   { double wall_time = 1; int64 step = 2; string file_version = 3;
            Summary summary = 5; SessionLog session_log = 7; }
  Summary { repeated Value value = 1; }
  Value   { string tag = 1; float simple_value = 2; TensorProto tensor = 8;
            SummaryMetadata metadata = 9; }
  SessionLog { SessionStatus status = 1; }   (START = 1)
Text (TensorBoard's text plugin) is a Value whose metadata names the plugin,
  SummaryMetadata { PluginData plugin_data = 1; }   PluginData { string plugin_name = 1; }
and whose tensor is one string,
  TensorProto { DataType dtype = 1 (DT_STRING = 7); TensorShapeProto tensor_shape = 2;
                repeated bytes string_val = 8; }
"""
from __future__ import annotations

import math
import os
import socket
import struct
import time


def _crc32c_table():
  table = []
  for byte in range(256):
    crc = byte
    for _ in range(8):  # reflected Castagnoli polynomial
      crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    table.append(crc)
  return table


_TABLE = _crc32c_table()


def masked_crc32c(data: bytes) -> int:
  crc = 0xFFFFFFFF
  for byte in data:
    crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
  crc ^= 0xFFFFFFFF
  # TFRecord masks the CRC so that a CRC of data holding CRCs stays well distributed.
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
  n &= (1 << 64) - 1  # int64 two's complement, as protobuf encodes negatives
  out = bytearray()
  while n > 0x7F:
    out.append((n & 0x7F) | 0x80)
    n >>= 7
  out.append(n)
  return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
  """A length-delimited field (wire type 2): strings and sub-messages."""
  return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _float32(value: float) -> bytes:
  # struct refuses doubles beyond float32's range; TensorBoard should see them as inf.
  if abs(value) > 3.4028234663852886e38:
    value = math.copysign(math.inf, value)
  return struct.pack("<f", value)


def _text_value(tag: str, text: str) -> bytes:
  tensor = b"\x08\x07" + _field(2, b"") + _field(8, text.encode())
  metadata = _field(1, _field(1, b"text"))
  return _field(1, tag.encode()) + _field(8, tensor) + _field(9, metadata)


def encode_event(wall_time: float, step: int, *, scalars=None, texts=None, file_version=None,
                 session_start=False) -> bytes:
  out = b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step)
  if file_version is not None:
    out += _field(3, file_version.encode())
  if scalars or texts:
    values = b"".join(_field(1, _field(1, tag.encode()) + b"\x15" + _float32(value))
                      for tag, value in (scalars or {}).items())
    values += b"".join(_field(1, _text_value(tag, text)) for tag, text in (texts or {}).items())
    out += _field(5, values)
  if session_start:
    out += _field(7, b"\x08\x01")
  return out


class EventFileWriter:
  """Appends one Event of all of a step's scalars per write(); flushed each step."""

  def __init__(self, logdir: str, purge_step: int | None = None):
    os.makedirs(logdir, exist_ok=True)
    # pid in the name: a resumed run started within the same second gets its own file.
    name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
    self.path = os.path.join(logdir, name)
    self._file = open(self.path, "ab")
    self._record(encode_event(time.time(), 0, file_version="brain.Event:2"))
    if purge_step is not None:
      # TensorBoard then hides a crashed run's events at steps >= purge_step.
      self._record(encode_event(time.time(), purge_step, session_start=True))
    self._file.flush()

  def _record(self, data: bytes):
    header = struct.pack("<Q", len(data))
    self._file.write(header + struct.pack("<I", masked_crc32c(header)) + data +
                     struct.pack("<I", masked_crc32c(data)))

  def write(self, step: int, scalars: dict[str, float] | None = None,
            texts: dict[str, str] | None = None):
    self._record(encode_event(time.time(), step, scalars=scalars, texts=texts))
    self._file.flush()

  def close(self):
    self._file.close()
