"""A stand-in tokenizer for random-weight ("dummy") models shipped as a bare config.json.

Benchmarks and GPU tests run real architectures with random weights and token-id prompts; text
does not matter there, but the engine still detokenizes. Token ``i`` is the word ``t{i}``.
"""

from __future__ import annotations

from typing import Any


def synthetic_tokenizer(vocab_size: int, eos_token_id: int | None = None) -> Any:
    # NOTE: the tokenizers library loads only where a tokenizer is built.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    eos = 1 if eos_token_id is None else eos_token_id
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=f"t{eos}", unk_token="t0", pad_token="t0"
    )
