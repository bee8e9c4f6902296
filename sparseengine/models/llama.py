"""The Llama family (Llama 3.x, SmolLM2, Mistral, Qwen2.5, Qwen3): positions and hidden
states in, hidden states out. Nothing here knows about batching or sparsity; only the
row count of a forward picks where folded norms are applied (`DecoderLayer.forward`)."""

from __future__ import annotations

import torch
from torch import nn

from sparseengine.kernels import cuda_linear, skinny_linear
from sparseengine.kernels.fused_ops import silu_mul
from sparseengine.layers.attention import Attention
from sparseengine.layers.layernorm import RMSNorm
from sparseengine.layers.linear import Linear
from sparseengine.layers.rotary import RotaryEmbedding
from sparseengine.models.model_config import ModelConfig


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.hq, self.hkv, self.d = config.num_heads, config.num_kv_heads, config.head_dim
        self.qkv_proj = Linear(config.hidden_size, (self.hq + 2 * self.hkv) * self.d, bias=config.qkv_bias)
        self.o_proj = Linear(self.hq * self.d, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.d, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.d, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.attn = Attention(layer_id, self.hq, self.hkv, self.d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm: nn.Module | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """`norm`, `residual`: folded into the projections (`Linear`)."""
        t = x.shape[0]
        if not self.qk_norm and self.attn.takes_projection(x, self.qkv_proj):  # rotary and KV write in qkv's epilogue
            return self.o_proj(self.attn.project_and_attend(x, self.qkv_proj, norm, cos, sin).reshape(
                t, self.hq * self.d), residual=residual)
        q, k, v = self.qkv_proj(x, norm).split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        q, k, v = q.view(t, self.hq, self.d), k.view(t, self.hkv, self.d), v.view(t, self.hkv, self.d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.o_proj(self.attn(q, k, v, cos, sin).reshape(t, self.hq * self.d), residual=residual)  # rotary there


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.gate_group = 0  # gate_up's rows interleaved in groups of this many (`interleave_gate_up`)

    def forward(self, x: torch.Tensor, norm: nn.Module | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        up = self.gate_up_proj
        if self.gate_group and cuda_linear.takes(x, up.weight, up.bias):  # the SiLU in gate_up's kernel
            h = cuda_linear.cuda_linear(x, up.weight, rms_eps=None if norm is None else norm.eps, gated=True)
        else:
            h = silu_mul(up(x, norm), self.gate_group)  # read interleaved in place (a prefill's [T, 2I])
        return self.down_proj(h, residual=residual)

    @torch.no_grad()
    def interleave_gate_up(self, group: int = cuda_linear.GATE_GROUP) -> None:
        """Reorder gate_up's rows for the CUDA kernel's gated epilogue (`cuda_linear.interleave_gate_up`):
        the same layer, whose other paths put its output back in order."""
        if self.gate_group:
            raise RuntimeError("gate_up is interleaved already")
        w = self.gate_up_proj.weight
        w.copy_(cuda_linear.interleave_gate_up(w, group))
        self.gate_group = group


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.norms_folded = False

    @torch.no_grad()
    def fold_norms(self) -> None:
        """Fold each RMSNorm's weight into the columns of the linear after it (qkv, gate_up;
        rounded once to the weight's dtype) and make the norm's weight one: the same layer,
        whose norms the linears can then apply themselves (`Linear`'s `norm`)."""
        for norm, linear in ((self.input_layernorm, self.self_attn.qkv_proj),
                             (self.post_attention_layernorm, self.mlp.gate_up_proj)):
            linear.weight.copy_(linear.weight.float() * norm.weight.float()[None, :])
            norm.weight.fill_(1.0)
        self.norms_folded = True

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output, not yet added to `residual` (None before the
        first layer): each residual add is fused into the norm that follows it. With the
        norms folded (`fold_norms`) and rows the linears' Triton kernel takes (a decode
        step), each norm goes into the linear after it and each add into the linear before
        it instead: x is then the whole hidden state, and `residual` comes back None. (More
        rows take the path below, the norms' weights being one.)"""
        if self.norms_folded and skinny_linear.streams(x):
            h = x if residual is None else x + residual
            h = self.self_attn(h, cos, sin, norm=self.input_layernorm, residual=h)
            return self.mlp(h, norm=self.post_attention_layernorm, residual=h), None
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(x, cos, sin), residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]

    def fold_norms(self) -> None:
        """Every layer's norms into its linears (`DecoderLayer.fold_norms`): on a GPU, a decode
        step's linears then apply them (and the residual adds) in their kernel, two launches
        fewer a layer. Once only: the folded weights are the layer's from then on."""
        if any(layer.norms_folded for layer in self.layers):
            raise RuntimeError("the norms are folded already")
        for layer in self.layers:
            layer.fold_norms()

    def interleave_gate_up(self) -> None:
        """Every MLP's gate_up rows in the CUDA kernel's gated order (`MLP.interleave_gate_up`):
        on a GPU that runs `cuda_linear`, a decode step's gate_up then applies the SiLU too."""
        for layer in self.layers:
            layer.mlp.interleave_gate_up()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's output in the model's dtype: a float32 copy of bf16 logits holds the
        same values, so the sampler reads them as they are (a decode step's cast was a launch:
        4.1 us at 3 x 128256 on an H100, results/omnikv_fold_heads_s59_h100.jsonl) and the
        callers that keep logits cast them."""
        return self.lm_head(hidden)
