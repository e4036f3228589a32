"""A tiny random hybrid Qwen3.5 target with a real tokenizer, built on disk once.

Used by the drill, the rehearsal server and the tests: no hub download, seconds on a CPU. The
config is KERNELS.md's CPU test config (3 Gated DeltaNet layers + 1 full-attention layer per 4),
the tokenizer a byte-level BPE trained here with `tokenizers` on the shipped prompts and a little
code, saved as a `PreTrainedTokenizerFast` with a Qwen-style chat template.

    python -m remote.drill.tinymodel OUT_DIR [--layers 4] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
VOCAB_SIZE = 1024

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CODE_CORPUS = '''
def fizzbuzz(n):
    for i in range(1, n + 1):
        if i % 15 == 0:
            print("FizzBuzz")
        elif i % 3 == 0:
            print("Fizz")
        elif i % 5 == 0:
            print("Buzz")
        else:
            print(i)

def binary_search(items, target):
    lo, hi = 0, len(items) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1

class Node:
    def __init__(self, value, next=None):
        self.value = value
        self.next = next

def reverse(head):
    prev = None
    while head is not None:
        head.next, prev, head = prev, head, head.next
    return prev

import asyncio, json, collections
from typing import Optional, List, Dict
'''


def _corpus() -> list[str]:
    texts = [_CODE_CORPUS]
    prompts = Path(__file__).resolve().parents[1] / "data" / "prompts.jsonl"
    if prompts.is_file():
        for line in prompts.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                for message in record.get("messages", []):
                    texts.append(message.get("content", ""))
                texts.append(record.get("text", ""))
    texts.append("Write a Python function. Explain the algorithm and its complexity.")
    return texts


def build_tokenizer(out_dir: Path):
    """Train a byte-level BPE tokenizer and save it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|mask|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def tiny_config(num_layers: int = 4, vocab_size: int = VOCAB_SIZE):
    """KERNELS.md's CPU-sized hybrid config: every 4th layer full attention, the rest linear."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        eos_token_id=2,
        pad_token_id=0,
        bos_token_id=None,
    )


def gpu_config(vocab_size: int):
    """The GPU drill's target: the ~2 B benchmark model's layer shapes (head dims, 24 hybrid layers:
    every 4th full attention) with the drill tokenizer's vocabulary, ~1.7 B parameters, ~3.4 GB in
    bf16: big enough that the load, the copy to the GPU and the release take measurable time."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        max_position_embeddings=8192, tie_word_embeddings=False, bos_token_id=None,
    )


def build_tiny_target(out_dir: str | os.PathLike, num_layers: int = 4, seed: int = 0, gpu: bool = False) -> Path:
    """Build the tiny target at `out_dir` unless a complete one is already there; return its path.

    Built in a temporary sibling directory and renamed, so an interrupted build leaves nothing that
    looks complete. `gpu`: the GPU drill's few-GB target (`gpu_config`), initialised on the GPU.
    """
    import torch
    from transformers import Qwen3_5ForCausalLM

    out = Path(out_dir)
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tokenizer = build_tokenizer(tmp)
        torch.manual_seed(seed)
        config = gpu_config(len(tokenizer)) if gpu else tiny_config(num_layers, vocab_size=len(tokenizer))
        config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        config.pad_token_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
        with torch.device("cuda" if gpu else "cpu"):  # seconds on a GPU, minutes on a CPU for 1.7 B
            model = Qwen3_5ForCausalLM(config).to(torch.bfloat16)
        # The init zeroes the pad token's embedding row (padding_idx); no trained model has one, and a
        # pad token in a completion would then give all-zero hidden states, which the extractor flags.
        with torch.no_grad():
            embed = model.get_input_embeddings().weight
            row = torch.randn(embed.shape[1], generator=torch.Generator().manual_seed(seed + 1)) * 0.02
            embed[config.pad_token_id] = row.to(embed.dtype).to(embed.device)
        model.save_pretrained(tmp, safe_serialization=True)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gpu", action="store_true", help="the GPU drill's ~1.7 B target, built on the GPU")
    args = parser.parse_args()
    print(build_tiny_target(args.out_dir, args.layers, args.seed, args.gpu))


if __name__ == "__main__":
    main()
