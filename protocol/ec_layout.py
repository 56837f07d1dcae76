"""The block geometry of the encoder-cache CPU region (R-E01).

One block holds one token row of an encoder output: `block_size_bytes = hidden_dim *
dtype_size`, `num_blocks = ec_cpu_bytes // block_size_bytes`. Part of the local tier.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhandoff.protocol.ec_extra_config import describe, is_int
from kvhandoff.protocol.ec_status import DTYPE_SIZES, canonical_dtype_name
from kvhandoff.protocol.errors import LocalProtocolError

__all__ = ["ECLayout"]


def _positive_int(name: str, value: object, *, minimum: int = 1) -> int:
    if not is_int(value) or value < minimum:
        raise LocalProtocolError(f"{name} must be an int >= {minimum}, got {describe(value)}")
    return value


@dataclass(frozen=True, slots=True)
class ECLayout:
    """Block geometry of the CPU region: one block holds one token row of the encoder output.

    `block_size_bytes = hidden_dim * dtype_size`, `num_blocks = ec_cpu_bytes //
    block_size_bytes`; `hidden_dim` counts Qwen3-VL deepstack rows (see `from_model`).
    """

    hidden_dim: int
    dtype_size: int
    ec_cpu_bytes: int

    def __post_init__(self) -> None:
        _positive_int("hidden_dim", self.hidden_dim)
        _positive_int("dtype_size", self.dtype_size)
        _positive_int("ec_cpu_bytes", self.ec_cpu_bytes)
        if self.num_blocks == 0:
            raise LocalProtocolError(
                f"ec_cpu_bytes {self.ec_cpu_bytes} holds no block of {self.block_size_bytes} "
                f"bytes; raise ec_cpu_bytes to at least {self.block_size_bytes}"
            )

    @classmethod
    def from_model(
        cls,
        out_hidden_size: int,
        num_deepstack_layers: int,
        dtype: str | int,
        ec_cpu_bytes: int,
    ) -> ECLayout:
        """Layout of a model: `hidden_dim = out_hidden_size * (1 + num_deepstack_layers)`.

        `dtype` is a name (`"bfloat16"`, `"torch.float16"`, `"half"`, ...) or an element
        size in bytes.
        """
        _positive_int("out_hidden_size", out_hidden_size)
        _positive_int("num_deepstack_layers", num_deepstack_layers, minimum=0)
        if isinstance(dtype, str):
            size = DTYPE_SIZES.get(canonical_dtype_name(dtype)) if dtype else None
            if size is None:
                raise LocalProtocolError(
                    f"unknown dtype {dtype!r}; accepted: {', '.join(DTYPE_SIZES)} "
                    f"(optionally prefixed 'torch.') or an element size in bytes"
                )
        else:
            size = _positive_int("dtype", dtype)
        return cls(
            hidden_dim=out_hidden_size * (1 + num_deepstack_layers),
            dtype_size=size,
            ec_cpu_bytes=ec_cpu_bytes,
        )

    @property
    def block_size_bytes(self) -> int:
        """Bytes of one block (one token row)."""
        return self.hidden_dim * self.dtype_size

    @property
    def num_blocks(self) -> int:
        """Whole blocks the region holds."""
        return self.ec_cpu_bytes // self.block_size_bytes

    @property
    def region_bytes(self) -> int:
        """Bytes of the region actually used by blocks (`<= ec_cpu_bytes`)."""
        return self.num_blocks * self.block_size_bytes

    def blocks_for(self, size_bytes: int) -> int:
        """Blocks needed to hold an encoding of `size_bytes` bytes (rounded up)."""
        _positive_int("size_bytes", size_bytes)
        return -(-size_bytes // self.block_size_bytes)
