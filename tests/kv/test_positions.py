"""The HCA cache's position schemes (minirun/kv/positions.py): the plain one gives back what it
is given and does nothing on a GPU step; position_scheme picks far positions where they are on."""
import numpy as np
import torch

from minirun.config import EngineConfig
from minirun.kv.far_positions import FarFrame, position_scheme
from minirun.kv.positions import PlainPositions

ARGS = type("A", (), {"rope_theta": 10000.0, "head_dim": 8, "rope_scaling": None, "max_position_embeddings": 64})()


def test_plain_positions_are_identities():
    p = PlainPositions()
    qs, K = torch.randn(3, 4, 8), torch.randn(2, 2, 5, 8)
    EK = np.random.default_rng(0).random((2, 6, 8), dtype=np.float32)
    codes = torch.zeros(2, 2, 5, 3, dtype=torch.uint8)
    assert not p.far and not p.unrotated and p.signature() is None and not list(p.notices())
    assert p.queries(qs, 10) is qs
    assert p.sink_keys(K, torch.arange(5), 4) is K
    K2, codes2 = p.leaving_ring(K, 7, codes)
    assert K2 is K and codes2 is codes
    q1, kn, EK1 = p.step_inputs(qs[:1], K[0, :, :1].transpose(0, 1), EK, 2, 9)
    assert torch.equal(torch.from_numpy(q1), qs[0]) and torch.equal(torch.from_numpy(kn), K[0, :, 0]) and EK1 is EK
    q2, tiers = p.chunk_inputs(qs, EK, 2, 5)
    tiers = list(tiers)
    assert q2 is qs and len(tiers) == 3 and all(t is EK for t in tiers)
    cs = torch.zeros(8)
    p.on_device(torch.device("cpu"))
    p.upload_turn(cs, 3, False)
    p.forget_upload()
    p.captured_turn(cs, torch.tensor([3]))
    assert not cs.any() and p.keys_leaving_at(K, torch.tensor([7])) is K


def test_position_scheme_follows_the_setting():
    on = position_scheme(ARGS, EngineConfig(far_positions="on", window=16), 128)
    assert isinstance(on, FarFrame) and on.far and on.unrotated and on.signature() == [on.distance, 0]
    grouped = position_scheme(ARGS, EngineConfig(far_positions="grouped", window=16), 128)
    assert grouped.far and not grouped.unrotated and grouped.group > 0
    assert type(position_scheme(ARGS, EngineConfig(far_positions="off", window=16), 128)) is PlainPositions
    assert type(position_scheme(ARGS, EngineConfig(far_positions="auto", window=16), 64)) is PlainPositions
    assert position_scheme(ARGS, EngineConfig(far_positions="auto", window=16), 65).far


def test_far_upload_turn_writes_once_per_position():
    far = FarFrame(ARGS, 32, 0, 16)
    cs = torch.zeros(8)
    far.upload_turn(cs, 40, False)
    c, s = far.angles(40)
    assert torch.equal(cs, torch.cat([c, s]))
    cs.zero_()
    far.upload_turn(cs, 40, False)     # (the same position: the device's copy is kept)
    assert not cs.any()
    far.forget_upload()
    far.upload_turn(cs, 40, False)
    assert torch.equal(cs, torch.cat([c, s]))
