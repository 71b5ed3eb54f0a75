"""The public API: load a model, then generate, stream and chat over one owned KV cache."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

import kernels_cpu

from .model import cuda_graph
from . import prompt_cache
from .config import EngineConfig, ModelArgs
from .decoding import Decoding, GenerationResult, sequence_logprobs
from .errors import CheckpointError, ContextError
from .kv import make_cache
from .model.loader import DTYPES, load_weights
from .model.transformer import Model
from .planner import check_fits
from .sampling import SamplingParams
from .checkpoint.tokenizer import Tokenizer


HCA_STEPS_MAX = 64     # prompt tokens after cached ones that an HCA cache on a GPU takes as decode steps


@dataclass(frozen=True)
class PromptChunk:
    """A forward that a prefill asks its driver for (Engine.prefill_steps yields it): tokens [T]
    int64 of one sequence after what `cache` holds. The driver sends back their last hidden state
    [1, D], or None when it stops there without running it."""
    tokens: torch.Tensor
    cache: object


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise CheckpointError("device 'cuda' asked for, but torch sees no CUDA device")
    return torch.device(device)


def not_a_model_dir(path: Path) -> str:
    """Why `path` cannot be loaded, in one line: a GGUF file is pointed at the command converting it."""
    if not path.exists():
        if len(path.parts) == 1:
            from .checkpoint.pull import default_models_dir
            return f"no such model directory: {path} (nor a model of that name in {default_models_dir()})"
        return f"no such model directory: {path}"
    if path.is_file():
        from .checkpoint.convert import GGUF_MAGIC
        with open(path, "rb") as f:
            if f.read(4) == GGUF_MAGIC:
                import shlex
                out = path.with_name(path.name.split(".")[0] or path.stem)
                out = out if out != path else path.with_name(path.name + "-hf")
                return (f"{path} is a GGUF file: convert it once with `minirun convert {shlex.quote(str(path))} "
                        f"{shlex.quote(str(out))}`, then give {out}")
        if path.name == "config.json":
            return f"{path} is a config.json: give the model directory holding it, {path.parent}"
    return f"{path} is not a model directory (a Hugging Face-format directory with config.json)"


class Engine:
    """One model, one tokenizer, one sequence's cache. Not thread-safe."""

    def __init__(self, path: Path, args: ModelArgs, config: EngineConfig, model: Model, tokenizer: Tokenizer):
        self.path, self.args, self.config, self.model, self.tokenizer = path, args, config, model, tokenizer
        self.device, self.dtype = model.device, model.dtype
        with torch.inference_mode():   # cache tensors are updated in place inside inference mode only
            self.cache = make_cache(args, config, self.device, self.dtype, config.ctx, model_dir=path)
        self._cached_ids: list[int] = []   # the tokens whose K/V the cache holds, in order
        self.graphed = self._graphed_decode()

    def _graphed_decode(self):
        """The CUDA-graph decode steps (config.cuda_graphs, on a GPU) where the cache can be captured
        whole (dense; HCA with the GPU value sum), else None: eager steps."""
        if self.device.type != "cuda" or not self.config.cuda_graphs or not cuda_graph.supports(self.cache) \
                or self.model.local_inv_freq64 is not None:   # (a captured step turns every layer by one base)
            return None
        return cuda_graph.GraphedDecode(self.model, self.cache)

    @classmethod
    def load(cls, path, device: str = "auto", dtype: str = "float32", ctx=8192, kv: str = "dense",
             **kwargs) -> "Engine":
        """Load a Hugging Face-format Llama directory (or one named in the models directory: pull.find_model).
        kwargs: any EngineConfig field."""
        from .checkpoint.pull import find_model
        path = find_model(path)          # (a name in the models directory: "smollm2")
        config = EngineConfig(ctx=ctx, device=device, dtype=dtype, kv=kv, **kwargs)   # (bad settings first)
        if not path.is_dir():
            raise CheckpointError(not_a_model_dir(path))
        if config.threads:
            torch.set_num_threads(config.threads)
            kernels_cpu.set_num_threads(config.threads)
        args = ModelArgs.from_path(path)
        dev = resolve_device(config.device)
        check_fits(args, config, dev)   # before any allocation
        tokenizer = Tokenizer(path)
        weights = load_weights(path, args, DTYPES[config.dtype], dev, config.weights)
        return cls(path, args, config, Model(args, weights, dev, DTYPES[config.dtype]), tokenizer)

    @classmethod
    def with_random_weights(cls, path, device: str = "auto", dtype: str = "float32", ctx=8192, kv: str = "dense",
                            seed: int = 0, **kwargs) -> "Engine":
        """An engine over random weights made on the device (random_checkpoint.random_weights) for the
        config.json and tokenizer in `path`: speed and memory figures of a model too large to write
        to disk first (an 8B shape is 16 GB). kwargs: any EngineConfig field."""
        from .checkpoint.random_checkpoint import random_weights
        path = Path(path)
        config = EngineConfig(ctx=ctx, device=device, dtype=dtype, kv=kv, **kwargs)
        args = ModelArgs.from_path(path)
        dev = resolve_device(config.device)
        check_fits(args, config, dev)
        weights = random_weights(args, DTYPES[config.dtype], dev, seed)
        return cls(path, args, config, Model(args, weights, dev, DTYPES[config.dtype]), Tokenizer(path))

    # ---- text <-> ids -------------------------------------------------------------------------
    def tokenize(self, text: str, add_bos: bool | None = None) -> list[int]:
        return self.tokenizer.encode(text, add_bos=add_bos)

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def _ids(self, prompt) -> list[int]:
        ids = self.tokenize(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
        if not ids:
            raise ContextError("empty prompt")
        if len(ids) > self.config.ctx:
            raise ContextError(f"prompt is {len(ids)} tokens, longer than the context of {self.config.ctx} (--ctx)")
        return ids

    # ---- forward passes -------------------------------------------------------------------------
    @torch.inference_mode()
    def logits(self, ids: list[int], chunk: int | None = None, prefill_mode: str = "hca") -> torch.Tensor:
        """Logits [len(ids), vocab] (float32, CPU) of one fresh sequence, every position.

        Runs in a cache of its own so the engine's conversation cache is untouched. With kv="hca"
        every position attends through the HCA path (prefill_mode "hca"), which is what the quality
        tools measure; "exact" attends exactly within the sequence.
        """
        ids = self._ids(ids)
        cache = make_cache(self.args, self.config, self.device, self.dtype, len(ids), model_dir=self.path)
        chunk = chunk or self.config.chunk_for(self.device.type)
        tokens = torch.tensor(ids, dtype=torch.long, device=self.device)
        cache.begin_prefill(prefill_mode)
        out = [self.model.forward(tokens[i:i + chunk], cache, all_logits=True).cpu()
               for i in range(0, len(ids), chunk)]
        cache.end_prefill()
        self.last_logits_cache = cache
        return torch.cat(out)

    def prompt_logprobs(self, ids: list[int], top: int = 0) -> list:
        """Each prompt token's log-probability given those before it, from `logits` (a cache of its
        own) -> [(id, logprob, [(id, logprob)] of the top most likely)], the first (id, None, [])."""
        if len(ids) < 2:
            return [(ids[0], None, [])] if ids else []
        return [(ids[0], None, [])] + sequence_logprobs(self.logits(ids)[:-1], list(ids[1:]), top)

    @torch.inference_mode()
    def reset(self) -> None:
        """Forget the conversation: the next prompt is prefilled from scratch."""
        self.cache.reset()
        self._cached_ids = []

    @torch.inference_mode()
    def rewind(self, n: int) -> None:
        """Keep only the first n tokens of the conversation (or forget it all when the cache cannot)."""
        if self.cache.truncate(min(n, self.cache.offset)):
            self._cached_ids = self._cached_ids[:self.cache.offset]
        else:
            self.reset()

    @torch.inference_mode()
    def prefill(self, ids: list[int], progress=None, should_stop=None) -> tuple[torch.Tensor, int]:
        """Make the cache hold exactly `ids`; return (last logits [1, V], tokens served from cache):
        prefill_steps driven to its end, each chunk a forward of its own."""
        steps = self.prefill_steps(ids, progress, should_stop)
        hidden = None
        while True:
            try:
                chunk = steps.send(hidden)
            except StopIteration as done:
                return done.value
            hidden = self.model.forward(chunk.tokens, chunk.cache, hidden=True)

    @torch.inference_mode()     # (torch enters it around each resumption of the generator)
    def prefill_steps(self, ids: list[int], progress=None, should_stop=None):
        """prefill as a generator that yields each prompt chunk's forward (a PromptChunk) for its
        driver to run and send back, so that a driver can run other sequences' steps in between,
        or several prefills' chunks in one forward (the server's scheduler, forward_chunks); its
        return value (StopIteration.value) is prefill's. Finish it, or stop it through should_stop
        or by sending None: the cache is consistent only once it has returned.

        A prefix shared with what the cache already holds is reused when the cache can truncate to it.
        An HCA cache truncates within its ring, or within a ring it copied (kv/ring_checkpoint.py):
        the one at the end of the last prompt, and the one where a prompt last left the cached
        tokens (a new question after a shared document), which is where the next one will likely
        leave them too. When the cache had to start over, the prompt is prefilled up to that point
        first, so that the copy is made there.
        progress: optional callable(n_done, n_total) called after each chunk. should_stop: optional
        callable checked after each chunk; when it returns True the cache keeps the chunks done so far
        (a prefix of `ids`, reused by the next call) and the logits are those of the last chunk done.
        """
        if len(self._cached_ids) != self.cache.offset:   # an interrupted forward: trust nothing
            self.reset()
        shared = 0
        for a, b in zip(self._cached_ids, ids):
            if a != b:
                break
            shared += 1
        left = 0 < shared < min(len(ids), len(self._cached_ids))    # this prompt leaves the cached tokens
        common = min(shared, len(ids) - 1)          # recompute at least one token to get its logits
        if not self.cache.truncate(common):
            self.cache.reset()
            common = 0
        self._cached_ids = self._cached_ids[:common]
        mark = left and not self.cache.truncates_anywhere
        split = mark and common < shared and 2 * shared >= len(ids)   # (the shorter part in "hca" mode)
        if mark and common == shared:
            self.cache.checkpoint("shared")
        t0 = time.perf_counter()
        total = len(ids) - common
        logits, done, mode = yield from self._prefill_span(ids, common, shared if split else len(ids), progress,
                                                           should_stop, total)
        if split and common + done == shared:
            self.cache.checkpoint("shared")
            if should_stop is None or not should_stop():
                logits, more, _ = yield from self._prefill_span(ids, shared, len(ids), progress, should_stop, total,
                                                                done)
                done += more
        if done == total:   # a point to come back to: the next prompt may share this one, not its answer
            self.cache.checkpoint("prompt")
        dt = time.perf_counter() - t0
        self.last_prefill = {"tokens": done, "seconds": dt, "tps": done / max(dt, 1e-9), "mode": mode}
        self._cached_ids = list(ids[:common + done])
        return logits, common

    def _prefill_span(self, ids: list[int], start: int, end: int, progress, should_stop, total: int,
                      before: int = 0) -> tuple[torch.Tensor, int, str]:
        """Forward ids[start:end] after the `start` tokens the cache holds, chunk by chunk, between
        begin_prefill and end_prefill -> (last logits [1, V], tokens done, prefill mode). progress
        gets (before + tokens done, total)."""
        mode = self.config.prefill_mode
        if mode == "auto":   # (an HCA cache that holds a store takes "hca": begin_prefill says)
            limit = self.config.exact_prefill_limit(self.device.type, self.args.max_position_embeddings)
            mode = "exact" if end <= limit else "anchor"
        tail = self._hca_tail(mode, start, end)
        if tail:             # a long prompt's last tokens read the whole store, through the selection
            logits, done, mode = yield from self._prefill_mode_span(ids, start, end - tail, mode, progress,
                                                                    should_stop, total, before)
            if start + done < end - tail or (should_stop is not None and should_stop()):
                return logits, done, mode
            logits, more, _ = yield from self._prefill_mode_span(ids, end - tail, end, "hca", progress, should_stop,
                                                                 total, before + done)
            return logits, done + more, mode
        return (yield from self._prefill_mode_span(ids, start, end, mode, progress, should_stop, total, before))

    def _hca_tail(self, mode: str, start: int, end: int) -> int:
        """Of an anchor prefill of ids[start:end] in an HCA cache, how many last tokens go through
        the HCA path instead (a window's worth: the question at a document's end then reads every
        stored token through the selection, as it does after a cached document), else 0."""
        hca = self.cache.full_layers
        if mode != "anchor" or self.config.kv != "hca" or hca.n_store:
            return 0
        tail = self.config.window
        return tail if end - start > tail + hca.S + hca.W + self.config.anchor_tokens else 0

    def _prefill_mode_span(self, ids, start, end, mode, progress, should_stop, total, before):
        """_prefill_span's forward of ids[start:end] in one prefill mode (begin_prefill may change
        it) -> (last logits [1, V], tokens done, the mode taken)."""
        todo = torch.tensor(ids[start:end], dtype=torch.long, device=self.device)
        chunk = self.config.chunk_for(self.device.type)
        mode = self.cache.begin_prefill(mode)
        if mode == "hca" and self.config.kv == "hca" and self.device.type == "cuda" and todo.numel() <= HCA_STEPS_MAX:
            chunk = 1   # a question after a document on a GPU: the decode step per token (a chunk's
            #             queries take a selection round trip to the host each; the CPU's chunk
            #             runs its matrices once and each query through the one-call step)
        x = None
        done = 0
        for i in range(0, todo.numel(), chunk):
            h = yield PromptChunk(todo[i:i + chunk], self.cache)   # (the hidden state: logits of the last one only)
            if h is None:                                          # the driver stops before this chunk
                break
            x, done = h, min(i + chunk, todo.numel())
            if progress:
                progress(before + done, total)
            if done < todo.numel() and should_stop is not None and should_stop():
                break
        self.cache.end_prefill()
        return (None if x is None else self.model.logits(x)), done, mode

    def _check_room(self) -> None:
        if self.cache.offset >= self.config.ctx:
            raise ContextError(f"the context of {self.config.ctx} tokens is full (--ctx): reset, or load with a "
                               f"larger ctx")

    @torch.inference_mode()
    def step(self, token: int) -> torch.Tensor:
        """Feed one token after what the cache holds; return its logits [1, V] (teacher forcing, decode).
        A full context raises ContextError (before anything is written)."""
        self._check_room()
        if self.graphed is not None and not self.graphed.failed:
            logits = self.graphed.step(token)
        else:
            logits = self.model.forward(torch.tensor([token], dtype=torch.long, device=self.device), self.cache)
        self._cached_ids.append(token)
        return logits

    # ---- several sequences of one model ---------------------------------------------------------
    def sibling(self) -> "Engine":
        """Another sequence on this engine's model: the same weights and tokenizer, its own cache."""
        return Engine(self.path, self.args, self.config, self.model, self.tokenizer)

    @staticmethod
    @torch.inference_mode()
    def step_batch(engines: list["Engine"], tokens: list[int]) -> torch.Tensor:
        """One decode token for each engine (sequences of one model: siblings) in one forward ->
        logits [B, V] float32, row i engine i's. A full context raises ContextError before
        anything is written."""
        model = engines[0].model
        if any(e.model is not model for e in engines) or len(engines) != len(tokens):
            raise ValueError("step_batch: one token for each engine, all on one model")
        for e in engines:
            e._check_room()
        logits = model.forward_batch([torch.tensor([t], dtype=torch.long, device=model.device) for t in tokens],
                                     [e.cache for e in engines])
        for e, t in zip(engines, tokens):
            e._cached_ids.append(t)
        return logits

    @staticmethod
    @torch.inference_mode()
    def forward_chunks(engines: list["Engine"], chunks: list[PromptChunk]) -> torch.Tensor:
        """The next prompt chunk of several prefills (chunks[i]: what engines[i].prefill_steps
        yielded; siblings) in one forward, the weights read once for all of them -> each chunk's
        last hidden state [B, D] (row i goes back to engine i's prefill_steps)."""
        model = engines[0].model
        if any(e.model is not model for e in engines) or len(engines) != len(chunks):
            raise ValueError("forward_chunks: one chunk for each engine, all on one model")
        return model.forward_batch([c.tokens for c in chunks], [c.cache for c in chunks], hidden=True)

    # ---- generation ---------------------------------------------------------------------------
    def decoding(self, ids: list[int], max_new_tokens: int, stop=(), ignore_eos: bool = False,
                 logprobs: int | None = None, **sampling) -> Decoding:
        """The state of an answer to the prompt `ids` on this engine's model (minirun/decoding.py);
        sampling: SamplingParams' fields (temperature, top_k, top_p, min_p, repetition_penalty, seed)."""
        sp = SamplingParams(**sampling)
        eos = frozenset() if ignore_eos else frozenset(self.tokenizer.eos_ids) | frozenset(self.args.eos_ids)
        history = ids if sp.repetition_penalty != 1.0 else None
        return Decoding(self.tokenizer, len(ids), max_new_tokens, sp, stop, eos, self.config.ctx - len(ids),
                        logprobs, history)

    def _run(self, prompt, max_new_tokens: int, stop, sampling: dict, progress=None, ignore_eos: bool = False,
             should_stop=None, logprobs: int | None = None) -> Iterator[tuple[str, GenerationResult]]:
        """Core loop: yields (text piece, result so far); the last yield carries the final result.

        should_stop: optional callable, checked after each prefill chunk and before each decode step;
        True ends the generation cleanly (finish_reason "cancelled"), never in the middle of a step,
        so the cache stays consistent (how the chat's Ctrl-C stops an answer).
        """
        ids = self._ids(prompt)
        dec = self.decoding(ids, max_new_tokens, stop, ignore_eos, logprobs, **sampling)
        res = dec.res
        t0 = time.perf_counter()
        logits, reused = self.prefill(ids, progress, should_stop)
        t1 = time.perf_counter()
        res.prefill_tps, res.prefill_s, res.reused_tokens = (len(ids) - reused) / max(t1 - t0, 1e-9), t1 - t0, reused
        cancelled = len(self._cached_ids) < len(ids)        # the prefill itself was stopped
        while not dec.done:
            if cancelled or (should_stop is not None and should_stop()):
                piece = dec.finish("cancelled")
            else:
                piece = dec.take(logits[-1])
            if piece:
                yield piece, res
            if dec.next is not None:
                logits = self.step(dec.next)
        t2 = time.perf_counter()
        res.decode_s = t2 - t1
        res.decode_tps = len(res.tokens) / max(t2 - t1, 1e-9)
        yield "", res

    def generate(self, prompt, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, min_p: float = 0.0, repetition_penalty: float = 1.0, seed=None,
                 stop=(), progress=None, ignore_eos: bool = False, should_stop=None,
                 logprobs: int | None = None) -> GenerationResult:
        """prompt: str or list[int]. Returns the new tokens, their text and timings; logprobs: also
        each new token's log-probability and the `logprobs` most likely ones (res.logprobs)."""
        sp = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                  repetition_penalty=repetition_penalty, seed=seed)
        res = None
        for _, res in self._run(prompt, max_new_tokens, stop, sp, progress, ignore_eos, should_stop, logprobs):
            pass
        return res

    def stream(self, prompt, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, min_p: float = 0.0, repetition_penalty: float = 1.0, seed=None,
               stop=(), progress=None, ignore_eos: bool = False, should_stop=None,
               logprobs: int | None = None) -> Iterator[str]:
        """Yield text pieces as they are decoded. `self.last_result` holds the timings afterwards."""
        sp = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                  repetition_penalty=repetition_penalty, seed=seed)
        for piece, res in self._run(prompt, max_new_tokens, stop, sp, progress, ignore_eos, should_stop, logprobs):
            self.last_result = res
            if piece:
                yield piece

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """Render messages with the chat template and tokenize (the template brings its own BOS)."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        bos = self.tokenizer.bos_token
        return self.tokenize(text, add_bos=not (bos and text.startswith(bos)) and self.tokenizer.add_bos)

    def chat(self, messages: list[dict], max_new_tokens: int = 256, **kwargs) -> GenerationResult:
        """messages: [{"role": "system"|"user"|"assistant", "content": str}]. Returns the reply."""
        return self.generate(self.chat_prompt(messages), max_new_tokens=max_new_tokens, **kwargs)

    def set_cuda_graphs(self, on: bool) -> None:
        """Turn CUDA-graph decode on or off; on makes fresh graphs for the cache as it is configured
        now (after its value sum or selection cap changed, say)."""
        self.config.cuda_graphs = on
        self.graphed = self._graphed_decode() if on else None

    def cuda_graphs_mode(self) -> str:
        """"token" when decode tokens are replayed from CUDA graphs, "off" when they run eagerly (a
        CPU, cuda_graphs off, a cache that cannot be captured, or a failed capture)."""
        g = self.graphed
        return "off" if g is None or g.failed else "token"

    def save_prompt_cache(self, path) -> int:
        """Write what the cache holds, and its tokens, to a prompt-cache file (minirun/prompt_cache.py)
        -> bytes written. Between prompts only (not inside a prefill). Written only where nothing is
        or a prompt cache is: anything else at path is left as it is (prompt_cache.NotAPromptCache)."""
        return prompt_cache.save(self, path)

    @torch.inference_mode()
    def load_prompt_cache(self, path, tokens: list[int] | None = None) -> int:
        """Make the cache hold what a prompt-cache file holds -> its tokens; the next prompt that
        starts with them prefills only the rest. tokens: the prompt the file must hold (else
        PromptCacheMismatch, the cache untouched)."""
        return prompt_cache.load(self, path, tokens)

    def kv_stats(self) -> dict:
        """Bytes per tier of the conversation cache and the tokens it holds."""
        return self.cache.stats()
