"""Tokenizers: a built-in byte-level tokenizer for tests and tiny models, and loading one from a directory.

The byte tokenizer needs no download: token ids 0..255 are the UTF-8 byte values of the text, so any
string round-trips exactly and a model of vocabulary 262 can be trained on any text. Its special tokens:

==========  =================  ===========================================
id          token              use
==========  =================  ===========================================
256         ``<|endoftext|>``  end of a document (eos)
257         ``<|pad|>``        padding
258..261    ``<|system|>``,    the chat template's role headers and
            ``<|user|>``,      end of turn
            ``<|assistant|>``,
            ``<|end|>``
==========  =================  ===========================================
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from ndparallel.errors import DataError, NdParallelError
from ndparallel.safe_io.hub import model_dir

logger = logging.getLogger(__name__)

BYTE_TOKENIZER_NAME = "byte"
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
CHAT_ROLES = ("system", "user", "assistant")
END_OF_TURN = "<|end|>"
CHAT_TOKENS = tuple(f"<|{role}|>" for role in CHAT_ROLES) + (END_OF_TURN,)

# Each turn is "<|role|>\n{content}<|end|>\n"; a generation prompt is the assistant header alone. Every turn
# only appends text, so rendering a conversation prefix by prefix gives each message's tokens exactly.
BYTE_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('the byte tokenizer chat template knows the roles system, user and assistant, not '"
    " ~ message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _byte_to_char() -> dict[int, str]:
    """The printable character standing for each byte value, as the ByteLevel pre-tokenizer writes it.

    ByteLevel maps printable Latin-1 bytes to themselves and the other bytes, in order, to code points
    from 256 up (the GPT-2 convention), so that every byte is one visible vocabulary entry.
    """
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    mapping: dict[int, str] = {}
    shifted = 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + shifted)
            shifted += 1
    return mapping


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer built in code: ids 0..255 are the UTF-8 bytes, then the special tokens.

    A BPE model without merges over the 256 ByteLevel characters, so encoding never merges bytes and
    decoding turns the byte characters back into UTF-8. The chat template is ``BYTE_CHAT_TEMPLATE``.
    """
    vocab = {char: byte for byte, char in _byte_to_char().items()}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split: the whole text is one "word" of single bytes; splitting would change nothing but speed.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        name_or_path=BYTE_TOKENIZER_NAME,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=list(CHAT_TOKENS),
    )
    tokenizer.chat_template = BYTE_CHAT_TEMPLATE
    return tokenizer


def load_tokenizer(
    name_or_path: str | Path | None,
    *,
    revision: str | None = None,
    tokenizer_type: str | None = None,
    trust_remote_code: bool = False,
) -> PreTrainedTokenizerBase:
    """The tokenizer named by the ``tokenizer_config`` (or ``base_model``) setting.

    ``None`` or ``"byte"`` gives :func:`byte_tokenizer`; anything else is a local directory or a hub id whose
    tokenizer files are in the hub cache (``ndparallel.safe_io.hub``), read by ``AutoTokenizer`` or by the transformers
    class ``tokenizer_type`` names. A tokenizer without a pad token gets its eos token as pad token: padding is
    masked out of attention and loss, so any id works, and reusing eos keeps the vocabulary (and the model's
    embedding size) unchanged.
    """
    if name_or_path is None or str(name_or_path) == BYTE_TOKENIZER_NAME:
        return byte_tokenizer()
    try:
        path = model_dir(
            str(name_or_path),
            revision=revision,
            weights=False,
            trust_remote_code=trust_remote_code,
            setting="tokenizer_config (or base_model)",
        )
    except NdParallelError as error:
        raise DataError(str(error)) from None
    if not path.is_dir():
        raise DataError(
            f"tokenizer_config (or base_model) = {str(name_or_path)!r} is not a local directory; point it at a "
            f"directory holding tokenizer.json / tokenizer_config.json (a saved model), a hub id, or use 'byte'"
        )
    loader = _tokenizer_class(tokenizer_type)
    try:
        tokenizer = loader.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise DataError(
            f"tokenizer_config (or base_model) = {str(path)!r}: no tokenizer could be loaded ({reason}); the "
            f"directory needs tokenizer.json or the files of a slow tokenizer, as save_pretrained writes them"
        ) from error
    ensure_pad_token(tokenizer)
    return tokenizer


def _tokenizer_class(name: str | None):
    """The transformers tokenizer class ``tokenizer_type`` names (AutoTokenizer when unset)."""
    if name is None or name == "AutoTokenizer":
        return AutoTokenizer
    import transformers

    loader = getattr(transformers, name, None) if name.endswith(("Tokenizer", "TokenizerFast")) else None
    if loader is None or not hasattr(loader, "from_pretrained"):
        raise DataError(
            f"tokenizer_type {name!r} is not a transformers tokenizer class; use AutoTokenizer or a "
            f"class such as PreTrainedTokenizerFast, LlamaTokenizerFast"
        )
    return loader


def add_config_tokens(
    tokenizer: PreTrainedTokenizerBase, special_tokens: dict[str, Any] | None, tokens: list[str] | None
) -> list[str]:
    """Axolotl's ``special_tokens`` and ``tokens``: set bos/eos/pad/unk, add the others; returns the tokens that
    were new to the vocabulary (the model's embeddings must grow by that many)."""
    before = set(tokenizer.get_vocab())
    specials = {k: v for k, v in (special_tokens or {}).items() if v is not None}
    extra = list(specials.pop("additional_special_tokens", None) or [])
    for key, token in specials.items():
        tokenizer.add_special_tokens({key: AddedToken(token, rstrip=False, lstrip=False, normalized=False)})
    if extra:  # special: never split, as Axolotl's additional_special_tokens
        tokenizer.add_tokens(
            [AddedToken(t, rstrip=False, lstrip=False, normalized=False) for t in extra], special_tokens=True
        )
    if tokens:
        tokenizer.add_tokens([AddedToken(t, rstrip=False, lstrip=False, normalized=False) for t in tokens])
    vocab = tokenizer.get_vocab()
    return sorted((t for t in vocab if t not in before), key=vocab.get)


def ensure_pad_token(tokenizer: PreTrainedTokenizerBase) -> int:
    """The pad token id, set to the eos token's when the tokenizer has no pad token."""
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise DataError(
                f"tokenizer {tokenizer.name_or_path!r} has neither a pad nor an eos token; add "
                f'"pad_token": "..." to its tokenizer_config.json'
            )
        tokenizer.pad_token = tokenizer.eos_token
        logger.info("tokenizer %s has no pad token; padding with eos %r", tokenizer.name_or_path, tokenizer.eos_token)
    return int(tokenizer.pad_token_id)
