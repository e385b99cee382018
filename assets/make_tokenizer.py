"""Train the course's byte-level BPE tokenizer (2048 tokens) on TinyTales.

Byte-level means every text maps to tokens and back without loss: the 256 bytes are the base
alphabet and BPE merges frequent pairs on top. The one special token <|endoftext|> is bos, eos
and unk at once; the data loader puts it between documents, so encoding adds nothing itself.
The result is saved in Hugging Face format and loads with AutoTokenizer.from_pretrained; the
config is written by hand so that transformers 4 and 5 both read it as a fast tokenizer.
"""

import argparse
import json
import os
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer

EOT = "<|endoftext|>"
HERE = Path(__file__).parent


def read_texts(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def train(texts, vocab_size):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)  # offsets only, adds no tokens
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,  # counts the 256 bytes and the special token too
        special_tokens=[EOT],  # first, so its id is 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=HERE / "datasets" / "tinytales")
    parser.add_argument("--out_dir", type=Path, default=HERE / "tokenizers" / "tinytales")
    parser.add_argument("--vocab_size", type=int, default=2048)
    args = parser.parse_args()

    # The trainer counts pairs on a thread pool, read before its first use; one thread keeps
    # ties between equally frequent pairs in the same order, run after run.
    os.environ["RAYON_NUM_THREADS"] = "1"
    train_texts = read_texts(args.data / "train.jsonl")
    tok = train(train_texts, args.vocab_size)
    if tok.get_vocab_size() != args.vocab_size:
        raise ValueError(
            f"trained vocab has {tok.get_vocab_size()} tokens, wanted {args.vocab_size}: "
            "the corpus has too few distinct words for that many merges"
        )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT,
        "eos_token": EOT,
        "unk_token": EOT,
        "clean_up_tokenization_spaces": False,  # keep decode(encode(text)) == text
    }
    (args.out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")

    hf_tok = AutoTokenizer.from_pretrained(args.out_dir)
    assert hf_tok.is_fast and len(hf_tok) == args.vocab_size, (type(hf_tok), len(hf_tok))
    for text in read_texts(args.data / "validation.jsonl")[:20]:
        ids = hf_tok.encode(text)
        assert hf_tok.eos_token_id not in ids, "encoding must not add bos or eos by itself"
        assert hf_tok.decode(ids) == text, text
    num_tokens = sum(len(ids) for ids in hf_tok(train_texts)["input_ids"])
    per_word = num_tokens / sum(len(text.split()) for text in train_texts)
    print(f"saved {args.out_dir}: vocab {len(hf_tok)}, {EOT} id {hf_tok.eos_token_id}")
    print(f"train: {len(train_texts):,} stories, {num_tokens:,} tokens, {per_word:.3f} per word")


if __name__ == "__main__":
    main()
