# Host-to-device copies for reading a checkpoint onto an accelerator (CUDA): each chunk read into
# a pinned bounce buffer is copied to the device on a side stream, so that the copy of one chunk
# overlaps the read of the next.
#
# Rules (pitstop.shell.format.blobread keeps the reader's side of them):
#   * memory a copy writes into is allocated on the device's current stream, and the side stream
#     waits for that stream after every allocation: the caching allocator hands out memory freed
#     on the current stream at once, while kernels queued there may still use it;
#   * a bounce buffer is read into again only once the copy out of it is done (its Copy waited);
#   * drain() waits for every copy queued — the reader calls it before it returns, and before an
#     error leaves it, so that no copy still writes into device memory that is freed and handed
#     out again.
# Untested on a GPU: the development machine has none. tests/shell/test_blobread_device.py runs
# the reader against a stand-in of DeviceCopies that carries out each copy only once it is
# waited for, so a reader that reuses a buffer early, or returns or raises before every copy is
# done, reads wrong bytes there.

"""Host-to-device copies on a side stream, for reading a checkpoint onto a device."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

__all__ = ["Copy", "CudaCopies", "DeviceCopies"]


class Copy(Protocol):
    """One copy in flight."""

    def synchronize(self) -> None:
        """Return once the copy is done."""


class DeviceCopies(Protocol):
    """What reading onto one device needs: bounce buffers, device memory, ordered copies."""

    def bounce(self, nbytes: int) -> torch.Tensor:
        """A host buffer of ``nbytes`` (uint8) that copies to the device can start from."""

    def new_target(self, nbytes: int) -> torch.Tensor:
        """New device memory of ``nbytes`` (uint8) that the copies may write into."""

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> Copy:
        """Queue ``target.copy_(source)``; the returned Copy is done once it has landed."""

    def drain(self) -> None:
        """Return once every copy queued is done."""


class CudaCopies:
    """:class:`DeviceCopies` for one CUDA device: pinned buffers, one side stream."""

    def __init__(self, device: torch.device) -> None:
        import torch

        self.device = device
        self._stream: Any = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def bounce(self, nbytes: int) -> torch.Tensor:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def new_target(self, nbytes: int) -> torch.Tensor:
        import torch

        target = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        return target

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> Copy:
        import torch

        with torch.cuda.stream(self._stream):
            target.copy_(source, non_blocking=True)
            done: Copy = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(self._stream)  # type: ignore[attr-defined]
        return done

    def drain(self) -> None:
        self._stream.synchronize()
