"""One transfer per step each way: a step's small host arrays packed into one int32 buffer.

A speculative round takes a dozen small host arrays (anchors, positions, page tables, sampling
parameters, ...); handed to a compiled executable one by one, each is its own host-to-device
transfer, and a host-paced loop pays for every one.  Packed, they are one transfer; the step
slices and bitcasts the fields back inside the executable.  The same layout carries a step's
small results back in one device-to-host read (``pack_traced`` inside, ``unpack_host`` outside).

The inputs are a NamedTuple or a dataclass of arrays.  Fields must be 4-byte (int32, uint32,
float32) or bool; fields named as device fields (arrays a previous step left on the device)
are passed through untouched.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_PACKABLE = ("int32", "uint32", "float32", "bool")


@dataclasses.dataclass(frozen=True)
class HostPack:
    """Where each host field of a NamedTuple or dataclass sits in one flat int32 buffer
    (hashable: a static argument of the jitted step)."""

    cls: type  # the NamedTuple or dataclass
    fields: tuple[tuple[str, tuple[int, ...], str, int], ...]  # (name, shape, dtype, offset), host fields
    device_fields: tuple[str, ...]
    size: int

    @classmethod
    def of(cls, abstract, device_fields: tuple[str, ...] = ()) -> HostPack:
        """The layout of `abstract` (a NamedTuple or dataclass of arrays or ShapeDtypeStructs)."""
        names = field_names(type(abstract))
        unknown = set(device_fields) - set(names)
        if unknown:
            raise ValueError(f"device fields {sorted(unknown)} are not fields of {type(abstract).__name__}")
        fields, offset = [], 0
        for name in names:
            if name in device_fields:
                continue
            leaf = getattr(abstract, name)
            dtype = np.dtype(leaf.dtype).name
            if dtype not in _PACKABLE:
                raise ValueError(f"{type(abstract).__name__}.{name}: dtype {dtype} cannot be packed (one of {_PACKABLE})")
            shape = tuple(int(d) for d in leaf.shape)
            fields.append((name, shape, dtype, offset))
            offset += math.prod(shape)
        return cls(type(abstract), tuple(fields), tuple(device_fields), offset)

    def spec(self) -> jax.ShapeDtypeStruct:
        """The packed buffer's abstract value (for lowering the step)."""
        return jax.ShapeDtypeStruct((self.size,), jnp.int32)

    def pack(self, values) -> np.ndarray:
        """The host fields of `values` as one int32 numpy buffer."""
        buf = np.empty(self.size, np.int32)
        for name, shape, dtype, offset in self.fields:
            a = np.asarray(getattr(values, name))
            if a.shape != shape:
                raise ValueError(f"{self.cls.__name__}.{name}: shape {a.shape}, layout expects {shape}")
            a = np.ascontiguousarray(a, dtype=np.int32 if dtype == "bool" else dtype)
            buf[offset : offset + a.size] = a.reshape(-1).view(np.int32)
        return buf

    def device(self, values) -> tuple:
        """The device fields of `values`, in layout order (passed beside the buffer)."""
        return tuple(getattr(values, name) for name in self.device_fields)

    def unpack(self, buf, device: tuple) -> Any:
        """Traced inverse of pack + device: the NamedTuple the step computes with."""
        out = dict(zip(self.device_fields, device))
        for name, shape, dtype, offset in self.fields:
            piece = buf[offset : offset + math.prod(shape)].reshape(shape)
            if dtype == "bool":
                piece = piece != 0
            elif dtype != "int32":
                piece = jax.lax.bitcast_convert_type(piece, jnp.dtype(dtype))
            out[name] = piece
        return self.cls(**out)

    def pack_traced(self, values) -> jax.Array:
        """Traced ``pack``: the host fields of `values` (device arrays inside a step) as one int32
        buffer, so a step's small results come back in one device-to-host transfer."""
        pieces = []
        for name, shape, dtype, _ in self.fields:
            x = jnp.asarray(getattr(values, name))
            if x.shape != shape:
                raise ValueError(f"{self.cls.__name__}.{name}: shape {x.shape}, layout expects {shape}")
            x = x.astype(jnp.dtype(dtype))  # e.g. bf16 confidences into a float32 field (exact)
            if dtype == "bool":
                x = x.astype(jnp.int32)
            elif dtype != "int32":
                x = jax.lax.bitcast_convert_type(x, jnp.int32)
            pieces.append(x.reshape(-1))
        return jnp.concatenate(pieces) if pieces else jnp.zeros((0,), jnp.int32)

    def unpack_host(self, buf: np.ndarray) -> Any:
        """Host inverse of ``pack_traced``: numpy views into the int32 buffer read back (device
        fields None)."""
        buf = np.asarray(buf)
        if buf.shape != (self.size,) or buf.dtype != np.int32:
            raise ValueError(f"{self.cls.__name__}: buffer {buf.dtype}{list(buf.shape)}, layout expects int32[{self.size}]")
        out = dict.fromkeys(self.device_fields)
        for name, shape, dtype, offset in self.fields:
            piece = buf[offset : offset + math.prod(shape)].reshape(shape)
            out[name] = piece != 0 if dtype == "bool" else piece.view(np.dtype(dtype))
        return self.cls(**out)


def field_names(cls) -> tuple[str, ...]:
    """The fields of a NamedTuple or dataclass type, in order."""
    return cls._fields if hasattr(cls, "_fields") else tuple(f.name for f in dataclasses.fields(cls))


def with_packed_inputs(fn, index: int):
    """``fn(*args)`` whose argument `index` is a NamedTuple, as a function taking instead the packed
    buffer and the device-field tuple at `index`, `index + 1`, and the layout as keyword ``pack``."""

    def call(*args, pack: HostPack, **kwargs):
        inputs = pack.unpack(args[index], args[index + 1])
        return fn(*args[:index], inputs, *args[index + 2 :], **kwargs)

    return call


def with_packed_outputs(fn):
    """``fn`` returning (a NamedTuple, *rest) as a function returning (its host fields as one
    int32 buffer, its device fields, *rest), the layout passed as keyword ``out_pack``: a step's
    small results then come back in one device-to-host transfer (``HostPack.unpack_host``)."""

    def call(*args, out_pack: HostPack, **kwargs):
        out, *rest = fn(*args, **kwargs)
        return (out_pack.pack_traced(out), out_pack.device(out), *rest)

    return call
