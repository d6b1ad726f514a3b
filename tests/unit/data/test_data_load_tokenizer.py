"""The built-in byte tokenizer and load_tokenizer: exact bytes, specials, chat template, save/load."""

import pytest
from transformers import AutoTokenizer

from ndparallel import DataError
from ndparallel.data.load_tokenizer import byte_tokenizer, load_tokenizer

TEXTS = [
    "plain ASCII, with  two spaces\nand a newline\t tab",
    "non-ASCII: déjà vu, Straße, 日本語, Ελληνικά",
    "emoji 🙂🚀 and a family 👨‍👩‍👧 (zero-width joiners)",
    "control bytes \x00\x01\x7f and a lone space at the end ",
    "",
]


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


@pytest.mark.parametrize("text", TEXTS)
def test_ids_are_exactly_the_utf8_bytes_and_decode_back(tokenizer, text):
    ids = tokenizer(text)["input_ids"]  # add_special_tokens=True too: nothing is added
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text


def test_special_tokens_and_small_vocabulary(tokenizer):
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|endoftext|>", 256)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|pad|>", 257)
    chat = tokenizer.convert_tokens_to_ids(["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"])
    assert chat == [258, 259, 260, 261]
    assert len(tokenizer) == 262 < 300
    # Special tokens written in text are one token each, not their bytes.
    assert tokenizer("a<|endoftext|>b")["input_ids"] == [97, 256, 98]


def test_chat_template_renders_turns_and_generation_prompt(tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hé"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == "<|user|>\nhi<|end|>\n<|assistant|>\nhé<|end|>\n"
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|user|>\nhi<|end|>\n<|assistant|>\n"


def test_save_and_load_round_trip(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS:
        assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert (loaded.eos_token_id, loaded.pad_token_id, len(loaded)) == (256, 257, 262)
    messages = [{"role": "user", "content": "x"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert loaded.apply_chat_template(messages, tokenize=False) == rendered
    # and through load_tokenizer, which is what the config uses
    assert load_tokenizer(str(tmp_path))("é")["input_ids"] == [0xC3, 0xA9]


def test_load_tokenizer_byte_and_none():
    assert load_tokenizer(None).eos_token_id == 256
    assert load_tokenizer("byte").pad_token_id == 257


def test_load_tokenizer_missing_directory_names_the_setting(tmp_path):
    with pytest.raises(DataError, match=r"tokenizer_config \(or base_model\) = .*nope.* is not a local directory"):
        load_tokenizer(str(tmp_path / "nope"))


def test_load_tokenizer_directory_without_tokenizer_files(tmp_path):
    (tmp_path / "README.md").write_text("no tokenizer here")
    with pytest.raises(DataError, match="no tokenizer could be loaded"):
        load_tokenizer(str(tmp_path))


def test_missing_pad_token_falls_back_to_eos(tmp_path):
    tokenizer = byte_tokenizer()
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.pad_token_id == loaded.eos_token_id == 256
