"""Records -> examples: which tokens are trained for each dataset type, and the long-rows policy."""

import pytest
from tokenizers import processors

from ndparallel import DataError
from ndparallel.data.examples import Example
from ndparallel.data.load_tokenizer import byte_tokenizer
from ndparallel.data.sources import ChatRecord, InstructionRecord, TextRecord
from ndparallel.data.tokenize import ALPACA_PROMPT, ALPACA_PROMPT_WITH_INPUT, RecordTokenizer, fit_long_rows

EOS = 256
IGNORE = -100


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


def trained_text(tokenizer, example):
    return tokenizer.decode([t for t, label in zip(example.input_ids, example.labels) if label != IGNORE])


def test_completion_trains_every_token_and_ends_with_eos(tokenizer):
    example = RecordTokenizer(tokenizer)(TextRecord("héllo", "x"))
    assert example.input_ids == list("héllo".encode()) + [EOS]
    assert example.labels == example.input_ids


def test_bos_is_prepended_when_the_tokenizer_adds_one():
    tokenizer = byte_tokenizer()
    tokenizer.bos_token = "<|system|>"  # id 258, added in front of every encoded text by the post-processor
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|system|> $A", special_tokens=[("<|system|>", 258)]
    )
    example = RecordTokenizer(tokenizer)(TextRecord("ab", "x"))
    assert example.input_ids == [258, 97, 98, EOS]


@pytest.mark.parametrize("given, template", [("", ALPACA_PROMPT), ("1 1", ALPACA_PROMPT_WITH_INPUT)])
def test_alpaca_trains_only_the_output_and_eos(tokenizer, given, template):
    example = RecordTokenizer(tokenizer)(InstructionRecord("add", given, "2 é", "x"))
    prompt = template.format(instruction="add", input=given)
    assert tokenizer.decode(example.input_ids) == prompt + "2 é<|endoftext|>"
    assert example.labels[: len(prompt.encode())] == [IGNORE] * len(prompt.encode())
    assert example.labels[len(prompt.encode()) :] == list("2 é".encode()) + [EOS]


def test_chat_trains_only_assistant_turns_over_several_turns(tokenizer):
    messages = (
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hé"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "ok 🙂"},
    )
    example = RecordTokenizer(tokenizer)(ChatRecord(messages, "x"))
    assert tokenizer.decode(example.input_ids) == tokenizer.apply_chat_template(list(messages), tokenize=False)
    # Each assistant turn's content and its end-of-turn are trained; headers, system and user turns are not.
    assert trained_text(tokenizer, example) == "hé<|end|>\nok 🙂<|end|>\n"
    labels = example.labels
    spans = [i for i in range(len(labels)) if labels[i] != IGNORE and (i == 0 or labels[i - 1] == IGNORE)]
    assert len(spans) == 2
    assert tokenizer.decode(example.input_ids[: spans[0]]).endswith("<|assistant|>\n")


def test_chat_opening_with_an_assistant_turn_trains_all_of_it(tokenizer):
    messages = ({"role": "assistant", "content": "welcome"}, {"role": "user", "content": "thanks"})
    example = RecordTokenizer(tokenizer)(ChatRecord(messages, "x"))
    assert trained_text(tokenizer, example) == "<|assistant|>\nwelcome<|end|>\n"


def test_chat_needs_a_chat_template():
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(DataError, match=r"x line 1: tokenizer 'byte' has no chat template.* set chat_template:"):
        RecordTokenizer(tokenizer)(ChatRecord(({"role": "user", "content": "q"},), "x line 1"))


def test_chat_template_that_rewrites_earlier_turns_is_refused():
    tokenizer = byte_tokenizer()
    # The number of messages is written at the start: every longer prefix changes the first tokens.
    tokenizer.chat_template = "{{ messages|length }}{% for m in messages %}|{{ m['content'] }}{% endfor %}"
    messages = ({"role": "user", "content": "q"}, {"role": "assistant", "content": "a"})
    with pytest.raises(DataError, match=r"not prefix-stable \(rendering messages 1\.\.2 changes"):
        RecordTokenizer(tokenizer)(ChatRecord(messages, "x"))


def test_chat_template_errors_name_the_record(tokenizer):
    messages = ({"role": "tool", "content": "{}"},)
    with pytest.raises(DataError, match=r"f\.jsonl line 3: the chat template failed on this conversation \(.*tool"):
        RecordTokenizer(tokenizer)(ChatRecord(messages, "f.jsonl line 3"))


def examples_of_lengths(*lengths):
    return [Example(list(range(n)), list(range(n))) for n in lengths]


def test_long_rows_error_says_how_many_and_what_to_do():
    expected = (
        r"^2 of 4 examples are longer than sequence_len=5 \(longest 9 tokens\); raise sequence_len, "
        r"or set long_rows \(excess_length_strategy\) to truncate\|drop\|split$"
    )
    with pytest.raises(DataError, match=expected):
        fit_long_rows(examples_of_lengths(3, 9, 5, 6), 5)


def test_long_rows_truncate_and_drop():
    examples = examples_of_lengths(3, 9, 5, 6)
    truncated = fit_long_rows(examples, 5, "truncate")
    assert [list(e.input_ids) for e in truncated] == [[0, 1, 2], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]
    assert [list(e.labels) for e in truncated] == [list(e.input_ids) for e in truncated]
    dropped = fit_long_rows(examples, 5, "drop")
    assert list(dropped.lengths) == [3, 5]
    split = fit_long_rows(examples, 5, "split", min_len=4)
    assert list(split.lengths) == [5, 4, 5, 5, 1]  # 3 is shorter than min_len; 9 -> 5 + 4; 6 -> 5 + 1
    with pytest.raises(DataError, match="long_rows='cut' is not a policy; use one of error, truncate, drop, split"):
        fit_long_rows(examples, 5, "cut")
