"""minirun.hugepages: the advised buffers hold what torch's would, and get 2 MiB pages where the
kernel's transparent huge pages are on ("always" or "madvise")."""
import sys
from pathlib import Path

import pytest
import torch

from minirun import hugepages

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """The selected THP mode ("always", "madvise", "never"), or None off Linux."""
    if not _THP.exists():
        return None
    text = _THP.read_text()
    return text[text.index("[") + 1:text.index("]")]


def _anon_huge_kb(addr: int) -> int:
    """AnonHugePages (kB) of the mapping of this process that holds addr."""
    cur = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            cur = lo <= addr < hi
        elif cur and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_values_match_torch():
    z = hugepages.zeros(3, 1 << 20, dtype=torch.float32)
    assert z.shape == (3, 1 << 20) and z.dtype == torch.float32 and z.is_contiguous()
    assert not z.any()
    x = torch.randn(5, 7).t()                      # non-contiguous source
    c = hugepages.clone(x)
    assert c.is_contiguous() and torch.equal(c, x) and c.data_ptr() != x.data_ptr()
    e = hugepages.empty(4, 5, dtype=torch.int16)
    assert e.shape == (4, 5) and e.dtype == torch.int16


def test_small_buffers_are_not_advised():
    assert not hugepages.advise(torch.empty(1000))  # no whole 2 MiB page inside


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"),
                    reason=f"transparent huge pages are {_thp_mode() or 'absent'} on this system")
def test_large_buffer_gets_huge_pages():
    # 64 MiB: above glibc's largest mmap threshold (32 MiB), so a fresh mapping, never memory an
    # earlier test in this process touched (madvise reaches pages not yet touched only)
    # (the kernel falls back to 4 KiB pages when it finds no free 2 MiB block, as on a machine whose
    # memory other work has fragmented: a few fresh mappings, one of them must get huge pages)
    huge = []
    for _ in range(4):
        t = hugepages.empty(64 << 20, dtype=torch.uint8)
        assert hugepages.advise(t)
        t.fill_(1)                                  # first touch: the faults take 2 MiB pages
        huge.append(_anon_huge_kb(t.data_ptr() + (32 << 20)))
        if huge[-1] >= 2048:
            break
    assert max(huge) >= 2048, huge
    assert sys.platform.startswith("linux")
