"""A rewind point for the HCA cache past its ring: a copy of the sinks + ring and the store's length.

Why: the HCA cache can only truncate while the dropped tokens are all in the ring (W tokens), since
older tokens leave it for the key store as codes. A server whose requests share a long document but
not their questions and answers needs more: after doc + question 1 + a 300-token answer, the next
request (doc + question 2) must go back to the end of the document, which left the ring long ago.

How: `HCACache.checkpoint(name)` copies the exact tier (sinks + ring, [L, Hkv, S + W, hd] keys and
values: 12 MB for SmolLM2 in float32) and the store's counters. The store only appends, so its
first n_store rows stay as they were; truncating back to any position p the ring held then
(S + n_store <= p <= offset at the copy) restores the copied tier, sets the store's length back
and drops the ring tokens from p on. No store rows are copied. The engine keeps two copies: at the
end of each prompt ("prompt": the next question, up to W tokens long, comes back to the document
through it) and where a prompt left the cached tokens ("shared": the document's end, for longer
questions).

Validity: a position p of the copy is still the cache's own token while nothing since has rewritten
it. Tokens are only rewritten after a truncate below them, so every truncate lowers `valid_to`, the
end of what the copy may restore; reset drops the copy; new codebooks (fitted after the copy: the
store rows were re-encoded and their full-precision keys dropped) make it unusable.
"""
from __future__ import annotations

import torch


class RingCheckpoint:
    """The copy of one HCA cache's exact tier at its last checkpoint, and its counters."""

    def __init__(self, name: str):
        self.name = name                            # its buffers in the cache's tier "sinks+ring copies"
        self.ek = self.ev = self.slot_pos = None   # copies of the cache's ek, ev [L, Hkv, S+W, hd], slot_pos [S+W]
        self.counters = None                        # (offset, n_store, n_encoded, exact_base) at the copy
        self.codebooks = None                       # the codebooks the store's codes were made with then
        self.valid_to = -1                          # the copy may restore positions < valid_to + 1; -1: none

    def take(self, cache) -> None:
        """Copy `cache`'s exact tier and counters (buffers allocated on the first call as the cache's
        tiers declare them, then reused)."""
        if self.ek is None:
            spec = cache.tiers["sinks+ring copies"].buffers
            self.ek, self.ev = (spec[f"{self.name}.{t}"].zeros(cache.ek.device) for t in ("ek", "ev"))
            self.slot_pos = torch.empty_like(cache.slot_pos)
        self.ek.copy_(cache.ek)
        self.ev.copy_(cache.ev)
        self.slot_pos.copy_(cache.slot_pos)
        self.counters = (cache.offset, cache.n_store, cache.n_encoded, cache.exact_base)
        self.codebooks = cache.codebooks
        self.valid_to = cache.offset

    def can_restore(self, cache, n: int) -> bool:
        """Whether position n is one the copy's ring held and nothing has rewritten since."""
        if self.valid_to < 0:
            return False
        _, n_store, _, exact_base = self.counters
        return (cache.S + n_store <= n <= self.valid_to and cache.codebooks is self.codebooks
                and cache.exact_base == exact_base)

    def restore(self, cache) -> None:
        """Put the copy back: exact tier, slot positions and counters (the caller then drops from n on)."""
        cache.ek.copy_(self.ek)
        cache.ev.copy_(self.ev)
        cache.slot_pos.copy_(self.slot_pos)
        cache.offset, cache.n_store, cache.n_encoded, cache.exact_base = self.counters

    def truncated(self, n: int) -> None:
        """The cache dropped its tokens from n on (n = -1: reset): later ones there are not the copy's."""
        self.valid_to = min(self.valid_to, n)

    @property
    def nbytes(self) -> int:
        return 0 if self.ek is None else 2 * self.ek.numel() * self.ek.element_size()


class RewindPoints:
    """An HCA cache's named copies ("prompt", "shared": Engine.prefill names them)."""

    def __init__(self):
        self.copies = {name: RingCheckpoint(name) for name in ("prompt", "shared")}

    def restore(self, cache, n: int) -> bool:
        """Put back a copy whose ring held position n (the caller then drops from n on); False: none."""
        copy = next((c for c in self.copies.values() if c.can_restore(cache, n)), None)
        if copy is not None:
            copy.restore(cache)
        return copy is not None

    def truncated(self, n: int) -> None:
        for c in self.copies.values():
            c.truncated(n)

    def drop(self) -> None:
        self.truncated(-1)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.copies.values())
