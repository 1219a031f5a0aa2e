from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny-qwen3"
DATA = ROOT / "examples" / "data"


@pytest.fixture(scope="session")
def tiny_tok():
    from backends.common.data import load_tokenizer

    return load_tokenizer(TINY)


def build_tokenizer(special_tokens, chat_template=None, eos=None, bos=None):
    """A small byte-level BPE tokenizer (trained in memory) with the given special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(special_tokens), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["Hello there, how are you?", "The answer is 42.", "What is 2 + 2? It is 4.", "system user assistant",
              "Hi Hello Bye Ciao S", "You are a helpful assistant."] * 20
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=bos)
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast


@pytest.fixture
def make_tokenizer():
    return build_tokenizer


def write_synthetic(prefix, lengths, with_labels=False, seed=0):
    """Sequences whose first token is (index + 1000): each sample is identifiable in a batch."""
    from backends.common.data.indexed import IndexedDatasetWriter

    rng = np.random.default_rng(seed)
    ids_w = IndexedDatasetWriter(prefix, np.int32)
    lab_w = IndexedDatasetWriter(str(prefix) + "_labels", np.int32) if with_labels else None
    for i, n in enumerate(lengths):
        seq = rng.integers(1, 900, size=n)
        seq[0] = 1000 + i
        ids_w.add_document(seq)
        if lab_w is not None:
            lab = seq.copy()
            lab[: n // 2] = -100
            lab_w.add_document(lab)
    ids_w.finalize()
    if lab_w is not None:
        lab_w.finalize()


@pytest.fixture
def synthetic(tmp_path):
    from backends.common.data import TokenDataset

    def make(lengths, seq_len, with_labels=False, name="syn"):
        prefix = str(tmp_path / name)
        write_synthetic(prefix, lengths, with_labels)
        return TokenDataset(prefix, prefix + "_labels" if with_labels else None, seq_len,
                            "instruction" if with_labels else "text")

    return make
