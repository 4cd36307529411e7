"""Tiny random pooling models built from transformers' own config classes, and
sentence-transformers pipelines built on them, saved to folders (no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = (
    SPECIALS
    + [f"w{i}" for i in range(120)]
    + ("the a cat dog sat on mat hello world paris is capital of france what where how".split())
)

TEXTS = [
    "hello world",
    "the cat sat on the mat",
    "what is the capital of france",
    "paris is the capital of france",
    " ".join(f"w{i % 120}" for i in range(70)),  # several blocks of 16
    "dog",
]


def tokenizer(folder: Path):
    from transformers import BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    return BertTokenizerFast(vocab={w: i for i, w in enumerate(WORDS)})


def bert_config(**kw):
    from transformers import BertConfig

    base = dict(
        vocab_size=len(WORDS), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=256, pad_token_id=0,
    )  # fmt: skip
    return BertConfig(**{**base, **kw})


def qwen3_config(**kw):
    from transformers import Qwen3Config

    base = dict(
        vocab_size=len(WORDS), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=96, max_position_embeddings=256,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=2, eos_token_id=3,
    )  # fmt: skip
    return Qwen3Config(**{**base, **kw})


def save_hf(model, folder: Path, seed_tokenizer_dir: Path) -> Path:
    """Save ``model`` (float32) with the tiny tokenizer into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer(seed_tokenizer_dir).save_pretrained(folder)
    return folder


def randomize(model, seed: int = 0, scale: float = 0.2):
    """Weights of a useful scale (transformers' init is close to zero for some of them)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(scale * torch.randn(p.shape, generator=gen))
    return model.eval()


def st_pipeline(hf_dir: Path, out: Path, pooling: str, normalize: bool) -> Path:
    """A sentence-transformers pipeline (Transformer, Pooling, optional Normalize) over the
    model in ``hf_dir``, saved to ``out``."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    t = Transformer(str(hf_dir))
    mods = [t, Pooling(t.get_embedding_dimension(), pooling_mode=pooling)]
    if normalize:
        mods.append(Normalize())
    SentenceTransformer(modules=mods, device="cpu").save(str(out))
    return out
