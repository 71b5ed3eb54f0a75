"""The interactive loop behind `minirun chat`."""
from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from pathlib import Path

import click

from .chat_input import MessageReader, StreamReader, stdin_reader
from ..errors import ContextError, MiniRunError
from ..planner import format_bytes

HELP = "commands: /reset (forget the conversation), /exit (quit), /kv (cache report); Ctrl-C stops an answer"


def format_kv_report(stats: dict) -> str:
    parts = [f"{k}={format_bytes(v)}" if k.endswith("bytes") else f"{k}={v}" for k, v in stats.items()]
    return "[kv " + ", ".join(parts) + "]"


def read_document(path: Path) -> str:
    """The text of --file; a binary or non-UTF-8 file is read with replacement characters, and said so
    in one line (the model would otherwise answer about a document it never saw as written)."""
    try:
        data = path.read_bytes()
    except IsADirectoryError:
        raise MiniRunError(f"cannot read --file {path}: it is a directory") from None
    except OSError as e:
        raise MiniRunError(f"cannot read --file {path}: {e.strerror}") from None
    text = data.decode("utf-8", errors="replace")
    if not text.strip():      # (as an empty prompt is refused: nothing for the model to read)
        raise MiniRunError(f"--file {path} is empty{'' if not data else ' (only white space)'}: nothing to read")
    if b"\0" in data[:1 << 20]:
        click.echo(f"minirun: warning: --file {path} looks binary (it holds NUL bytes): read as text anyway", err=True)
    elif "\ufffd" in text and "\ufffd".encode() not in data:
        bad = text.count("\ufffd")
        click.echo(f"minirun: warning: --file {path} is not UTF-8 text: {bad} undecodable byte sequence"
                   f"{'s' if bad > 1 else ''} read as \ufffd", err=True)
    return text


def _progress_bar(total_hint: str):
    from tqdm import tqdm
    bar = {"b": None}

    def cb(done, total):
        if bar["b"] is None:
            bar["b"] = tqdm(total=total, unit="tok", unit_scale=True, desc=total_hint, leave=False)
        bar["b"].update(done - bar["b"].n)
        if done >= total:
            bar["b"].close()
    return cb


@contextlib.contextmanager
def stop_on_sigint():
    """While inside: the first SIGINT (Ctrl-C) sets the yielded Event instead of raising, so the
    engine stops the answer between two steps (should_stop=event.is_set); a second one raises
    KeyboardInterrupt as usual. A flag rather than the exception, because a KeyboardInterrupt
    raised at an arbitrary point can land in code that swallows it (a finalizer, a C callback)
    or cut a cache update in half."""
    event = threading.Event()
    if threading.current_thread() is not threading.main_thread():   # signals go to the main thread only
        yield event
        return

    def handler(signum, frame):
        if event.is_set():
            raise KeyboardInterrupt
        event.set()
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield event
    finally:
        signal.signal(signal.SIGINT, previous)


def fit_conversation(eng, messages: list[dict], keep: int, room: int,
                     kept: str = "the system prompt") -> tuple[list[int], int]:
    """llama.cpp's context shift, a turn at a time: the prompt of `messages` with the oldest turns
    (user + assistant pairs after the first `keep` messages: the system prompt with the document)
    left out until `room` tokens for the answer remain in the context; the newest message is always
    kept. -> (prompt ids, messages left out). ContextError when even the newest message with the
    kept ones (`kept` names them in the message) leaves no room for one answer token."""
    ctx, drop = eng.config.ctx, 0
    ids = eng.chat_prompt(messages)
    while len(ids) + room > ctx and keep + drop + 1 < len(messages):
        drop = min(drop + 2, len(messages) - 1 - keep)
        ids = eng.chat_prompt(messages[:keep] + messages[keep + drop:])
    if len(ids) >= ctx:
        what = kept if keep else "the chat template"
        raise ContextError(f"this message does not fit: {len(ids)} tokens with {what}, the context holds {ctx} "
                           f"(--ctx) even with every earlier turn dropped: send a shorter one, or restart with a "
                           f"larger --ctx")
    return ids, drop


def run_chat(eng, system=None, file=None, kv_report=False, max_tokens=512, sampling=None, prompt_cache=None,
             document: str | None = None, prompt_cache_ro: bool = False, reader: MessageReader | StreamReader | None = None):
    """The chat loop over stdin (reader: its messages; default: a chat_input.MessageReader of stdin).
    document: the text of `file` when the caller read it already; prompt_cache_ro: load the
    prompt-cache file when it fits, never write it."""
    base, prefix = opening(eng, system, file, document, prompt_cache)
    write = not prompt_cache_ro
    if file or prompt_cache:
        # the document now (or from the prompt cache), so the first question only pays for itself
        prefill_document(eng, prefix, prompt_cache, write=write)
        if kv_report:
            click.echo(kv_report_line(eng), err=True)
    click.echo(f"minirun chat: {eng.path.name}, ctx {eng.config.ctx}, kv {eng.config.kv}. {HELP}", err=True)
    reader = reader or stdin_reader()
    messages = list(base)
    while True:
        try:
            click.echo(">>> ", nl=False)
            sys.stdout.flush()
            line = reader.read()             # (a paste: one message; chat_input)
        except KeyboardInterrupt:
            reader.drop_queued()
            click.echo("\n(/exit or Ctrl-D to quit)")
            continue
        if line is None:
            click.echo()
            return
        cmd = line.strip()
        if not cmd:
            continue
        if cmd in ("/exit", "/quit", "/bye"):
            return
        if cmd == "/reset":
            messages = list(base)
            back_to_document(eng, prefix, prompt_cache, write)
            kept = " (the document kept)" if prefix and eng.cache.offset == len(prefix) else ""
            click.echo(f"[conversation reset{kept}]")
        elif cmd == "/kv":
            click.echo(kv_report_line(eng))
        elif cmd.startswith("/") and "\n" not in cmd:     # (a pasted text may start with a slash)
            click.echo(HELP)
        else:
            messages.append({"role": "user", "content": line})
            try:
                ids = fit_turn(eng, messages, len(base), prefix, max_tokens, "the system prompt and the document"
                               if file else "the system prompt", lambda: back_to_document(eng, prefix, prompt_cache, write))
                text = stream_answer(eng, ids, max_tokens, sampling or {}, reader)
                messages.append({"role": "assistant", "content": text})
                if kv_report:
                    click.echo(kv_report_line(eng), err=True)
            except MiniRunError as e:
                messages.pop()
                click.echo(f"error: {e}", err=True)


def opening(eng, system, file, document, prompt_cache) -> tuple[list[dict], list[int]]:
    """The conversation's first messages (a system message holding the document, or none) and
    their tokens, which a prompt-cache file holds the prefill of."""
    if not (system or file):
        if prompt_cache:
            raise MiniRunError("--prompt-cache holds the prefill of --file (or --system): give one of them")
        return [], []
    content = system or "You are a helpful assistant."
    if file:
        text = document if document is not None else read_document(file)
        content += "\n\nThe user has shared this document:\n\n" + text
    base = [{"role": "system", "content": content}]
    prefix = eng.tokenize(eng.tokenizer.apply_chat_template(base, add_generation_prompt=False), add_bos=None)
    if len(prefix) >= eng.config.ctx:
        what = f"--file {file}" if file else "--system"
        raise MiniRunError(f"{what} is {len(prefix)} tokens, more than the context of {eng.config.ctx} (--ctx)")
    return base, prefix


def back_to_document(eng, prefix: list[int], prompt_cache, write: bool) -> None:
    """Drop what followed the opening: the cache keeps the document where it can (a rewind), else
    it comes back from the prompt-cache file."""
    eng.rewind(len(prefix))
    if prefix and eng.cache.offset < len(prefix) and prompt_cache:
        prefill_document(eng, prefix, prompt_cache, write=write)


def fit_turn(eng, messages: list[dict], n_base: int, prefix: list[int], max_tokens: int, kept: str,
             back_to_opening) -> list[int]:
    """Leave out the oldest turns until the conversation and room for an answer fit the context
    (messages edited in place), saying so; the cache then goes back to the opening. -> the prompt's ids."""
    ids, dropped = fit_conversation(eng, messages, n_base, room=max(1, min(max_tokens, eng.config.ctx // 4)), kept=kept)
    if not dropped:
        return ids
    del messages[n_base:n_base + dropped]
    turns = (dropped + 1) // 2
    what = "the oldest turn" if turns == 1 else f"the {turns} oldest turns"
    click.echo(f"[context full: {what} left out to make room{f' ({kept} kept)' if n_base else ''}]", err=True)
    if prefix:     # as /reset: the document stays where the cache can drop what followed it
        back_to_opening()
    return ids


def stream_answer(eng, ids: list[int], max_tokens: int, sampling: dict, reader) -> str:
    """Stream the answer to the prompt `ids` to stdout (Ctrl-C stops it and drops the queued input
    of `reader`), then its figures on stderr -> the answer's text."""
    text, interrupted, raised = "", False, False
    try:
        with stop_on_sigint() as stopped:
            for piece in eng.stream(ids, max_new_tokens=max_tokens, progress=_progress_bar("prompt"),
                                    should_stop=stopped.is_set, **sampling):
                text += piece
                click.echo(piece, nl=False)
        interrupted = eng.last_result.finish_reason == "cancelled"
    except KeyboardInterrupt:          # a second Ctrl-C, or one in a step that never ends
        interrupted = raised = True
    full = not raised and eng.last_result.finish_reason == "ctx"
    if interrupted:
        click.echo(" [interrupted]", nl=False)
        dropped = reader.drop_queued()     # (what was typed or pasted meanwhile: not sent)
        if dropped:
            click.echo(f" [{dropped} queued line{'s' if dropped > 1 else ''} dropped]", nl=False)
    elif full:
        click.echo(" [context full]", nl=False)
    click.echo()
    if full:
        click.echo(f"[the answer reached the end of the context ({eng.config.ctx} tokens, --ctx): the next "
                   f"message leaves out the oldest turns; /reset starts over]", err=True)
    r = getattr(eng, "last_result", None)
    if r is not None and not raised:   # (a stopped answer too: its speed so far, as llama.cpp prints)
        click.echo(f"[prompt {r.prompt_tokens} tok ({r.reused_tokens} cached), {r.prefill_tps:.1f} tok/s | "
                   f"answer {len(r.tokens)} tok{' (stopped)' if interrupted else ''}, "
                   f"{r.decode_tps:.1f} tok/s]", err=True)
    return text


def check_prompt_cache(path: Path | None, read_only: bool) -> None:
    """--prompt-cache and --prompt-cache-ro, before the model loads: a path that holds something else
    than a prompt cache (a document, a directory) is refused, as --prompt-cache-ro without a file."""
    from .. import prompt_cache as pc
    if read_only and path is None:
        raise MiniRunError("--prompt-cache-ro reads the file of --prompt-cache: give it")
    if read_only and not path.is_file():
        raise MiniRunError(f"--prompt-cache-ro: no such file {path} (without --prompt-cache-ro, the first run "
                           f"writes it)")
    if path is not None:
        pc.inspect_file(path)


def prefill_document(eng, prefix: list[int], prompt_cache: Path | None = None, write: bool = True) -> None:
    """Make the cache hold `prefix` (the system prompt with the document): from the prompt-cache
    file when it holds exactly that for this model and setting, else by prefilling it (and then,
    write, writing the file). A file that does not fit is said so in one line and (write) replaced."""
    from .. import prompt_cache as pc
    if prompt_cache is not None and pc.inspect_file(prompt_cache) is not None:
        t0 = time.perf_counter()
        try:
            n = eng.load_prompt_cache(prompt_cache, prefix)
            click.echo(f"[document: {n} tokens in context, loaded from {prompt_cache} in "
                       f"{time.perf_counter() - t0:.1f}s]", err=True)
            return
        except MiniRunError as e:
            click.echo(f"[{e}: prefilling again{'' if write else _KEPT}]", err=True)
    eng.prefill(prefix, progress=_progress_bar("prefill"))
    r = eng.last_prefill
    click.echo(f"[document: {len(prefix)} tokens in context, prefilled in {r['seconds']:.1f}s "
               f"({r['tps']:.0f} tok/s, mode {r['mode']})]", err=True)
    if prompt_cache is not None and write:
        write_prompt_cache(eng, prompt_cache)


_KEPT = " (--prompt-cache-ro: the file is kept as it is)"


def write_prompt_cache(eng, path: Path) -> None:
    """Save the cache to path, in one line saying what the file held when it held another cache."""
    from .. import prompt_cache as pc
    t0 = time.perf_counter()
    try:
        held = pc.inspect_file(path)
        nbytes = eng.save_prompt_cache(path)
    except OSError as e:   # (a full disk, no permission: the answer goes on without the file)
        click.echo(f"[prompt cache {path} not written: {e.strerror or e}]", err=True)
        return
    except MiniRunError as e:   # (something else put at the path since the start: left as it is)
        click.echo(f"[prompt cache not written: {e}]", err=True)
        return
    replaced = f", replacing {pc.summary(held)}" if held else ""
    click.echo(f"[prompt cache: {format_bytes(nbytes)} written to {path} in {time.perf_counter() - t0:.1f}s"
               f"{replaced}]", err=True)


def prefill_prompt_head(eng, ids: list[int], prompt_cache: Path, write: bool = True) -> tuple[int, float]:
    """`generate --prompt-cache`: make the cache hold all of `ids` but the last token, from the file
    as far as it holds the same tokens, prefilling the rest, then (write) save that to the file when
    it held something else. The last token is left to the generation's own prefill, so a later run
    that loads the file computes exactly what this one did. -> (tokens from the file, seconds)."""
    from .. import prompt_cache as pc
    head, from_file, held = ids[:-1], 0, -1
    t0 = time.perf_counter()
    if pc.inspect_file(prompt_cache) is not None:
        try:
            held, shared = pc.load_prefix(eng, prompt_cache, head)
            if shared:
                eng.rewind(shared)         # (what the file holds past the shared tokens: dropped)
            from_file = len(eng._cached_ids)
            why = ("" if held == from_file else f" (it holds {held}, {shared} alike)" if from_file == shared else
                   f" (it holds {held}, {shared} alike: more than the cache can rewind)")
            kept = "" if write or from_file == len(head) else _KEPT
            click.echo(f"[prompt cache: {from_file} of {len(ids)} prompt tokens from {prompt_cache}{why}{kept}]",
                       err=True)
        except MiniRunError as e:
            click.echo(f"[{e}: prefilling the prompt{'' if write else _KEPT}]", err=True)
    if from_file < len(head):
        eng.prefill(head, progress=_progress_bar("prefill") if len(head) - from_file > 4096 else None)
    seconds = time.perf_counter() - t0
    if write and not held == from_file == len(head):
        write_prompt_cache(eng, prompt_cache)
    return from_file, seconds


def kv_report_line(eng) -> str:
    line = format_kv_report(eng.kv_stats())
    mode = eng.cuda_graphs_mode()
    return line if mode == "off" else f"{line} [cuda graphs: {mode}]"
