"""Small tokenizers built locally (no Hub access), for toy tasks and tests."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)


def build_char_tokenizer(chars: str) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: every character of ``chars`` is one token.

    Ids 0-3 are ``<pad>``, ``<s>``, ``</s>``, ``<unk>``; the characters follow in the order given
    (duplicates dropped). Characters outside ``chars`` map to ``<unk>``. No BOS/EOS is added on
    encode: callers (e.g. the addition dataset) place them explicitly.
    """
    vocab: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in chars:
        if ch not in vocab:
            vocab[ch] = len(vocab)
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token=UNK))
    # Split into single characters (whitespace included) so each char is one WordLevel "word".
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    # Fuse joins tokens with "" (the default WordPiece-style decode would insert spaces).
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="right",
        # Cleanup would rewrite " ," -> "," etc.; a char tokenizer must decode exactly what it encoded.
        clean_up_tokenization_spaces=False,
    )
