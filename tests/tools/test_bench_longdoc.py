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


def test_a_row_names_the_settings_it_ran_with():
    """Rows of runs with other settings are told apart in the results table: the budget, then the
    selection cap, the values' codes and each --hca-opt as given."""
    from types import SimpleNamespace as NS
    assert bench_longdoc.row_label(NS(kv="dense", kv_budget="g64c16", max_select=4096, hca_opt=["rescore=true"],
                                      dense_fill="prefill")) == "dense"
    assert bench_longdoc.row_label(NS(kv="dense", kv_budget="g64c16", max_select=None, hca_opt=[],
                                      dense_fill="random")) == "dense (random keys and values)"
    assert bench_longdoc.row_label(NS(kv="hca", kv_budget="g64c16", max_select=None, hca_opt=[], dense_fill="random",
                                      kv_values="auto")) == "hca g64c16"
    assert bench_longdoc.row_label(NS(kv="hca", kv_budget="0.25", max_select=4096, kv_values="q8",
                                      hca_opt=["rescore=true", "head_budgets=off"], dense_fill="prefill")) \
        == "hca 0.25 max_select=4096 q8 values rescore=true head_budgets=off"


def test_dense_of_random_keys_and_values_asks_no_facts(smollm2_dir, tmp_path):
    """--dense-fill random: dense's cache holds the document's length of random keys and values
    (its speed and memory past where its prefill is practical): no fact is asked, the row says how
    it was filled, and the table shows no facts column figure."""
    out = tmp_path / "random.json"
    rc = bench_longdoc.main([str(smollm2_dir), "--tokens", "2K", "--kv", "dense", "--dense-fill", "random", "--facts",
                             "2", "--decode", "4", "--threads", "2", "--botchan", str(tmp_path / "absent.txt"),
                             "--json", str(out)])
    assert rc == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["kv"] == "dense (random keys and values)" and row["prefill_mode"] == "random fill"
    assert row["facts"] == [] and row["answered"] == 0 and row["decode_tokens"] == 4 and row["decode_tps"] > 0
    assert row["first_token_s"] > 0 and row["peak_rss_bytes"] > 2**27 and 2048 <= row["tokens"] <= 3072
    assert results_tables.facts_cell(row) == "-"
    assert "| dense (random keys and values) |" in results_tables.longdoc_table([row])
