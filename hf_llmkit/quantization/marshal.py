"""eDKM cross-device tensor marshaling: saved-for-backward tensors stored once per storage, offloaded to CPU.

Autograd saves many views of one tensor (a softmax output, its transpose, a reshape...). Moving each saved
tensor to the CPU separately copies the same storage several times (the eDKM paper's Table 1). `MarshalHooks`
is a `torch.autograd.graph.saved_tensors_hooks` context that keeps one record per storage and rebuilds views
from it: on an accelerator the storage is copied to CPU once and copied back once in backward; on the CPU no
copy is made, and the same bookkeeping measures what is saved (`requested_bytes` per saved tensor versus
`stored_bytes` per storage).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch


@dataclass
class MarshalStats:
    """Byte counts of one `MarshalHooks` context (parameters and excluded tensors are not counted)."""

    saved_tensors: int = 0
    requested_bytes: int = 0  # what per-tensor offloading would copy: every saved tensor separately
    stored_bytes: int = 0  # what marshaling holds: each storage (or small view) once
    offloaded_bytes: int = 0  # the part of stored_bytes moved off the accelerator
    storages: int = 0
    skipped_bytes: int = field(default=0)  # parameters / excluded tensors, kept where they are


class _Record:
    """One stored storage: the CPU copy (or the original on CPU) and, during backward, the restored copy."""

    __slots__ = ("base", "device", "restored", "source", "__weakref__")

    def __init__(self, base: torch.Tensor, device: torch.device, source: torch.Tensor):
        self.base, self.device, self.restored = base, device, None
        self.source = weakref.ref(source)


class MarshalHooks:
    """Saved-tensor hooks that dedupe storages and offload them from accelerators (`with MarshalHooks(): ...`).

    Args:
        offload: move saved accelerator tensors to CPU (ignored for CPU tensors).
        exclude: tensors whose storages are left alone and not counted (e.g. a layer's input).
    """

    def __init__(self, offload: bool = True, exclude: tuple[torch.Tensor, ...] = ()):
        self.offload = offload
        self.stats = MarshalStats()
        self._records: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> MarshalHooks:
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)

    def _pack(self, t: torch.Tensor):
        if not isinstance(t, torch.Tensor) or t.is_sparse or t.device.type == "meta":
            return ("raw", t)
        storage = t.untyped_storage()
        view_bytes = t.nelement() * t.element_size()
        if isinstance(t, torch.nn.Parameter) or storage.data_ptr() in self._excluded or storage.nbytes() == 0:
            self.stats.skipped_bytes += view_bytes
            return ("raw", t)
        self.stats.saved_tensors += 1
        self.stats.requested_bytes += view_bytes
        small_view = view_bytes * 2 < storage.nbytes()
        key = (storage.data_ptr(), t.device, small_view and (t.storage_offset(), tuple(t.shape), t.stride()))
        record = self._records.get(key)
        if record is None or record.source() is None:
            move = self.offload and t.device.type != "cpu"
            if small_view:  # a small slice of a big storage: keep just the slice, not the whole storage
                base = t.detach().to("cpu", copy=True) if move else t.detach().clone()
                meta = None
            else:
                raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
                base = raw.to("cpu", copy=True) if move else raw
                meta = True
            record = _Record(base, t.device, t)
            record_bytes = base.nelement() * base.element_size()
            self.stats.storages += 1
            self.stats.stored_bytes += record_bytes
            self.stats.offloaded_bytes += record_bytes if move else 0
            self._records[key] = record
            del meta
        layout = None if small_view else (t.dtype, tuple(t.shape), t.stride(), t.storage_offset())
        return ("marshal", record, layout)

    @staticmethod
    def _unpack(packed):
        if packed[0] == "raw":
            return packed[1]
        _, record, layout = packed
        if record.restored is None:
            record.restored = record.base.to(record.device) if record.base.device != record.device else record.base
        if layout is None:
            return record.restored
        dtype, shape, stride, offset = layout
        typed = torch.empty(0, dtype=dtype, device=record.device).set_(record.restored.untyped_storage())
        return typed.as_strided(shape, stride, offset)
