"""What `minirun chat` reads as one message: a line, or a whole paste.

A terminal sends a paste as many lines at once; read line by line, each would be a turn of its own
(3,000 lines: 3,000 answers). Two ways a paste is told apart from typing, both on a terminal:

- bracketed paste: the chat asks the terminal (ESC[?2004h) to wrap what is pasted in ESC[200~ ...
  ESC[201~; everything between the two marks is one message, however it arrives;
- lines arriving together: after a line, whatever else arrives within PASTE_GAP seconds (read with
  select() on the descriptor, so what is already buffered counts) joins the same message. A person
  does not type two lines 50 ms apart; a paste that arrives in bursts further apart than that
  becomes one message per burst.

From a pipe (a script of messages) every line is a message, as before. The reader reads the file
descriptor itself (os.read), never sys.stdin, whose buffer would hide queued lines from select():
drop_queued can then throw away everything queued, which the chat does when Ctrl-C stops an answer.
"""
from __future__ import annotations

import contextlib
import io
import os
import select
import sys

PASTE_START, PASTE_END = b"\x1b[200~", b"\x1b[201~"
PASTE_GAP = 0.05         # seconds: lines closer together than this are one paste


class MessageReader:
    """Messages from the file descriptor `fd` (a terminal or a pipe); `joins_lines`: whether lines
    arriving together make one message (default: when fd is a terminal)."""

    def __init__(self, fd: int = 0, joins_lines: bool | None = None, gap: float = PASTE_GAP):
        self.fd, self.gap = fd, gap
        self.tty = os.isatty(fd)
        self.joins_lines = self.tty if joins_lines is None else joins_lines
        self.buf, self.eof = b"", False

    def _fill(self, timeout: float | None) -> bool:
        """Read what arrives within `timeout` seconds (None: wait) into the buffer; False if nothing."""
        if self.eof or not select.select([self.fd], [], [], timeout)[0]:
            return False
        data = os.read(self.fd, 1 << 16)
        self.eof = not data
        self.buf += data
        return bool(data)

    def _line(self, wait: bool = True) -> bytes | None:
        """The next line with its newline (the last one may lack it); None at the end of the input,
        or (wait False) when no whole line is buffered."""
        while b"\n" not in self.buf and not self.eof:
            if not wait:
                return None
            self._fill(None)
        if b"\n" in self.buf:
            line, _, self.buf = self.buf.partition(b"\n")
            return line + b"\n"
        line, self.buf = self.buf, b""
        return line or None

    def read(self) -> str | None:
        """The next message (its lines joined by newlines, the last newline dropped); None at the end
        of the input."""
        first = self._line()
        if first is None:
            return None
        lines = [first]
        if PASTE_START in first:                     # bracketed: up to the closing mark, however slow
            while PASTE_END not in lines[-1]:
                nxt = self._line()
                if nxt is None:
                    break
                lines.append(nxt)
        elif self.joins_lines:
            while True:
                nxt = self._line(wait=False)
                if nxt is not None:
                    lines.append(nxt)
                elif not self._fill(self.gap):
                    break
        text = b"".join(lines).replace(PASTE_START, b"").replace(PASTE_END, b"")
        return text.decode("utf-8", errors="replace").removesuffix("\n")

    def drop_queued(self) -> int:
        """Throw away every line queued so far (buffered here, in the terminal, or in the pipe now);
        -> how many lines were dropped."""
        if self.tty:
            import termios
            termios.tcflush(self.fd, termios.TCIFLUSH)
        while self._fill(0):
            pass
        n = self.buf.count(b"\n") + (1 if self.buf and not self.buf.endswith(b"\n") else 0)
        self.buf = b""
        return n

    @contextlib.contextmanager
    def bracketed_paste(self, out=None):
        """While inside, a terminal on both ends brackets what is pasted (and does not echo the marks
        as ^[[200~: ECHOCTL off); both restored when it ends."""
        out = out or sys.stdout
        if not (self.tty and out.isatty()):
            yield
            return
        import termios
        saved = termios.tcgetattr(self.fd)
        quiet = list(saved)
        quiet[3] &= ~termios.ECHOCTL
        termios.tcsetattr(self.fd, termios.TCSANOW, quiet)
        out.write("\x1b[?2004h")
        out.flush()
        try:
            yield
        finally:
            out.write("\x1b[?2004l")
            out.flush()
            termios.tcsetattr(self.fd, termios.TCSANOW, saved)


class StreamReader:
    """Messages from a text stream without a file descriptor (a caller's io.StringIO): a line each;
    nothing is queued outside the stream, so nothing is dropped."""

    def __init__(self, stream):
        self.stream = stream

    def read(self) -> str | None:
        line = self.stream.readline()
        return line.removesuffix("\n") if line else None

    def drop_queued(self) -> int:
        return 0

    @contextlib.contextmanager
    def bracketed_paste(self, out=None):
        yield


def stdin_reader(stream=None) -> MessageReader | StreamReader:
    """The reader of `stream` (default sys.stdin): its descriptor's, else the stream's lines."""
    stream = sys.stdin if stream is None else stream
    try:
        return MessageReader(stream.fileno())
    except (AttributeError, OSError, io.UnsupportedOperation):
        return StreamReader(stream)
