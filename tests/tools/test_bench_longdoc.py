"""scripts/bench_longdoc.py rehearsed small on the real SmolLM2: a 4K-token document through
Engine.chat, dense and HCA, each in its own process; its JSON rendered by results_tables."""
import json
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import bench_longdoc  # noqa: E402
import results_tables  # noqa: E402


def test_document_holds_every_fact_once_at_its_depth(smollm2_dir):
    from minirun.checkpoint.tokenizer import Tokenizer
    tok = Tokenizer(smollm2_dir)
    planted = bench_longdoc.facts(4, seed=3)
    assert len({f["key"] for f in planted}) == 4
    doc = bench_longdoc.build_document(tok, 3000, planted, 3, bench_longdoc.paragraphs(None))
    n = len(tok.encode(doc, add_bos=False))
    assert 2900 <= n <= 3600
    where = [doc.index(f["sentence"]) / len(doc) for f in planted]
    assert all(doc.count(f["sentence"]) == 1 for f in planted)
    assert where == sorted(where) and where[0] < 0.25 and where[-1] > 0.75


@pytest.mark.slow
def test_rehearsal_4k(smollm2_dir, tmp_path, capsys):
    out = tmp_path / "longdoc.json"
    rc = bench_longdoc.main([str(smollm2_dir), "--tokens", "4K", "--kv", "dense,hca", "--facts", "2", "--decode", "8",
                             "--threads", "2", "--botchan", str(tmp_path / "absent.txt"), "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["kind"] == "longdoc" and [r["kv"] for r in report["rows"]] == ["dense", "hca g64c16"]
    for r in report["rows"]:
        assert 4000 <= r["tokens"] <= 4600 and r["prefill_s"] > 0 and r["first_token_s"] > 0
        assert r["decode_tokens"] == 8 and r["decode_tps"] > 0 and r["peak_rss_bytes"] > 2**27
        assert len(r["facts"]) == 2 and r["answered"] == sum(f["ok"] for f in r["facts"])
    dense, hca = report["rows"]
    assert dense["selected"] is None and 0 < hca["selected"] <= 1
    table = results_tables.render(report)
    assert "| hca g64c16 |" in table and "of 2 |" in table


def test_a_copy_without_blank_lines_is_cut_into_paragraphs(tmp_path):
    """A text whose paragraphs lost their blank lines still gives paragraph-sized pieces (the
    document's length and its facts' depths stay what was asked), cut at line ends."""
    lines = [f"Line {i} of a long text that has no blank line between its paragraphs at all." for i in range(400)]
    f = tmp_path / "flat.txt"
    f.write_text("\n".join(lines))
    pieces = [p for p in bench_longdoc.paragraphs(f) if p.startswith("Line ")]
    assert len(pieces) > 10 and max(len(p) for p in pieces) <= bench_longdoc.PARAGRAPH_CHARS
    assert "\n".join(pieces).splitlines() == lines
