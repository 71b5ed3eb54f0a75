"""The Llama model: immutable weights and the one layer loop. Caches are passed in, never owned."""
from __future__ import annotations

import torch

from ..config import ModelArgs
from .ops import prepare_cuda_decode, prepare_fused_decode, rope_cos_sin_at, rope_inv_freq, rope_table
from .runners import Batch, CudaTokenRunner, NumpyTokenRunner, Step, TorchRunner


class Model:
    """Llama decoder. `run` is the layer loop over a Batch of one or more sequences, each attending
    through its own cache; `forward` (one sequence) and `decode_at` (a captured step) call it.

    weights: see loader.load_weights (fused wqkv [(Hq+2Hkv)*hd, D] and w_gate_up [2F, D]).
    Runners (minirun/model/runners.py), chosen here once: torch ops for every batch, and for a decode
    step the device's own (the CPU's fused numpy kernels, one token of each of B sequences; the
    GPU's layer kernels, one token of one sequence).
    """

    def __init__(self, args: ModelArgs, weights: dict, device: torch.device, dtype: torch.dtype):
        self.args, self.w, self.device, self.dtype = args, weights, device, dtype
        self.inv_freq = rope_inv_freq(args)
        self.inv_freq64 = self.inv_freq.to(device=device, dtype=torch.float64)   # (RoPE angles in float64)
        # the sliding layers' own RoPE base, where the architecture gives them one (gemma3)
        self.local_inv_freq64 = (rope_inv_freq(args, local=True).to(device=device, dtype=torch.float64)
                                 if args.rope_local_theta else None)
        self.sliding = tuple(args.layer_window(i) is not None for i in range(args.num_hidden_layers))
        self.torch_runner = TorchRunner(weights, args)
        self.token_runner = None
        if device.type == "cuda":
            self.use_cuda_layer_kernels()
        elif prepare_fused_decode(weights, args, self.inv_freq, device, dtype):
            self.token_runner = NumpyTokenRunner(weights, args, dtype)

    def use_cuda_layer_kernels(self, force: bool = False) -> bool:
        """One-token steps through kernels_cuda.layer where they apply (force: on any device, the
        emulator tests') -> whether they do."""
        if prepare_cuda_decode(self.w, self.args, self.device, self.dtype, force=force):
            self.token_runner = CudaTokenRunner(self.w, self.args)
        return self.cuda_decode

    def use_torch_ops(self) -> None:
        """Every step through torch's ops (the reference path)."""
        self.token_runner = None

    @property
    def cuda_decode(self) -> bool:
        return isinstance(self.token_runner, CudaTokenRunner)

    def _runner(self, batch: Batch):
        """The device's token runner for a decode step: one token of each sequence (the GPU's: of one
        sequence); torch's ops for anything else."""
        if self.token_runner is None or any(n != 1 for n in batch.lengths):
            return self.torch_runner
        if len(batch.lengths) > 1 and not isinstance(self.token_runner, NumpyTokenRunner):
            return self.torch_runner
        return self.token_runner

    def _step(self, runner, batch: Batch, caches: list, pos=None, n_keys: int = 0) -> Step:
        """The Step of one call: RoPE angles (from the device position pos [1] for a captured step)."""
        if not runner.needs_angles:
            return Step(batch, caches, None, None)
        at = pos if pos is not None else batch.positions(self.device)
        cos, sin = rope_cos_sin_at(self.inv_freq64, at, self.dtype)
        cs = rope_table(cos, sin) if runner.needs_table else None
        if pos is None:
            local = None if self.local_inv_freq64 is None else rope_cos_sin_at(self.local_inv_freq64, at, self.dtype)
            return Step(batch, caches, cos, sin, cs, local=local, sliding=self.sliding)
        turned = cs is not None and caches[0].rotates_at(self.args.num_attention_heads, self.dtype)
        return Step(batch, caches, cos, sin, cs, at=(pos, n_keys), turned=turned)

    @torch.inference_mode()
    def run(self, batch: Batch, caches: list, all_logits: bool = False, hidden: bool = False, runner=None,
            pos=None, n_keys: int = 0) -> torch.Tensor:
        """The layer loop: batch's sequences, sequence i at caches[i].offset (batch.starts), each
        cache advanced by its tokens at the end -> float32 logits of each sequence's last token
        [B, V] (all_logits: of every token, [N, V]); hidden: those tokens' hidden states [B, D]
        instead (a prompt chunk whose logits nobody reads: the LM head is a large share of a
        one-token step; `logits` makes them later). pos, n_keys: a captured step (decode_at)."""
        runner = runner or self._runner(batch)
        st = self._step(runner, batch, caches, pos, n_keys)
        x = runner.embed(st)
        for il in range(self.args.num_hidden_layers):
            q, k, v = runner.attn_in(il, x, st)      # rms_norm, QKV, RoPE
            o = runner.attend(il, q, k, v, st)       # each sequence through its cache
            x = runner.attn_out(il, x, o)            # x + o_proj(o); x + mlp(rms_norm(x))
        st.finish()
        return runner.head(x, st, all_logits, hidden)

    def forward(self, tokens: torch.Tensor, cache, all_logits: bool = False, hidden: bool = False) -> torch.Tensor:
        """tokens [T] (int64) of one sequence at positions cache.offset.. -> logits [T, V] or [1, V]
        (float32), or the last hidden state [1, D] (see run)."""
        return self.run(Batch(tokens, (int(tokens.shape[0]),), (cache.offset,)), [cache], all_logits, hidden)

    def forward_batch(self, tokens: list[torch.Tensor], caches: list, hidden: bool = False) -> torch.Tensor:
        """Several sequences in one step: tokens[i] [T_i] int64 after what caches[i] holds ->
        logits [B, V] float32 of each one's last token (hidden: their hidden states [B, D])."""
        return self.run(Batch.of(tokens, [c.offset for c in caches]), caches, hidden=hidden)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """forward(hidden=True)'s state [1, D] -> its logits [1, V] (float32)."""
        runner = self.token_runner if isinstance(self.token_runner, NumpyTokenRunner) else self.torch_runner
        return runner.logits(x)

    def decode_at(self, token: torch.Tensor, pos: torch.Tensor, cache, n_keys: int) -> torch.Tensor:
        """One decode token with no host value in it, what minirun/model/cuda_graph.py captures: token, pos
        [1] int64 on the device; the cache attends with attend_at (n_keys: the size its graph_key
        chose), then commit_at. -> logits [1, V] float32. The host's bookkeeping (graph_advance)
        is the caller's."""
        runner = self.token_runner if self.cuda_decode else self.torch_runner
        return self.run(Batch(token, (1,), (0,)), [cache], runner=runner, pos=pos, n_keys=n_keys)
