"""A run's tokenizer as a Hugging Face tokenizer with the same ids (what ml-to-hf writes beside the
weights), for every tokenizer type that a HF fast tokenizer can express:

  ByteTokenizer           a byte-level BPE of the 256 bytes (GPT-2's byte-to-character map), no merges
  SentencePieceTokenizer  transformers' converter of the SentencePiece model, following the model's
                          own normalizer settings (encodes as SentencePieceProcessor.encode does)
  TikTokenizer            the byte-level BPE of its ranks (shifted past the special tokens, as
                          Megatron-LM numbers them), the special tokens at ids 0 .. N-1; the legacy
                          tokenizer encodes special-token text as plain text, as ours does
  GPT2BPETokenizer        GPT-2's vocab.json and merges.txt
  HuggingFaceTokenizer    itself
NullTokenizer has no text: nothing is written for it.
"""
from __future__ import annotations

from typing import Optional, Tuple

from megatron_lite.data.tokenizers import TOKENIZER_TYPES, TOKENIZER_FIELDS, build_tokenizer


def hf_tokenizer(data: dict) -> Tuple[Optional[object], Optional[str]]:
    """(a HF tokenizer equal to the run's, None) or (None, why not) from a run's tokenizer settings."""
    kind, model = TOKENIZER_TYPES.get(data.get("tokenizer_type"), data.get("tokenizer_type")), data.get("tokenizer_model")
    if kind == "ByteTokenizer":
        return byte_level_hf_tokenizer(), None
    if kind == "HuggingFaceTokenizer" and model:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(model, local_files_only=True), None
    if kind == "GPT2BPETokenizer" and data.get("vocab_file") and data.get("merge_file"):
        from transformers import GPT2TokenizerFast
        return GPT2TokenizerFast(data["vocab_file"], data["merge_file"]), None
    if kind == "SentencePieceTokenizer" and model:
        return sentencepiece_hf_tokenizer(model), None
    if kind == "TikTokenizer" and model:
        ours = build_tokenizer(**{k: data[k] for k in TOKENIZER_FIELDS if data.get(k) is not None})
        return tiktoken_hf_tokenizer(ours), None
    return None, ("the checkpoint records no tokenizer" if not kind else f"{kind} is not written as a HF tokenizer")


def _fast(tokenizer, **tokens):
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, clean_up_tokenization_spaces=False, **tokens)


def byte_level_hf_tokenizer():
    """ByteTokenizer as a HF fast tokenizer with the same ids: the 256 bytes (GPT-2's byte-to-character
    map, no merges) and <|endoftext|> = 256 as eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    chars = {b: chr(b if b in printable else next(extra)) for b in range(256)}
    tok = Tokenizer(models.BPE(vocab={c: b for b, c in chars.items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return _fast(tok, eos_token="<|endoftext|>", split_special_tokens=True)  # "<|endoftext|>" in a text is bytes


def sentencepiece_hf_tokenizer(model_file: str):
    """A SentencePiece model (BPE or unigram) as a HF fast tokenizer; eos </s> as our eod."""
    from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf

    proto = import_protobuf().ModelProto()
    with open(model_file, "rb") as f:
        proto.ParseFromString(f.read())
    pieces = proto.pieces
    bpe = proto.trainer_spec.model_type == 2  # (1: unigram)
    # (unigram: SentencePiece never segments a text into its control or unknown pieces, such as "</s>")
    vocab = {p.piece: i for i, p in enumerate(pieces)} if bpe else \
        [(p.piece, -1e9 if p.type in (2, 3) else p.score) for p in pieces]
    tok = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab)
    tok.encode_special_tokens = True  # SentencePiece never reads its control pieces ("</s>") out of a text
    spec = proto.trainer_spec
    named = {"eos_token": spec.eos_id, "bos_token": spec.bos_id, "unk_token": spec.unk_id, "pad_token": spec.pad_id}
    return _fast(tok, split_special_tokens=True, **{k: pieces[i].piece for k, i in named.items() if 0 <= i < len(pieces)})


def tiktoken_hf_tokenizer(ours):
    """Our TikTokenizer as a HF fast tokenizer with its ids: the byte-level BPE of its (shifted) ranks
    with tiktoken's pattern, the special tokens at their ids; eos </s>."""
    from tokenizers import AddedToken, Tokenizer, models
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class Converter(TikTokenConverter):
        def load_tiktoken_bpe(self, _):
            return ours._enc._mergeable_ranks

        def tokenizer(self):
            vocab, merges = self.extract_vocab_merges_from_model(None)
            vocab.update({t: i for i, t in enumerate(ours.special_tokens)})
            tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False))
            tok.model.ignore_merges = True  # as tiktoken: a whole piece in the vocabulary is one token
            return tok

    tok = Converter(pattern=ours._enc._pat_str).converted()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in ours.special_tokens])
    # The legacy tokenizer encodes "</s>" in a text as plain text (encode_ordinary), the default one as its id
    return _fast(tok, eos_token="</s>", bos_token="<s>", unk_token="<unk>", split_special_tokens=ours.legacy)
