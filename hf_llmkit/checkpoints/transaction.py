"""One `checkpoint-N` write as one transaction: begin -> every contributor writes its part -> complete -> rotate.

Whichever Trainer saves (`transformers.Trainer`, TRL's `SFTTrainer`, `LLMKitTrainer`), a checkpoint is written by
one `CheckpointTransaction`:

1. **begin** (`begin_save`, every rank together, before the first byte): a step whose checkpoint already loads is
   not written again (the transaction is `skipped`); a leftover folder is cleared; every rank creates the writing
   marker. The parties that take part join it: the `CheckpointGuard` (`FaultToleranceCallback`) when the Trainer is
   about to save, `LLMKitTrainer`'s writer in its `_save_checkpoint`; the second to arrive joins the open one.
2. **parts**: the Trainer writes its files (model, optimizer, scheduler, RNG, state); every `PartWriter` attached
   to the output folder (`SavePeftModelCallback`: the adapter) writes its part when the transaction asks, never on
   its own. Every part is a registered `Contributor` (`register_contributor`: its name, the files it owns and the
   module that writes them); a write through `part(name)` into a transaction that is not open raises
   `CheckpointClosedError`.
3. **complete** (`finish`): once every party that joined has finished, the part writers write (every rank), then
   the main process makes the folder complete (the manifest, written last and atomically, or without a guard only
   the marker removed) and applies `save_total_limit` (`hf_llmkit.checkpoints.lifecycle`). Nothing is written into
   the folder afterwards. A guard that refuses the save (non-finite weights) `abandon`s it: the folder goes.

    txn = begin_save(folder, participant="trainer", main=True)   # or joins the guard's open transaction
    with txn.part("run identity"):
        write_run_identity(identity, folder)
    txn.finish("trainer", output_dir=out, save_total_limit=2)    # the last party to finish completes it
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

import torch

from hf_llmkit.checkpoints.collectives import barrier
from hf_llmkit.checkpoints.housekeeping import remove_checkpoint
from hf_llmkit.checkpoints.lifecycle import ManifestSettings, begin_checkpoint, complete_checkpoint
from hf_llmkit.checkpoints.manifest import payload_files
from hf_llmkit.checkpoints.names import TRAINER_FILE_PATTERNS

__all__ = [
    "GUARD",
    "WRITER",
    "CheckpointClosedError",
    "CheckpointTransaction",
    "Contributor",
    "PartWriter",
    "attach_writer",
    "begin_save",
    "close_run",
    "contributors",
    "detach_writer",
    "owns",
    "register_contributor",
    "transaction_of",
]


GUARD = "guard"  # the `CheckpointGuard`'s name among a transaction's participants
WRITER = "trainer"  # `LLMKitTrainer`'s writer (the Trainer's files and the run record)


class CheckpointClosedError(RuntimeError):
    """A write into a checkpoint whose transaction is not open (complete, skipped or abandoned)."""


@dataclass(frozen=True)
class Contributor:
    """One part of a checkpoint: `files` are the `fnmatch` patterns (paths relative to `checkpoint-N`, POSIX) of
    what it writes, `writer` the module that writes them, `via` another contributor whose files hold this part
    (DKM's training state lives in the model's weights file)."""

    name: str
    files: tuple[str, ...]
    writer: str
    via: str | None = None


_CONTRIBUTORS: dict[str, Contributor] = {}
_HOST = "transformers.Trainer._save_checkpoint"


def register_contributor(name: str, *, files: Iterable[str], writer: str, via: str | None = None) -> Contributor:
    """Declare a part of every checkpoint (idempotent; a second, different declaration of `name` is refused)."""
    contributor = Contributor(name, tuple(files), writer, via)
    known = _CONTRIBUTORS.setdefault(name, contributor)
    if known != contributor:
        raise ValueError(f"checkpoint contributor {name!r} is already registered by {known.writer}; pick another name")
    return contributor


def contributors() -> tuple[Contributor, ...]:
    """Every registered contributor, in registration order."""
    return tuple(_CONTRIBUTORS.values())


def owns(name: str, relative: str) -> bool:
    """Whether the registered contributor `name` declares the file `relative` (a path inside `checkpoint-N`)."""
    contributor = _CONTRIBUTORS.get(name)
    return contributor is not None and any(fnmatch(relative, pattern) for pattern in contributor.files)


class PartWriter:
    """A callback that writes a part of every checkpoint when the transaction asks (`attach_writer` it to the output
    folder at `on_train_begin`; `write_checkpoint_part` runs on every rank, before the checkpoint is complete)."""

    checkpoint_part: str = ""

    def write_checkpoint_part(self, transaction: CheckpointTransaction, *, model=None, processing_class=None) -> None:
        raise NotImplementedError  # pragma: no cover - overridden


_WRITERS: dict[str, list[PartWriter]] = {}
_TRANSACTIONS: dict[str, CheckpointTransaction] = {}


def _key(path: str | os.PathLike) -> str:
    return os.path.realpath(path)


def attach_writer(output_dir: str | os.PathLike, writer: PartWriter) -> None:
    """Make `writer` write its part of every checkpoint of `output_dir` begun from now on (idempotent)."""
    if writer.checkpoint_part not in _CONTRIBUTORS:
        raise ValueError(f"{type(writer).__name__} writes the unregistered part {writer.checkpoint_part!r}")
    writers = _WRITERS.setdefault(_key(output_dir), [])
    if writer not in writers:
        writers.append(writer)


def detach_writer(output_dir: str | os.PathLike, writer: PartWriter) -> None:
    writers = _WRITERS.get(_key(output_dir), [])
    if writer in writers:
        writers.remove(writer)


def transaction_of(folder: str | os.PathLike) -> CheckpointTransaction | None:
    """The transaction this process ran or runs on `folder` (None: none since `forget_transactions`)."""
    return _TRANSACTIONS.get(_key(folder))


def close_run(output_dir: str | os.PathLike) -> None:
    """A run into `output_dir` ended (also by an exception): its part writers are detached and this process's
    records of its checkpoints dropped (one left open is abandoned; the next run's resume tidies its folder)."""
    root = _key(output_dir)
    _WRITERS.pop(root, None)
    for key in [k for k in _TRANSACTIONS if os.path.dirname(k) == root]:
        txn = _TRANSACTIONS.pop(key)
        if txn.is_open:
            txn.state = "abandoned"


class CheckpointTransaction:
    """The write of one `checkpoint-N` folder (see the module docstring); `state` is `open`, `complete`,
    `skipped` (it already loaded) or `abandoned`."""

    def __init__(self, folder: str | os.PathLike, *, main: bool, device: torch.device | str, state: str = "open"):
        self.folder, self.main, self.device, self.state = Path(folder), main, device, state
        self.joined: list[str] = []
        self.finished: set[str] = set()
        self.written: dict[str, str] = {}  # file (relative POSIX path) -> the part that wrote or changed it
        self.writers = list(_WRITERS.get(_key(self.folder.parent), ()))
        self.manifest: ManifestSettings | None = None  # set by a guard's `finish`; None: marker removed only
        self.extra: dict | None = None

    @property
    def is_open(self) -> bool:
        return self.state == "open"

    def join(self, participant: str) -> None:
        """`participant` takes part: the transaction completes once it (and every other) has finished."""
        self._check_open(participant)
        if participant not in self.joined:
            self.joined.append(participant)

    def _check_open(self, who: str) -> None:
        if not self.is_open:
            raise CheckpointClosedError(f"{who} cannot write into {self.folder}: its checkpoint is {self.state}")

    @contextmanager
    def part(self, name: str) -> Iterator[Path]:
        """Write the registered part `name` into the folder (yielded); raises `CheckpointClosedError` unless open."""
        if name not in _CONTRIBUTORS:
            raise ValueError(f"{name!r} is no registered checkpoint contributor; call register_contributor first")
        self._check_open(name)
        before = self._files()
        yield self.folder
        self._check_open(name)  # completed or abandoned while the part was written
        after = self._files()
        self.written.update({path: name for path, stamp in after.items() if before.get(path) != stamp})

    def _files(self) -> dict[str, tuple[int, int]]:
        """Each payload file of the folder with its (mtime, size): what a part wrote is what changed."""
        found = {}
        for path in payload_files(self.folder) if self.folder.is_dir() else ():
            try:
                stat = path.stat()
            except OSError:  # gone meanwhile
                continue
            found[path.relative_to(self.folder).as_posix()] = (stat.st_mtime_ns, stat.st_size)
        return found

    def finish(
        self,
        participant: str,
        *,
        output_dir: str | os.PathLike,
        save_total_limit: int | None,
        keep: Iterable[str | os.PathLike | None] = (),
        manifest: ManifestSettings | None = None,
        extra: dict | None = None,
        model=None,
        processing_class=None,
    ) -> bool:
        """`participant` has written its part (every rank calls it); the last to finish completes the checkpoint
        (part writers, then the manifest with `manifest`'s settings, or without one only the marker removed, then
        rotation). True once the checkpoint is complete."""
        self._check_open(participant)
        self.finished.add(participant)
        self.manifest, self.extra = manifest or self.manifest, extra or self.extra
        if not self.finished.issuperset(self.joined):
            return False
        for writer in self.writers:  # every rank: a part may need collectives (ZeRO-3 gathers)
            writer.write_checkpoint_part(self, model=model, processing_class=processing_class)
        barrier()  # every rank's files are on disk
        if self.main:
            complete_checkpoint(
                self.folder,
                output_dir=output_dir,
                save_total_limit=save_total_limit,
                keep=keep,
                manifest=self.manifest,
                extra=self.extra,
            )
        self.state = "complete"
        return True

    def abandon(self) -> None:
        """The save is refused (every rank calls it): the folder, ours and never completed, is removed."""
        self.state = "abandoned"
        barrier()
        if self.main:
            remove_checkpoint(self.folder)


def begin_save(
    folder: str | os.PathLike,
    *,
    participant: str,
    main: bool,
    device: torch.device | str = "cpu",
    marked: bool = True,
) -> CheckpointTransaction:
    """Every rank together, before the first byte of `folder`: join its open transaction, or begin one (the
    folder cleared and marked: `hf_llmkit.checkpoints.lifecycle.begin_checkpoint`). A step whose checkpoint
    already loads gives a `skipped` transaction. `marked=False`: the files are already written (a save nobody
    announced: the guard completes it as it is)."""
    key = _key(folder)
    txn = _TRANSACTIONS.get(key)
    if txn is None or not txn.is_open or participant in txn.joined:
        if marked and not begin_checkpoint(folder, main=main, device=device):
            txn = CheckpointTransaction(folder, main=main, device=device, state="skipped")
        else:
            txn = CheckpointTransaction(folder, main=main, device=device)
        _TRANSACTIONS[key] = txn
    if txn.is_open:
        txn.join(participant)
    return txn


# The host Trainer's own part: `_save_checkpoint` (LLMKitTrainer's writer wraps it in `part(WRITER)`; under another
# Trainer it runs between the guard's begin and its on_save).
register_contributor(WRITER, files=TRAINER_FILE_PATTERNS, writer=_HOST)
