"""The disk tier's file format and identity: what a checkpoint file holds and how it is verified.

One checkpoint is one file, `<checkpoint_dir>/<identity hex[:32]>/<num_tokens>-<key hex>.fkpt`::

    header   HEADER_BYTES (124), little-endian:
             magic 8s "FKPTCKP1" | identity 32s | key 16s | num_tokens Q | state_tokens Q | num_blocks Q
             | kind 16s (ASCII, NUL-padded) | payload_bytes Q | payload xxh3-128 16s | header crc32 I
    payload  the state row of every recurrent layer, then the KV blocks covering the prefix:
             conv [L, *conv_shape], ssm [L, *ssm_shape], then per attention layer j: k[j], v[j]
             [num_blocks, block_size, HKV, Dh], each C-contiguous in its dtype (runner/disk_io.py)

`identity` (`checkpoint_identity`) hashes everything that decides what a state row and a KV block mean:
the model (config.json, the weight files' names, sizes, modification times and resolved paths, the
load format and seed for dummy weights), the tokenizer files and the marker, the dtypes, the block
size, the tensor-parallel layout, the device kind, `checkpoint_exact` and the pools' shapes. A file
whose identity differs is foreign and never read as data; one whose header or payload checksum or
length does not match is corrupt or truncated. Both are misses (cache/disk_tier.py).
"""

from __future__ import annotations

import enum
import hashlib
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import xxhash

MAGIC = b"FKPTCKP1"
SUFFIX = ".fkpt"
_HEADER = struct.Struct("<8s32s16sQQQ16sQ16sI")
HEADER_BYTES = _HEADER.size
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model",
                    "special_tokens_map.json", "added_tokens.json", "chat_template.jinja")


class FileDamage(enum.Enum):
    """Why a checkpoint file was not used (cache/disk_tier.py maps these to cache miss reasons)."""

    MISSING = "missing"  # gone (deleted by another process, or its write never finished)
    TRUNCATED = "truncated"  # shorter than its header says
    CORRUPT = "corrupt"  # a checksum, the magic or a field does not match
    FOREIGN = "foreign"  # written for another model, dtype, layout or tokenizer
    READ_ERROR = "read_error"  # the operating system could not read it


class DamagedFile(Exception):
    """A checkpoint file that is not used; `damage` says why."""

    def __init__(self, damage: FileDamage, detail: str) -> None:
        super().__init__(f"{damage.value}: {detail}")
        self.damage = damage


@dataclass(frozen=True)
class FileHeader:
    """A checkpoint file's header (see the module docstring); `payload_bytes` follow it."""

    identity: bytes
    key: bytes
    num_tokens: int
    state_tokens: int
    num_blocks: int
    kind: str
    payload_bytes: int
    payload_digest: bytes

    def encode(self) -> bytes:
        fields = (MAGIC, self.identity, self.key, self.num_tokens, self.state_tokens, self.num_blocks,
                  self.kind.encode("ascii"), self.payload_bytes, self.payload_digest)
        body = _HEADER.pack(*fields, 0)[:-4]
        return body + struct.pack("<I", zlib.crc32(body))

    @staticmethod
    def decode(data: bytes) -> FileHeader:
        """Raises DamagedFile (TRUNCATED, CORRUPT) unless `data` starts with a whole, intact header."""
        if len(data) < HEADER_BYTES:
            raise DamagedFile(FileDamage.TRUNCATED, f"{len(data)} bytes, shorter than the {HEADER_BYTES}-byte header")
        magic, identity, key, num_tokens, state_tokens, num_blocks, kind, payload_bytes, digest, crc = \
            _HEADER.unpack_from(data)
        if magic != MAGIC:
            raise DamagedFile(FileDamage.CORRUPT, f"magic {magic!r} is not {MAGIC!r}")
        if zlib.crc32(data[: HEADER_BYTES - 4]) != crc:
            raise DamagedFile(FileDamage.CORRUPT, "header checksum mismatch")
        try:
            name = kind.rstrip(b"\0").decode("ascii")
        except UnicodeDecodeError:
            raise DamagedFile(FileDamage.CORRUPT, f"kind {kind!r} is not ASCII") from None
        return FileHeader(identity, key, num_tokens, state_tokens, num_blocks, name, payload_bytes, digest)


def payload_digest(chunks) -> bytes:
    """xxh3-128 over the payload's byte chunks (bytes-like), in order: about 20x blake2b's speed
    (64 MiB in 3 ms against 55 ms on this project's CPU), and a checksum, not a defence against forgery."""
    digest = xxhash.xxh3_128()
    for chunk in chunks:
        digest.update(chunk)
    return digest.digest()


def file_name(num_tokens: int, key: bytes) -> str:
    return f"{num_tokens}-{key.hex()}{SUFFIX}"


def parse_file_name(name: str) -> tuple[int, bytes] | None:
    """(num_tokens, key) of a checkpoint file's name; None for any other name."""
    if not name.endswith(SUFFIX):
        return None
    length, _, key = name[: -len(SUFFIX)].partition("-")
    try:
        num_tokens, digest = int(length), bytes.fromhex(key)
    except ValueError:
        return None
    return (num_tokens, digest) if num_tokens > 0 and len(digest) == 16 else None


def identity_dir_name(identity: bytes) -> str:
    return identity.hex()[:32]


def _file_facts(path: Path) -> bytes:
    stat = path.stat()
    return f"{path.name}|{stat.st_size}|{stat.st_mtime_ns}|{path.resolve()}".encode()


def checkpoint_identity(*, model_dir: Path, tokenizer_dir: Path, load_format: str, seed: int, quantization: str,
                        checkpoint_token: str, dtype: str, kv_dtype: str, block_size: int,
                        tensor_parallel_size: int, device: str, checkpoint_exact: bool, pool_shapes: str) -> bytes:
    """32-byte identity of what a checkpoint file's bytes mean (see the module docstring).

    A copy of the weights elsewhere, or a rewrite in place, is another identity (a miss, never wrong
    data): files in the Hugging Face cache resolve to blobs named by their content hash."""
    digest = hashlib.blake2b(digest_size=32)
    digest.update(b"forkpoint-disk-v1\0")
    config = model_dir / "config.json"
    digest.update(config.read_bytes() if config.is_file() else b"no config.json")
    if load_format == "dummy":
        digest.update(f"dummy weights, seed {seed}".encode())
    else:
        for path in sorted(p for p in model_dir.iterdir() if p.suffix in _WEIGHT_SUFFIXES or p.name.endswith(
                ".index.json")):
            digest.update(_file_facts(path))
    for name in _TOKENIZER_FILES:
        path = tokenizer_dir / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes())
    for value in (quantization, checkpoint_token, dtype, kv_dtype, block_size, tensor_parallel_size, device,
                  checkpoint_exact, pool_shapes):
        digest.update(f"\0{value}".encode())
    return digest.digest()


def read_file(path: Path) -> tuple[FileHeader, bytearray]:
    """The header and payload of a checkpoint file, read whole and verified against its own header
    (length, checksums; not the identity: the caller compares it). Raises DamagedFile."""
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            header = FileHeader.decode(handle.read(HEADER_BYTES))
            have = size - HEADER_BYTES
            if have < header.payload_bytes:
                raise DamagedFile(FileDamage.TRUNCATED, f"{path.name}: {have} payload bytes of {header.payload_bytes}")
            if have > header.payload_bytes:
                raise DamagedFile(FileDamage.CORRUPT, f"{path.name}: {have - header.payload_bytes} bytes past the "
                                  "payload")
            payload = bytearray(header.payload_bytes)
            got = handle.readinto(payload)
    except FileNotFoundError:
        raise DamagedFile(FileDamage.MISSING, f"{path.name} is gone") from None
    except OSError as error:
        raise DamagedFile(FileDamage.READ_ERROR, f"{path.name}: {error}") from None
    if got != header.payload_bytes:
        raise DamagedFile(FileDamage.TRUNCATED, f"{path.name}: read {got} of {header.payload_bytes} payload bytes")
    if payload_digest([payload]) != header.payload_digest:
        raise DamagedFile(FileDamage.CORRUPT, f"{path.name}: payload checksum mismatch")
    return header, payload
