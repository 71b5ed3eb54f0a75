"""A chat whose conversation outgrows --ctx keeps answering: the oldest turns are left out (never the
system prompt or the document), the answer that reached the end of the context says so, and a
message that cannot fit even alone is one line, after which the chat goes on."""
from __future__ import annotations

import subprocess
import sys

import pytest

from minirun import Engine
from minirun.cli.chat import fit_conversation
from minirun.errors import ContextError


def test_fit_conversation_leaves_out_the_oldest_turns(tiny_model_dir):
    eng = Engine.load(tiny_model_dir("gqa-untied"), device="cpu", ctx=400)
    system = [{"role": "system", "content": "Be brief."}]
    turns = []
    for i in range(6):
        turns += [{"role": "user", "content": f"question {i} " * 3}, {"role": "assistant", "content": f"answer {i} " * 3}]
    messages = system + turns + [{"role": "user", "content": "last one"}]
    ids, dropped = fit_conversation(eng, messages, keep=1, room=40)
    assert dropped % 2 == 0 and 0 < dropped < len(turns)
    assert ids == eng.chat_prompt(system + turns[dropped:] + messages[-1:])       # the newest turns, in order
    assert len(ids) + 40 <= 400 < len(eng.chat_prompt(system + turns[dropped - 2:] + messages[-1:])) + 40
    assert fit_conversation(eng, system + messages[-1:], keep=1, room=40) == (eng.chat_prompt(system + messages[-1:]), 0)
    with pytest.raises(ContextError, match="this message does not fit: .* even with every earlier turn dropped"):
        fit_conversation(eng, messages[:-1] + [{"role": "user", "content": "x " * 400}], keep=1, room=40)


def test_chat_runs_past_ctx_over_several_turns(tiny_model_dir):
    """ctx 128, answers of up to 100 tokens: every answer runs into the end of the context, every next
    message leaves out the turn before; a message longer than the context is refused in one line
    and the next one is answered."""
    script = "".join(f"message number {i}\n" for i in range(5)) + "y" * 300 + "\nstill here?\n/exit\n"
    p = subprocess.run([sys.executable, "-m", "minirun", "chat", str(tiny_model_dir("gqa-untied")), "--ctx", "128",
                        "-n", "100", "--ignore-eos", "--system", "Be brief."], input=script, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    stats = [ln for ln in p.stderr.splitlines() if ln.startswith("[prompt ")]
    assert len(stats) == 6                                             # five messages and the one after the refusal
    assert all(" answer 0 tok" not in ln for ln in stats)
    assert p.stdout.count(" [context full]") >= 5
    assert p.stderr.count("[context full: the oldest turn left out to make room (the system prompt kept)]") >= 4
    assert "/reset starts over" in p.stderr
    refusals = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(refusals) == 1 and "this message does not fit" in refusals[0]
