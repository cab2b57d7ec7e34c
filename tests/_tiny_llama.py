"""The small fp32 transformers Llama (random weights, nothing downloaded) and prompts the GPU tests share."""

from __future__ import annotations

import torch

VOCAB = 1000


def tiny_llama(transformers, device="cuda"):
    """fp32 keeps greedy argmax ties away: graphed and eager decoding must give identical tokens."""
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                   max_position_embeddings=256)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.LlamaForCausalLM(cfg).eval()


def prompt(b, length, seed=0, device="cuda"):
    g = torch.Generator(device).manual_seed(seed + b)
    return torch.randint(0, VOCAB, (b, length), device=device, generator=g)
