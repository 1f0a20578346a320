"""Loading a resharding checkpoint into a :class:`dtlab.train.Trainer` of any layout.

Taught in chapter 13 (:mod:`dtlab.reshard`). :func:`load` is DCP's load: each rank
*plans* from the metadata alone (for every tensor it steps, which saved pieces
overlap its own piece, and where: :func:`~dtlab.reshard.pieces.overlaps`), checks
that the plan covers every element and that the files exist, and only then *reads*
the overlapping bytes and writes them into its fp32 masters and its optimizer state.
The weights the model computes with follow: a 16-bit replica copies its masters
down, ZeRO stages 1-2 all-gather the full weights (stage 3 gathers before every use
anyway). No rank reads a piece it does not need, and no tensor crosses ranks.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass

import torch

from dtlab.reshard.format import PieceReader, random_file, read_metadata
from dtlab.reshard.holdings import holdings
from dtlab.reshard.pieces import Piece, overlaps
from dtlab.reshard.save import layout_sizes

__all__ = ["load", "LoadReport", "RandomStateNotCarried"]

# what may change on a load without being reported: how the state is laid out and
# computed with, how long to train; the model is checked on its own
_LAYOUT_FIELDS = ("layout", "strategy", "precision", "steps", "model")


class RandomStateNotCarried(UserWarning):
    """Dropout is on and the checkpoint was saved at another layout: its random
    state belonged to the old ranks, so the masks from here on differ from those
    of the run that never stopped."""


@dataclass(frozen=True)
class LoadReport:
    """What :func:`load` did on this rank.

    ``step``: the step the run continues at; ``saved_at``: the world size, layout,
    strategy and precision it was saved at; ``resharded``: whether the layout
    changed; ``optimizer``: whether the optimizer state was loaded; ``random_state``:
    ``"restored"`` (same layout) or ``"fresh"`` (this trainer's own seeding);
    ``scaler``: ``"restored"``, ``"fresh"`` or ``"none"`` (no fp16 here);
    ``bytes_read`` and ``files_read``: what this rank read; ``config_changes``:
    the config fields (besides layout, strategy, precision and steps) that differ
    from the saved run's; ``notes``: sentences on what did not carry over."""

    step: int
    saved_at: dict
    resharded: bool
    optimizer: bool
    random_state: str
    scaler: str
    bytes_read: int
    files_read: tuple[str, ...]
    config_changes: tuple[str, ...]
    notes: tuple[str, ...]


def _check_model(meta, trainer) -> None:
    """The same tensors, or a ValueError naming the fields that differ (dropout
    changes no tensor, so it may change)."""
    mine = dataclasses.asdict(trainer.config.model)
    theirs = meta["model"]
    changed = [k for k in mine if k != "dropout" and theirs.get(k) != mine[k]]
    if changed:
        told = ", ".join(
            f"{k}={theirs.get(k)!r} there, {mine[k]!r} here" for k in changed
        )
        raise ValueError(
            f"the checkpoint holds another model ({told}): build the trainer with "
            "the checkpoint's model, GPTConfig(**read_metadata(path)['model'])"
        )


def _plan(meta, hold, reader) -> list:
    """For each holding, ``(holding, entry, [(saved piece, segments)])``; raises
    before anything is read if a tensor is missing, a shape differs, the pieces do
    not cover it exactly, or a file is missing."""
    plan = []
    for h in hold:
        entry = meta["tensors"].get(h.name)
        if entry is None:
            raise ValueError(f"the checkpoint holds no tensor {h.name!r}")
        if tuple(entry["shape"]) != h.piece.shape:
            raise ValueError(
                f"{h.name} is {tuple(entry['shape'])} in the checkpoint and "
                f"{h.piece.shape} here"
            )
        keys = set(entry["pieces"][0]["data"])
        reads, covered = [], 0
        for saved in entry["pieces"]:
            if set(saved["data"]) != keys:
                raise ValueError(
                    f"the pieces of {h.name} disagree on what was saved for them "
                    f"({sorted(keys)}, {sorted(saved['data'])}): two runs wrote "
                    "into one folder?"
                )
            segments = overlaps(h.piece, Piece.from_dict(entry["shape"], saved))
            if segments:
                reader.check(saved, h.name)
                reads.append((saved, segments))
                covered += sum(n for _, _, n in segments)
        if covered != h.piece.numel:
            raise ValueError(
                f"the saved pieces of {h.name} hold {covered} of the {h.piece.numel} "
                f"elements this rank needs: the checkpoint is incomplete"
            )
        plan.append((h, entry, reads))
    return plan


def _scalars(name, entry, reads) -> dict:
    """The per-tensor numbers (Adam's step), the same in every piece."""
    found = [saved["scalars"] for saved, _ in reads] or [entry["pieces"][0]["scalars"]]
    if any(s != found[0] for s in found):
        raise ValueError(f"the pieces of {name} disagree on {found}")
    out = {}
    for key, (value, dtype) in found[0].items():
        out[key] = torch.tensor(value, dtype=getattr(torch, dtype)) if dtype else value
    return out


@torch.no_grad()
def _read_into(plan, reader, inner, with_optimizer: bool) -> None:
    for h, entry, reads in plan:
        keys = list(entry["pieces"][0]["data"])
        keys = keys if with_optimizer else ["weight"]
        flat = {}
        for key in keys:
            dtype = getattr(torch, entry["pieces"][0]["data"][key][1])
            flat[key] = torch.zeros(h.master.numel(), dtype=dtype)  # padding: 0
            for saved, segments in reads:
                reader.copy(saved, key, segments, flat[key])
        h.master.view(-1).copy_(flat.pop("weight"))
        if with_optimizer and flat:  # a tensor that never stepped has no state
            state = {
                k: v.view_as(h.master).to(h.master.device) for k, v in flat.items()
            }
            state.update(_scalars(h.name, entry, reads))
            inner.state[h.master] = state
        else:
            inner.state.pop(h.master, None)


def _weights_follow(trainer) -> None:
    """The weights the model computes with follow the loaded masters."""
    parts, opt = trainer.parts, trainer.optimizer
    if parts.zero_stage is not None:
        for wrapper in parts.wrapped:  # stages 1-2 gather; 3 gathers at each use
            wrapper.sync_params()
    elif opt.policy.has_master_copy:
        with torch.no_grad():
            for p, m in zip(opt.params, opt.masters):
                p.copy_(m)  # rounded to the compute dtype, as after a step


def _random_state(path, meta, trainer, same_layout: bool) -> tuple[str, list]:
    """Restore this rank's random state at the layout it was saved at; elsewhere
    keep the trainer's own seeding and say what that means."""
    if same_layout:
        rank = trainer.topo.rank
        file = os.path.join(path, random_file(rank))
        if not os.path.exists(file):
            raise ValueError(
                f"{random_file(rank)} is missing from {path}: at the layout it was "
                "saved at each rank restores its own random state"
            )
        saved = torch.load(file, weights_only=True)
        if saved["coords"] != trainer.topo.coords:
            raise ValueError(
                f"rank {rank}'s random state was saved at {saved['coords']}, this "
                f"rank is at {trainer.topo.coords}"
            )
        trainer.set_random_state(saved["state"])
        return "restored", []
    notes = [
        f"the random state belonged to the ranks of layout "
        f"{meta['saved_at']['layout']}; this trainer keeps its own seeding"
    ]
    dropout = trainer.config.model.dropout
    if dropout > 0:
        text = (
            f"dropout={dropout}: the dropout masks from step {meta['step']} on differ "
            "from those of the run that never stopped (the losses will too)"
        )
        notes.append(text)
        warnings.warn(text, RandomStateNotCarried, stacklevel=3)
    return "fresh", notes


def load(path, trainer, *, optimizer: bool = True) -> LoadReport:
    """Load the checkpoint at ``path`` into ``trainer``, whatever layout and strategy
    either has (dp, tp, pp; DDP or ZeRO 1-3; fp32, bf16 or fp16). Every rank calls
    it. ``optimizer=False`` loads the weights only (the optimizer starts afresh).

    The checkpoint holds the fp32 masters, so a 16-bit run loads into an fp32
    trainer and the reverse (the weights the model computes with are then the
    masters rounded, as after any step). fp16's loss scale is carried from an fp16
    run to an fp16 run only; the random state at the same layout only."""
    path = os.fspath(path)
    meta = read_metadata(path)
    _check_model(meta, trainer)
    here = layout_sizes(trainer.topo.layout)
    same_layout = meta["saved_at"]["layout"] == here
    inner = trainer.optimizer.optimizer
    with PieceReader(path) as reader:
        plan = _plan(meta, holdings(trainer), reader)
        _read_into(plan, reader, inner, optimizer)
        bytes_read, files = reader.bytes_read, tuple(sorted(reader.files))
    _weights_follow(trainer)
    notes = []
    precision, was = trainer.config.precision, meta["saved_at"]["precision"]
    if precision == "fp16" and was == "fp16":
        trainer.optimizer.scaler.load_state_dict(meta["scaler"])
        scaler = "restored"
    else:
        scaler = "fresh" if precision == "fp16" else "none"
        if precision != was:
            notes.append(
                f"saved in {was}, loaded in {precision}: the fp32 masters carry over; "
                "the weights computed with are them in this precision"
            )
    rng, more = _random_state(path, meta, trainer, same_layout)
    notes += more
    if not optimizer:
        notes.append("weights only: the optimizer state starts afresh")
    trainer.step = int(meta["step"])
    trainer.records = []
    mine, theirs = trainer.config.to_dict(), meta["config"]
    changes = tuple(
        k for k in mine if k not in _LAYOUT_FIELDS and theirs.get(k) != mine[k]
    )
    return LoadReport(
        step=trainer.step,
        saved_at=meta["saved_at"],
        resharded=not same_layout,
        optimizer=optimizer,
        random_state=rng,
        scaler=scaler,
        bytes_read=bytes_read,
        files_read=files,
        config_changes=changes,
        notes=tuple(notes),
    )
