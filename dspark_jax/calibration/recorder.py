"""STS data recorder: raw confidence logits and realised acceptance, sharded to .npz files.

Each shard holds ``logits`` [n, gamma] (raw z, identity temperatures) and
``num_accepted_drafts`` [n] (drafts full-block verification accepted), the keys
training/calibrate_sts.py reads, plus ``final_round`` [n] (the request finished in this round: EOS,
a stop or the length limit; blocks that run past an EOS hold positions the drafter never trained
on) and ``group_names`` [g] / ``group_ids`` [n] (the group, e.g. the workload, each row was
recorded under: ``set_group``, "" when never set).  Both let calibration be broken down: one
temperature per position cannot remove a bias that differs between groups, and the breakdown
shows whether that is what is left.  Shards are written whole (temp file + rename), so an
interrupted run leaves only complete shards.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


class StsRecorder:
    def __init__(self, out_dir: str | Path, block_size: int, shard_rows: int = 4096):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.block_size = block_size
        self.shard_rows = shard_rows
        self._logits: list[np.ndarray] = []
        self._accepted: list[np.ndarray] = []
        self._groups: list[np.ndarray] = []
        self._final: list[np.ndarray] = []
        self._group_names: list[str] = [""]
        self._group = 0
        self._rows = 0
        self._next = len(list(self.out_dir.glob("sts-*.npz")))

    def set_group(self, name: str) -> None:
        """Tag the rows added from now on with ``name`` (e.g. the workload being evaluated)."""
        if name not in self._group_names:
            self._group_names.append(name)
        self._group = self._group_names.index(name)

    def add(self, logits, num_accepted, final_round=None) -> None:
        logits = np.asarray(logits, np.float32).reshape(-1, self.block_size)
        self._logits.append(logits)
        self._final.append(np.zeros(len(logits), bool) if final_round is None
                           else np.asarray(final_round, bool).reshape(-1))
        self._accepted.append(np.asarray(num_accepted, np.int32).reshape(-1))
        self._groups.append(np.full(len(logits), self._group, np.int16))
        self._rows += len(logits)
        if self._rows >= self.shard_rows:
            self.flush()

    def flush(self) -> Path | None:
        if not self._rows:
            return None
        path = self.out_dir / f"sts-{self._next:05d}.npz"
        tmp = path.with_suffix(".tmp.npz")
        np.savez_compressed(tmp, logits=np.concatenate(self._logits), num_accepted_drafts=np.concatenate(self._accepted),
                            group_ids=np.concatenate(self._groups), group_names=np.asarray(self._group_names),
                            final_round=np.concatenate(self._final))
        os.replace(tmp, path)
        self._next += 1
        self._logits, self._accepted, self._groups, self._final, self._rows = [], [], [], [], 0
        return path
