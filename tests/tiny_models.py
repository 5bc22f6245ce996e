"""A tiny Qwen3 and a word-level tokenizer, saved to a directory: what the real training-loop
tests (TRL, verl) load as a model id, with no hub and no network."""

from __future__ import annotations

import torch

SPECIALS = {"<pad>": 0, "<eos>": 1, "<unk>": 2}


def words(vocab: int) -> list[str]:
    """The tokenizer's words after its three special tokens: w0, w1, ..."""
    return [f"w{i}" for i in range(vocab - len(SPECIALS))]


def save_tiny_qwen3(path, vocab: int, **config) -> None:
    """A one-layer Qwen3 of hidden size 32 over `vocab` ids (seeded) and its tokenizer, in
    `path`; `config` overrides Qwen3Config fields (e.g. tie_word_embeddings=True)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    ids = SPECIALS | {w: i + len(SPECIALS) for i, w in enumerate(words(vocab))}
    backend = Tokenizer(models.WordLevel(ids, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    torch.manual_seed(0)
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=16)  # fmt: skip
    ids_config = dict(pad_token_id=0, eos_token_id=1, bos_token_id=None)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, **sizes, **ids_config, **config))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
