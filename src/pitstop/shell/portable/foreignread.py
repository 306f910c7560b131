# Reading files other programs wrote, without ever unpickling: torch.load(weights_only=True) and
# a reader of the .safetensors format.
#
# Rules: a torch.save file is read with torch.load(weights_only=True, map_location="cpu") and
# nothing else; a file that needs more (a pickled Python object) is an ImportRefused that says
# what torch met (without torch's advice to load it unsafely), never unpickled. A .safetensors
# file is read by its own layout — an 8-byte length, a JSON header (at most 100 MiB, and no
# longer than the file), raw little-endian bytes — and every header entry is checked by the core
# (pitstop.core.file.arrays: dtype, shape, data offsets inside the body and of the size the shape
# needs) before any tensor is built; a header nested too deeply to decode is refused too.
# How: torch.load; for .safetensors, json and torch.frombuffer over one copy of the body.

"""Reading foreign checkpoint files: torch.load(weights_only=True) and .safetensors."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Final

import torch

from pitstop.core.file.arrays import check_safetensors_entry
from pitstop.errors import ImportRefused

__all__ = ["read_safetensors", "torch_load"]

_SAFETENSORS_DTYPES: Final = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_ITEMSIZES: Final = {name: dtype.itemsize for name, dtype in _SAFETENSORS_DTYPES.items()}
_SAFETENSORS_HEADER_LIMIT = 100 << 20
_ZIP_MAGIC: Final = b"PK\x03\x04"  # torch.save since 1.6


def torch_load(path: Path) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU; refused with torch's reason.

    A file that is neither a zip archive (torch.save's format) nor a pickle stream (its format
    before torch 1.6) — torch's unpickler stops at its first byte — is no checkpoint at all (a
    YAML or JSON file): the refusal says what import reads, not that unpickling is needed.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        reason = _unpickler_reason(exc)
        if type(exc).__name__ == "UnpicklingError" and _not_a_pickle(path, reason):
            raise ImportRefused(
                f"{path} is not a file torch.save wrote: it is neither a zip archive nor a "
                f"pickle stream (torch: {reason}). pitstop import reads a torch.save file, a "
                f"Lightning .ckpt, a .safetensors file or an Accelerate save_state directory"
            ) from None
        if type(exc).__name__ == "UnpicklingError":
            raise ImportRefused(
                f"{path} needs more than torch.load(weights_only=True) to read — it holds Python "
                f"objects that only unpickling could rebuild, and pitstop never unpickles "
                f"(torch: {reason}). Re-save it with plain tensors, numbers, "
                f"strings, lists and dicts, or convert it in a trusted environment"
            ) from None
        raise ImportRefused(f"{path} is not a file torch.save wrote ({exc})") from None


def _not_a_pickle(path: Path, reason: str) -> bool:
    """Whether torch's unpickler refused ``path`` at an opcode no pickle holds, in a file that
    is no zip archive: a text file, say, rather than a pickle that needs unpickling."""
    with path.open("rb") as file:
        zipped = file.read(len(_ZIP_MAGIC)) == _ZIP_MAGIC
    return not zipped and reason.startswith("Unsupported operand")


def _unpickler_reason(error: BaseException) -> str:
    """The part of torch's weights_only refusal that says what it met (``Unsupported global:
    GLOBAL argparse.Namespace``), without its advice to load the file unsafely."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    found = re.search(
        r"WeightsUnpickler error:\s*(.*?)(?: was not an allowed global|\. |\n|$)", text
    )
    if found and found.group(1).strip():
        return found.group(1).strip()
    return text.strip().splitlines()[0] if text.strip() else type(error).__name__


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Read a .safetensors file: an 8-byte length, a JSON header, raw little-endian bytes.

    Every header entry is checked (pitstop.core.file.arrays.check_safetensors_entry) before any
    tensor is built; a header that is not JSON, or nested too deeply to decode, and any entry
    with an unknown dtype, a bad shape or offsets outside the body is an ImportRefused naming it.
    """
    data = path.read_bytes()
    if len(data) < 8:
        raise ImportRefused(f"{path} is too short to be a .safetensors file")
    length = int.from_bytes(data[:8], "little")
    if length > min(len(data) - 8, _SAFETENSORS_HEADER_LIMIT):
        raise ImportRefused(f"{path}: its .safetensors header length {length} is impossible")
    try:
        header = json.loads(data[8 : 8 + length])
    except RecursionError:
        raise ImportRefused(
            f"{path}: its .safetensors header is nested too deeply to read (a header holds "
            "one level of tensor entries)"
        ) from None
    except ValueError as exc:
        raise ImportRefused(f"{path}: its .safetensors header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ImportRefused(f"{path}: its .safetensors header is not a JSON object")
    body_size = len(data) - 8 - length
    checked = {
        name: check_safetensors_entry(f"{path}: tensor {name!r:.80}", spec, body_size, _ITEMSIZES)
        for name, spec in header.items()
        if name != "__metadata__"
    }
    body = bytearray(data[8 + length :])
    out: dict[str, torch.Tensor] = {}
    for name, (dtype, shape, begin, end) in checked.items():
        raw = (
            torch.frombuffer(body, dtype=torch.uint8, count=end - begin, offset=begin)
            if end > begin
            else torch.empty(0, dtype=torch.uint8)
        )
        out[name] = raw.view(_SAFETENSORS_DTYPES[dtype]).reshape(shape)
    return out
