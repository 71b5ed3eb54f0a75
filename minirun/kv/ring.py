"""The exact tier's slots: sinks [0, S) and a ring of the last W tokens, and which position each
slot holds. The ring slot of position p >= S is S + (p - S) % W; `slot_pos` is -1 for an empty
slot. After a truncate the ring holds fewer than W tokens until it refills, and the dropped
tokens' slots keep stale K/V: the decode steps then read a mask of the live slots."""
from __future__ import annotations

import numpy as np
import torch


class Ring:
    def __init__(self, sinks: int, window: int):
        self.S, self.W = sinks, window
        self.slot_pos = torch.full((sinks + window,), -1, dtype=torch.long)   # [S + W]
        self._live = None   # uint8 [S + W] mask of the live slots while the ring is short, made once

    def slot(self, pos):
        """The ring slot of the token at pos >= S (an int, or an int64 tensor of positions)."""
        return self.S + (pos - self.S) % self.W

    def full(self, offset: int, n_store: int) -> bool:
        """The ring holds W tokens (every position from S + n_store up to offset): the next token
        in pushes the oldest out to the store."""
        return offset == self.S + self.W + n_store

    def live_mask(self, offset: int, n_store: int) -> np.ndarray | None:
        """None while the ring is full (every slot live), else the uint8 mask of the live slots."""
        if self.full(offset, n_store):
            return None
        if self._live is None:
            self._live = (self.slot_pos >= 0).numpy().astype(np.uint8)
        return self._live

    def entered(self, pos: int, slot: int, evicted: bool) -> None:
        """A decode step's token at pos took `slot`, pushing its old token out (evicted) or taking a
        dead slot of a short ring: the mask stays valid with one more live slot."""
        self.slot_pos[slot] = pos
        if evicted:
            self._live = None
        elif self._live is not None:
            self._live[slot] = 1

    def changed(self) -> None:
        """slot_pos was written in bulk (a chunk, a truncate, a restore): the mask is made again."""
        self._live = None

    def drop_from(self, n: int) -> None:
        """Empty the slots of positions >= n (a truncate)."""
        self.slot_pos[self.slot_pos >= n] = -1
        self._live = None

    def clear(self) -> None:
        self.slot_pos.fill_(-1)
        self._live = None
