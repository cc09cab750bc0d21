"""Logits through shared memory, for an engine and a sampler service on one host.

The engine makes one segment per Sample stream (mesh/shared_memory.py). It offers the segment's name when the
stream opens and unlinks it once the sampler has answered: from then on only the two processes' mappings keep it,
nothing else can open it, and a new stream (after a sampler restart) gets a new one. A sampler on another host
cannot open the name, declines, and the stream carries bytes.

The segment is a ring of slots. Each step the engine writes the rows' logits into a free slot, once, and the
message names the slot, its generation, dtype and shape; the sampler samples the slot's memory in place. Each
slot's header holds three generations: `written` (set by the engine before it sends), `reading` and `done` (set
by the sampler before and after it reads). The engine writes a slot only when done == written, so never while
the sampler may still read it; the sampler checks that written is the message's generation before it reads and
again after.

On a GPU, the same ring can live on the device (CUDA IPC through torch.multiprocessing's CUDA tensor sharing):
the host segment then holds only what the headers need on the host, and the sampler takes the device ring only
when it runs on the same GPU.
"""

import mmap
import secrets
import struct

import torch

from llmmesh.v1 import sampler_pb2
from mesh.shared_memory import create_segment, is_segment_name, open_segment, unlink_segment

_PREFIX = "llmmesh-logits"  # a segment's name: this, then 32 hex digits
_PAGE = mmap.PAGESIZE
_TOKEN_BYTES = 16
_HEADER = struct.Struct("<3q")  # written, reading, done
_SLOT_HEADER_BYTES = 64  # one cache line each: the two sides write different slots' headers without sharing one
MAX_SLOTS = (_PAGE - _TOKEN_BYTES) // _SLOT_HEADER_BYTES


class SharedSlots:
    """A ring of `num_slots` slots of `slot_bytes` each in one shared-memory segment (the engine's or the
    sampler's mapping of it); `device` is set when the slots' data live in a CUDA ring instead."""

    def __init__(self, name: str, buffer: mmap.mmap, num_slots: int, slot_bytes: int, token: bytes):
        self.name = name
        self.buffer = buffer
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.token = token
        self.linked = False  # the name still exists under SHM_DIR (the engine's side, until unlink)
        self.generation = 0  # the engine's: the last generation it wrote, over all slots
        self.next_slot = 0
        self.device_ring: torch.Tensor | None = None  # [num_slots * slot_bytes] uint8 on a CUDA device
        # slot -> (dtype, shape, the tensor over it): the sampler's next step of that shape takes it again (a new
        # view is slow to make once the engine's forward pass has emptied the caches)
        self._views: dict[int, tuple] = {}

    # ---- the engine's side -------------------------------------------------------------------------

    @classmethod
    def create(cls, num_slots: int, slot_bytes: int, host_data: bool = True) -> "SharedSlots":
        """A new owner-only segment; OSError when it cannot be had (no /dev/shm, or not enough room in it).
        host_data=False: headers only (the data live in a device ring)."""
        if not 1 <= num_slots <= MAX_SLOTS:
            raise ValueError(f"num_slots must be in [1, {MAX_SLOTS}], got {num_slots}")
        slot_bytes = -(-slot_bytes // _PAGE) * _PAGE
        name, buffer = create_segment(_PREFIX, _PAGE + (num_slots * slot_bytes if host_data else 0))
        token = secrets.token_bytes(_TOKEN_BYTES)
        buffer[:_TOKEN_BYTES] = token
        slots = cls(name, buffer, num_slots, slot_bytes, token)
        slots.linked = True
        return slots

    @classmethod
    def for_device(cls, num_slots: int, slot_bytes: int, device: torch.device) -> "SharedSlots":
        """Slots for logits on this device: in the segment on a CPU, in a CUDA ring on a GPU (the segment then
        holds the headers only)."""
        on_gpu = device.type == "cuda"
        slots = cls.create(num_slots, slot_bytes, host_data=not on_gpu)
        if on_gpu:
            slots.device_ring = torch.empty(num_slots * slots.slot_bytes, dtype=torch.uint8, device=device)
        return slots

    def offer(self) -> sampler_pb2.SharedMemoryOffer:
        offer = sampler_pb2.SharedMemoryOffer(
            name=self.name, num_slots=self.num_slots, slot_bytes=self.slot_bytes, token=self.token
        )
        if self.device_ring is not None:
            from torch.multiprocessing.reductions import reduce_tensor

            # torch.multiprocessing's own sharing of the ring (what it would pickle, field by field)
            _, (*_, handle, size, offset, _, counter, counter_offset, event, event_sync) = reduce_tensor(
                self.device_ring
            )
            uuid = _device_uuid(self.device_ring.device)
            offer.cuda.CopyFrom(
                sampler_pb2.CudaIpcRing(
                    device_uuid=uuid, handle=handle, storage_size_bytes=size, storage_offset_bytes=offset,
                    ref_counter_handle=counter, ref_counter_offset=counter_offset, event_handle=event or b"",
                    event_sync_required=event_sync,
                )
            )  # fmt: skip
        return offer

    @property
    def form(self) -> int:
        """The LogitsForm these slots give."""
        return (
            sampler_pb2.LOGITS_FORM_CUDA_IPC if self.device_ring is not None else sampler_pb2.LOGITS_FORM_SHARED_MEMORY
        )

    def unlink(self) -> None:
        """Remove the name: the mappings stay, nothing new can open it."""
        if self.linked:
            self.linked = False
            unlink_segment(self.name)

    def claim(self, nbytes: int) -> tuple[int, int] | None:
        """A free slot for nbytes and the generation to write it with (the writer sets the slot's `written` to it
        once the data are in); None when none is free or they do not fit."""
        if nbytes > self.slot_bytes:
            return None
        for i in range(self.num_slots):
            slot = (self.next_slot + i) % self.num_slots
            written, _, done = self.header(slot)
            if done == written:
                break
        else:
            return None
        self.next_slot = (slot + 1) % self.num_slots
        self.generation += 1
        return slot, self.generation

    def write(self, logits: torch.Tensor) -> tuple[int, int] | None:
        """Copy logits into a free slot; (slot, generation), or None when none is free or they do not fit."""
        nbytes = logits.numel() * logits.element_size()
        claimed = self.claim(nbytes)
        if claimed is None:
            return None
        slot, generation = claimed
        if nbytes:
            # On the host, torch's copy runs on the thread pool the forward pass has just left awake: faster than one
            # memcpy (docs/benchmarks.md).
            self._data(slot, logits.dtype, logits.shape).copy_(logits)
            if self.device_ring is not None:
                torch.cuda.current_stream(self.device_ring.device).synchronize()  # done before the sampler reads it
        struct.pack_into("<q", self.buffer, self._offset(slot), generation)
        return slot, generation

    def released(self, slot: int, generation: int) -> bool:
        """The sampler is done with this slot's contents of that generation."""
        written, _, done = self.header(slot)
        return written == generation and done == generation

    def close(self) -> None:
        """Unlink if not yet, and drop this side's mapping (a sampler still reading keeps its own)."""
        self.unlink()
        self.device_ring = None
        self._views.clear()
        self.buffer = None  # unmapped once no tensor views it

    # ---- the sampler's side ------------------------------------------------------------------------

    @classmethod
    def open(cls, name: str, num_slots: int, slot_bytes: int, token: bytes, host_data: bool = True) -> "SharedSlots":
        """The engine's segment; ValueError (naming what does not match) or OSError when it cannot be used."""
        if not is_segment_name(name, _PREFIX):
            raise ValueError(f"name must look like llmmesh-logits-<32 hex digits>, got {name[:64]!r}")
        if not 1 <= num_slots <= MAX_SLOTS or slot_bytes < 0 or slot_bytes % _PAGE:
            raise ValueError(f"num_slots must be in [1, {MAX_SLOTS}] and slot_bytes a multiple of {_PAGE}")
        buffer = open_segment(name)
        size = _PAGE + (num_slots * slot_bytes if host_data else 0)
        if len(buffer) != size:
            buffer.close()
            raise ValueError(f"the segment holds {len(buffer)} bytes; {num_slots} slots of {slot_bytes} need {size}")
        if buffer[:_TOKEN_BYTES] != token:
            raise ValueError("the segment's token does not match: not the engine's segment")
        return cls(name, buffer, num_slots, slot_bytes, token)

    @classmethod
    def from_offer(cls, offer: sampler_pb2.SharedMemoryOffer, device: torch.device) -> "SharedSlots":
        """The sampler's mapping of the engine's offer, to sample on `device`; ValueError or OSError (and what
        CUDA raises) when it cannot be had."""
        on_gpu = offer.HasField("cuda")
        slots = cls.open(offer.name, offer.num_slots, offer.slot_bytes, offer.token, host_data=not on_gpu)
        if on_gpu:
            slots.device_ring = _open_cuda_ring(offer.cuda, offer.num_slots * offer.slot_bytes, device)
        return slots

    def read(self, slot: int, generation: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        """The slot's logits, in place (no copy); ValueError names what does not match."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot must be in [0, {self.num_slots}), got {slot}")
        numel = 1
        for d in shape:
            numel *= d
        if numel * dtype.itemsize > self.slot_bytes:
            raise ValueError(f"shape {shape} of {dtype} does not fit a slot of {self.slot_bytes} bytes")
        self._check_written(slot, generation)
        struct.pack_into("<q", self.buffer, self._offset(slot) + 8, generation)
        return self._data(slot, dtype, shape)

    def finish(self, slot: int, generation: int) -> None:
        """Done reading: the engine may write the slot again. ValueError if it was written meanwhile."""
        self._check_written(slot, generation)
        struct.pack_into("<q", self.buffer, self._offset(slot) + 16, generation)

    def _check_written(self, slot: int, generation: int) -> None:
        written = self.header(slot)[0]
        if written != generation:
            raise ValueError(
                f"generation {generation} of slot {slot} is not what the slot holds (generation {written})"
            )

    # ---- both ----------------------------------------------------------------------------------------

    def host_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The headers as [num_slots, 8] int64 (written, reading, done, then the rest of the line) and the slots'
        data as [num_slots, slot_bytes] uint8, over the segment (kernels/cpu/greedy_steps.cpp works on them)."""
        line = _SLOT_HEADER_BYTES // 8
        headers = torch.frombuffer(self.buffer, dtype=torch.int64, count=self.num_slots * line, offset=_TOKEN_BYTES)
        data = torch.frombuffer(self.buffer, dtype=torch.uint8, count=self.num_slots * self.slot_bytes, offset=_PAGE)
        return headers.view(self.num_slots, line), data.view(self.num_slots, self.slot_bytes)

    def _offset(self, slot: int) -> int:
        return _TOKEN_BYTES + slot * _SLOT_HEADER_BYTES

    def header(self, slot: int) -> tuple[int, int, int]:
        return _HEADER.unpack_from(self.buffer, self._offset(slot))

    def _data(self, slot: int, dtype: torch.dtype, shape) -> torch.Tensor:
        numel = 1
        for d in shape:
            numel *= d
        if self.device_ring is not None:
            start = slot * self.slot_bytes
            return self.device_ring[start : start + numel * dtype.itemsize].view(dtype).view(shape)
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        view = self._views.get(slot)
        if view is None or view[0] != dtype or view[1] != list(shape):
            offset = _PAGE + slot * self.slot_bytes
            tensor = torch.frombuffer(self.buffer, dtype=dtype, count=numel, offset=offset).view(shape)
            view = self._views[slot] = (dtype, list(shape), tensor)
        return view[2]


def _open_cuda_ring(ring: sampler_pb2.CudaIpcRing, nbytes: int, device: torch.device) -> torch.Tensor:
    """The engine's device ring, opened with CUDA IPC: only on the same GPU (by UUID) as this sampler's device."""
    if device.type != "cuda":
        raise ValueError("the logits are on the engine's GPU and this sampler runs on the CPU")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _device_uuid(index) != ring.device_uuid:
        raise ValueError("the logits are on another GPU than this sampler's")
    if ring.storage_size_bytes < nbytes:
        raise ValueError(f"cuda.storage_size_bytes is {ring.storage_size_bytes}; the slots need {nbytes}")
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(
        torch.Tensor, (nbytes,), (1,), 0, torch.storage.TypedStorage, torch.uint8, index,
        ring.handle, ring.storage_size_bytes, ring.storage_offset_bytes, False,
        ring.ref_counter_handle, ring.ref_counter_offset, ring.event_handle or None, ring.event_sync_required,
    )  # fmt: skip


def _device_uuid(device) -> bytes:
    """The GPU's UUID: the same GPU under any device index (CUDA_VISIBLE_DEVICES differs between processes)."""
    return bytes(torch.cuda.get_device_properties(device).uuid.bytes)  # a list of ints in some torch versions
