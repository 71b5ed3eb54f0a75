"""The HCA cache's rescoring step (minirun/kv/rescore.py): without rescoring it keeps nothing and
leaves the scores as they are; with it the store's keys go to the host pool as they leave the ring."""
import numpy as np
import torch

from minirun.kv.rescore import HostKeyRescore, NoRescore
from minirun.kv.store import GrowingBuffer


def test_no_rescore_leaves_the_scores():
    r = NoRescore()
    z = np.arange(6, dtype=np.float32).reshape(2, 3)
    r.keys_left_ring(0, torch.randn(1, 1, 3, 4))
    r.hold_query(torch.randn(2, 4), False)
    r.rescore(0, np.zeros((2, 3), np.int32), np.array([3, 3]), np.zeros(2, np.int32), z)
    r.wait()
    assert not r.on and r.keys is None and np.array_equal(z, np.arange(6, dtype=np.float32).reshape(2, 3))


def test_host_key_rescore_keeps_the_keys_and_scores_exactly():
    keys = GrowingBuffer((1, 1), 4, torch.float32, 8)     # [L, Hkv, cap, hd]
    r = HostKeyRescore(keys)
    K = torch.randn(1, 1, 3, 4)
    r.keys_left_ring(0, K)
    assert r.on and torch.equal(keys.view(0, 3), K[0])
    q = torch.randn(2, 4)
    r.hold_query(q, False)
    idx, counts = np.array([[2, 0, 1], [1, 0, 0]], np.int32), np.array([3, 1], np.int32)
    z = np.zeros((2, 3), np.float32)
    r.rescore(0, idx, counts, np.zeros(2, np.int32), z)
    assert np.allclose(z[0], (q[0] @ K[0, 0, [2, 0, 1]].T).numpy(), atol=1e-5)
    assert np.isclose(z[1, 0], float(q[1] @ K[0, 0, 1]), atol=1e-5)
