"""`minirun chat` reads a paste as one message (bracketed paste, or lines arriving together on a
terminal), a script from a pipe line by line, and Ctrl-C during an answer drops the queued input."""
from __future__ import annotations

import os
import pty
import signal
import subprocess
import sys
import termios
import threading
import time

from minirun.cli.chat_input import MessageReader

PASTE = [f"line {i} of the paste" for i in range(3000)]


def quiet_pty() -> tuple[int, int]:
    """A pseudo-terminal (master, slave) that does not echo: what is written to master arrives at
    slave as typed or pasted input."""
    master, slave = pty.openpty()
    attrs = termios.tcgetattr(slave)
    attrs[3] &= ~termios.ECHO
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    return master, slave


def write_later(fd: int, *chunks: tuple[float, bytes]) -> threading.Thread:
    """Write each (delay, bytes) to fd in turn, in a thread (a write blocks while the terminal's
    input buffer is full, as a terminal's paste does)."""
    def run():
        for delay, data in chunks:
            time.sleep(delay)
            os.write(fd, data)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_pipe_reads_a_line_per_message():
    r, w = os.pipe()
    os.write(w, b"hello\n/reset\nlast without newline")
    os.close(w)
    reader = MessageReader(r)
    assert not reader.joins_lines
    assert [reader.read(), reader.read(), reader.read(), reader.read()] == ["hello", "/reset", "last without newline",
                                                                           None]


def test_bracketed_paste_is_one_message_however_slowly_it_arrives():
    """ESC[200~ ... ESC[201~ (the terminal's marks around a paste): one message, the marks dropped,
    even when its lines come far apart (here 0.2 s, four times the gap)."""
    r, w = os.pipe()
    reader = MessageReader(r)
    t = write_later(w, (0, b"\x1b[200~first\nsecond\n"), (0.2, b"third\x1b[201~\n"), (0, b"next\n"))
    assert reader.read() == "first\nsecond\nthird"
    assert reader.read() == "next"
    t.join()
    os.close(w)
    assert reader.read() is None


def test_lines_arriving_together_on_a_terminal_are_one_message():
    """3,000 lines written at once into a terminal (through its 4 KiB input buffer, so in many
    reads): one message; a line typed later is the next one."""
    master, slave = quiet_pty()
    try:
        reader = MessageReader(slave)
        assert reader.tty and reader.joins_lines
        t = write_later(master, (0, "\n".join(PASTE).encode() + b"\n"), (0.5, b"a question\n"))
        assert reader.read().split("\n") == PASTE
        assert reader.read() == "a question"
        t.join()
    finally:
        os.close(master)
        os.close(slave)


def test_drop_queued_throws_away_what_is_buffered_and_waiting():
    r, w = os.pipe()
    os.write(w, b"first\nsecond\nthird\n")
    reader = MessageReader(r)
    assert reader.read() == "first"                   # (the rest now sits in the reader's buffer)
    os.write(w, b"fourth\nfif")
    assert reader.drop_queued() == 4                  # second, third, fourth and the partial line
    os.write(w, b"after\n")
    assert reader.read() == "after"
    os.close(w)


def chat_cmd(model) -> list[str]:
    return [sys.executable, "-m", "minirun", "chat", str(model), "--device", "cpu"]


def test_chat_takes_a_pasted_text_as_one_turn(tiny_model_dir):
    """The console script on a terminal: 3,000 pasted lines make one message. With --ctx 1K it does
    not fit, which the chat says once, counting the tokens of all 3,000 lines (line by line, each
    would have been a turn of its own, answered); "hi" typed afterwards is the next turn."""
    master, slave = quiet_pty()
    p = subprocess.Popen(chat_cmd(tiny_model_dir("gqa-untied")) + ["-n", "2", "--ctx", "1K"], stdin=slave,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    os.close(slave)
    numbers = "\n".join(str(i) for i in range(3000)).encode() + b"\n"
    t = write_later(master, (0, numbers), (1, b"hi\n"), (1, b"/exit\n"))
    try:
        out, err = p.communicate(timeout=300)
    finally:
        t.join()
        os.close(master)
    assert p.returncode == 0 and "Traceback" not in err, err
    too_long = [ln for ln in err.splitlines() if "this message does not fit" in ln]
    assert len(too_long) == 1 and int(too_long[0].split("fit: ")[1].split()[0]) > 3000, err
    assert len([ln for ln in err.splitlines() if ln.startswith("[prompt ")]) == 1, err     # (hi's answer)


def test_ctrl_c_during_an_answer_drops_the_queued_input(tiny_model_dir):
    """A script of 40 messages from a pipe: Ctrl-C during the first (endless) answer stops it and
    drops the 39 queued; the chat then reads what comes next."""
    p = subprocess.Popen(chat_cmd(tiny_model_dir("gqa-untied")) + ["-n", "100000", "--ignore-eos"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdin.write("tell me a long story\n" + "".join(f"question {i}\n" for i in range(39)))
    p.stdin.flush()
    p.stdout.read(10)          # the answer is streaming (the prompt ">>> " plus its first bytes)
    time.sleep(0.5)
    os.kill(p.pid, signal.SIGINT)
    time.sleep(1)
    out, err = p.communicate("/exit\n", timeout=60)
    assert p.returncode == 0 and "Traceback" not in err, err
    assert "[interrupted] [39 queued lines dropped]" in out, out
    assert len([ln for ln in err.splitlines() if ln.startswith("[prompt ")]) == 1, err
