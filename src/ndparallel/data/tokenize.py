"""Records -> examples: token ids and labels, -100 where no loss is taken.

- ``TextRecord`` (completion, pretrain files): every token trained, eos appended.
- ``InstructionRecord`` (alpaca): the prompt of ``ALPACA_PROMPT`` / ``ALPACA_PROMPT_WITH_INPUT`` is not
  trained, the output and the eos after it are. Prompt and output are tokenized apart, so the boundary
  between them is exact.
- ``ChatRecord``: rendered with the tokenizer's chat template. The conversation is rendered prefix by
  prefix; each rendering must extend the previous one (DataError otherwise), and the tokens an assistant
  message adds after its generation prompt (the assistant header) are trained. The template decides how a
  turn ends, so no eos is appended.

A bos token is prepended where the tokenizer itself would add one (for completion and alpaca; chat
templates write their own).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence

import jinja2
from transformers import PreTrainedTokenizerBase

from ndparallel.data.examples import IGNORE_INDEX, Example, ExampleStore, example_lengths
from ndparallel.data.sources import ChatRecord, InstructionRecord, Record, TextRecord
from ndparallel.data.spec import DatasetSpec
from ndparallel.errors import DataError

ALPACA_PROMPT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request."
    "\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)
ALPACA_PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request."
    "\n\n### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
LONG_ROWS_POLICIES = ("error", "truncate", "drop", "split")

logger = logging.getLogger(__name__)


class RecordTokenizer:
    """Turns records into examples with one tokenizer (what it adds by itself is probed once).

    ``spec`` (optional) brings the chat options: the template source (default: the tokenizer's), extra
    template variables, the roles whose turns are trained, and ``train_on_inputs`` (train every token).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, spec: DatasetSpec | None = None) -> None:
        self.tokenizer = tokenizer
        self.bos = self._leading_bos()
        self.template = (spec.chat_template if spec else None) or tokenizer.chat_template
        self.template_kwargs = dict(spec.template_kwargs) if spec else {}
        self.trained_roles = set(spec.roles_to_train) if spec else {"assistant"}
        self.train_on_inputs = bool(spec and spec.train_on_inputs)
        self.trace_key = spec.template_thinking_key if spec else "reasoning_content"

    def __call__(self, record: Record) -> Example:
        if isinstance(record, TextRecord):
            ids = self.bos + self._encode(record.text) + self._eos(record)
            return Example(ids, list(ids))
        if isinstance(record, InstructionRecord):
            template = ALPACA_PROMPT_WITH_INPUT if record.input else ALPACA_PROMPT
            prompt = self.bos + self._encode(template.format(instruction=record.instruction, input=record.input))
            answer = self._encode(record.output) + self._eos(record)
            prompt_labels = prompt if self.train_on_inputs else [IGNORE_INDEX] * len(prompt)
            return Example(prompt + answer, prompt_labels + answer)
        return self._chat(record)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _leading_bos(self) -> list[int]:
        bos = self.tokenizer.bos_token_id
        if bos is None:
            return []
        probe = self.tokenizer("a", add_special_tokens=True)["input_ids"]
        return [bos] if probe and probe[0] == bos else []

    def _eos(self, record: Record) -> list[int]:
        eos = self.tokenizer.eos_token_id
        if eos is None:
            raise DataError(
                f"{record.where}: tokenizer {self.tokenizer.name_or_path!r} has no eos token to end documents with; "
                f'add "eos_token" to its tokenizer_config.json'
            )
        return [eos]

    def _chat(self, record: ChatRecord) -> Example:
        if not self.template:
            raise DataError(
                f"{record.where}: tokenizer {self.tokenizer.name_or_path!r} has no chat template, which "
                f"chat_template datasets need; set chat_template: in the config or use a tokenizer that has one"
            )
        messages = list(record.messages)
        ids: list[int] = []
        labels: list[int] = []
        for index, message in enumerate(messages):
            trained = self.train_on_inputs or message["role"] in self.trained_roles
            if message["role"] == "assistant" and index > 0:  # the assistant header is prompt, not answer
                header = self._render(messages[:index], record, generation_prompt=True)
                self._extend(ids, labels, header, trained=self.train_on_inputs, record=record, index=index)
            rendering = self._render(messages[: index + 1], record, generation_prompt=False)
            self._extend(ids, labels, rendering, trained=trained, record=record, index=index)
        return Example(ids, labels)

    def _render(self, messages: list[dict[str, str]], record: ChatRecord, *, generation_prompt: bool) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=generation_prompt,
                chat_template=self.template,
                **self.template_kwargs,
            )
        except jinja2.TemplateError as error:
            raise DataError(
                f"{record.where}: the chat template failed on this conversation ({error}); fix the record or "
                f"the chat_template"
            ) from None
        trace = "" if generation_prompt else messages[-1].get(self.trace_key, "")
        if trace and trace.strip() not in text:  # a trace the template does not read would vanish silently
            raise DataError(
                f"{record.where}: message {len(messages)} has a reasoning trace, but the chat template does not "
                f"render it from the key {self.trace_key!r}; set the dataset's template_thinking_key to the key "
                f"the template reads (Qwen3: reasoning_content, gpt-oss: thinking), or use a template that renders it"
            )
        return self._encode(text)

    @staticmethod
    def _extend(
        ids: list[int], labels: list[int], rendering: list[int], *, trained: bool, record: ChatRecord, index: int
    ) -> None:
        """Append what ``rendering`` adds to the tokens so far; it must start with them."""
        if rendering[: len(ids)] != ids:
            raise DataError(
                f"{record.where}: the chat template is not prefix-stable (rendering messages 1..{index + 1} changes "
                f"the tokens of the earlier ones), so assistant turns cannot be found; use a chat_template whose "
                f"turns only append text"
            )
        added = rendering[len(ids) :]
        ids.extend(added)
        labels.extend(added if trained else [IGNORE_INDEX] * len(added))


def tokenize_records(
    records: Iterable[Record], tokenizer: PreTrainedTokenizerBase, spec: DatasetSpec | None = None
) -> Iterator[Example]:
    """One example per record, in order (``spec``: the dataset's chat and training options)."""
    encode = RecordTokenizer(tokenizer, spec)
    for record in records:
        yield encode(record)


def fit_long_rows(
    examples: Sequence[Example], seq_len: int, policy: str = "error", *, min_len: int = 1
) -> ExampleStore:
    """Examples of ``min_len`` to ``seq_len`` tokens: shorter ones are left out, longer ones handled by ``policy``.

    ``error`` (default) refuses longer examples, ``truncate`` keeps their first ``seq_len`` tokens, ``drop``
    leaves them out (Axolotl's default), ``split`` cuts them into ``seq_len`` pieces (each piece's positions
    restart at 0: the last token of a piece predicts nothing).
    """
    if policy not in LONG_ROWS_POLICIES:
        raise DataError(f"long_rows={policy!r} is not a policy; use one of {', '.join(LONG_ROWS_POLICIES)}")
    lengths = example_lengths(examples)
    too_long = [n for n in lengths if n > seq_len]
    if too_long and policy == "error":
        raise DataError(
            f"{len(too_long)} of {len(lengths)} examples are longer than sequence_len={seq_len} (longest "
            f"{max(too_long)} tokens); raise sequence_len, or set long_rows (excess_length_strategy) to "
            f"truncate|drop|split"
        )
    short = sum(1 for n in lengths if n < min_len)
    if too_long or short:
        logger.info(
            "long_rows=%s: %s %d of %d examples longer than sequence_len=%d; %d shorter than %d left out",
            policy,
            {"truncate": "truncated", "split": "split"}.get(policy, "dropped"),
            len(too_long),
            len(lengths),
            seq_len,
            short,
            min_len,
        )
    return ExampleStore.from_examples(_fitted(examples, lengths, seq_len, policy, min_len))


def _fitted(examples, lengths, seq_len: int, policy: str, min_len: int):
    for example, length in zip(examples, lengths):
        if length < min_len or (length > seq_len and policy == "drop"):
            continue
        if length <= seq_len or policy == "truncate":
            yield Example(example.input_ids[:seq_len], example.labels[:seq_len])
            continue
        for start in range(0, length, seq_len):  # split
            yield Example(example.input_ids[start : start + seq_len], example.labels[start : start + seq_len])
