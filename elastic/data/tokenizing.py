"""Documents to token ids, on the rank that reads them: a HuggingFace tokenizer (from a
directory or the Hub, never with remote code), or UTF-8 bytes when none is named.

A document's tokens end with its separator (the tokenizer's end-of-sequence token; ``\\n``
for bytes), so that packed documents stay apart. A conversation (``chat``) is rendered with
the tokenizer's chat template, and only its assistant turns are trained on.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import cached_property

import numpy as np

from elastic.data.chat_template import ChatTemplate, TemplateLimit
from elastic.data.documents import Chat, DataError, Document
from elastic.data.recipe import Recipe

# A label that takes no part in the loss (a prompt's tokens, a user's turn), as HuggingFace marks it.
IGNORE_INDEX = -100

# What separates documents when bytes are the tokens: a text file's lines are joined by it too.
BYTE_SEPARATOR = ord("\n")

# The files a HuggingFace tokenizer is read from, whichever it has, besides its class's own
# vocabulary files (``vocab_files_names``): each changes what it does (its vocabulary and
# merges, its special tokens and settings, its added tokens, its chat template).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json")


class ByteTokens:
    """UTF-8 bytes as token ids (a vocabulary of 256), documents ended by a newline."""

    name = "bytes"
    eos_token_id = BYTE_SEPARATOR

    def identity(self) -> str:
        return "utf-8 bytes"

    def encode(self, documents: Sequence[Document]) -> list[tuple[np.ndarray, np.ndarray | None]]:
        encoded = []
        for document in documents:
            if isinstance(document, Chat):
                raise DataError(f"{document.where}: a conversation needs a tokenizer with a chat template; set "
                                "data.tokenizer")
            ids = np.frombuffer(document.encode(), dtype=np.uint8) if isinstance(document, str) else document
            encoded.append((np.append(ids.astype(np.int64), BYTE_SEPARATOR), None))
        return encoded


class HuggingFaceTokens(Recipe):
    """A HuggingFace tokenizer, loaded lazily on the process that encodes (it does not pickle
    small): by name from the Hub or from a directory, with ``trust_remote_code`` off. Its chat
    template renders within ``max_document_bytes`` characters a value and
    ``chat_template_timeout_s`` seconds a rendering (``elastic.data.chat_template``)."""

    _transient = ("tokenizer", "_identity", "_chat_template")

    def __init__(self, name: str, *, max_document_bytes: int, chat_template_timeout_s: float):
        self.name = name
        self.max_document_bytes, self.chat_template_timeout_s = max_document_bytes, chat_template_timeout_s

    @cached_property
    def tokenizer(self):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise DataError("data.tokenizer needs transformers: pip install 'elastic-trainer[tokenizer]'") from None
        try:
            tokenizer = AutoTokenizer.from_pretrained(self.name, trust_remote_code=False)
        except Exception as error:  # transformers raises OSError, ValueError and more for one bad name
            raise DataError(f"tokenizer {self.name!r} cannot be loaded without running its own code or at all "
                            f"({str(error).splitlines()[0][:200]}); name a tokenizer directory or Hub id whose "
                            "tokenizer.json transformers reads itself") from None
        if tokenizer.init_kwargs.get("auto_map"):  # loadable without it, but its author meant its own code to run
            raise DataError(f"tokenizer {self.name!r} asks to run its own code (auto_map in its "
                            "tokenizer_config.json), which is never run here; name a tokenizer that transformers "
                            "reads itself")
        if tokenizer.eos_token_id is None:
            raise DataError(f"tokenizer {self.name!r} has no end-of-sequence token to end documents with; "
                            "name one that has")
        return tokenizer

    @property
    def eos_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    def identity(self) -> str:
        """The tokenizer by what it does, not its name: the same name may tokenize otherwise later."""
        return self._identity

    @cached_property
    def _identity(self) -> str:  # asked for at every index and resume check
        """A sha256 of every file the tokenizer was read from (from its directory, or the Hub's
        cache), and of what was made of them: its whole vocabulary as its backend holds it,
        and its chat template however it came."""
        from transformers.utils import cached_file

        digest = hashlib.sha256()
        for name in sorted({*TOKENIZER_FILES, *self.tokenizer.vocab_files_names.values()}):
            path = cached_file(self.name, name, local_files_only=True, _raise_exceptions_for_missing_entries=False,
                               _raise_exceptions_for_connection_errors=False)
            if path is not None:
                with open(path, "rb") as handle:
                    read = handle.read()
                digest.update(f"{name}\0{len(read)}\0".encode() + read)
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        described = backend.to_str() if backend is not None else repr(sorted(self.tokenizer.get_vocab().items()))
        digest.update(f"{described}\0{self.tokenizer.chat_template or ''}".encode())
        return f"{self.name} sha256:{digest.hexdigest()[:16]}"

    def encode(self, documents: Sequence[Document]) -> list[tuple[np.ndarray, np.ndarray | None]]:
        texts = [document for document in documents if isinstance(document, str)]
        ids = iter(self.tokenizer(texts, add_special_tokens=False)["input_ids"]) if texts else iter(())
        encoded = []
        for document in documents:
            if isinstance(document, Chat):
                encoded.append(self._conversation(document))
            else:
                tokens = next(ids) if isinstance(document, str) else document
                encoded.append((np.append(np.asarray(tokens, dtype=np.int64), self.eos_token_id), None))
        return encoded

    def _conversation(self, chat: Chat) -> tuple[np.ndarray, np.ndarray]:
        """The conversation's tokens and its labels: the assistant's tokens, ``IGNORE_INDEX``
        elsewhere. Each assistant turn is what rendering the conversation up to it adds to the
        rendering before it with the generation prompt, so the template's own markup around a
        turn is the prompt's, as transformers' training recipes count it."""
        if chat.completion is not None:  # a prompt and its completion
            prompt = self.tokenizer(chat.prompt, add_special_tokens=False)["input_ids"]
            completion = [*self.tokenizer(chat.completion, add_special_tokens=False)["input_ids"], self.eos_token_id]
            ids = np.asarray([*prompt, *completion], dtype=np.int64)
            return ids, np.concatenate([np.full(len(prompt), IGNORE_INDEX), completion]).astype(np.int64)
        if not self.tokenizer.chat_template:
            raise DataError(f"{chat.where}: tokenizer {self.name!r} has no chat template to render conversations "
                            "with; name a tokenizer that has one")
        render = self._render
        ids = render(chat.messages, chat.where)
        labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int64)
        for turn, message in enumerate(chat.messages):
            if message["role"] != "assistant":
                continue
            before = render(chat.messages[:turn], chat.where, generation_prompt=True)
            through = render(chat.messages[: turn + 1], chat.where)
            if through[: len(before)] != before or ids[: len(through)] != through:
                raise DataError(f"{chat.where}: the chat template renders a turn differently once more turns "
                                "follow, so the assistant's tokens cannot be told apart; use a template whose "
                                "rendering of a conversation begins with its rendering of every earlier part")
            labels[len(before) : len(through)] = through[len(before) :]
        return np.asarray(ids, dtype=np.int64), labels

    @cached_property
    def _chat_template(self) -> ChatTemplate:
        return ChatTemplate(self.tokenizer.get_chat_template(), self.max_document_bytes, self.chat_template_timeout_s)

    def _render(self, messages: list, where: str, generation_prompt: bool = False) -> list[int]:
        """The conversation's tokens as ``apply_chat_template`` gives them, rendered within bounds."""
        if not messages:
            return []
        try:
            text = self._chat_template.render(messages, generation_prompt, self.tokenizer.special_tokens_map)
        except TemplateLimit as limit:
            raise DataError(f"{where}: {limit}; fix the template, or raise the limit") from None
        except Exception as error:  # the template is Jinja: it raises what its author wrote
            raise DataError(f"{where}: the chat template cannot render this conversation: "
                            f"{str(error).splitlines()[0][:200]}") from None
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def tokenizer_for(name: str | None, max_document_bytes: int, chat_template_timeout_s: float,
                  ) -> ByteTokens | HuggingFaceTokens:
    if not name:
        return ByteTokens()
    return HuggingFaceTokens(name, max_document_bytes=max_document_bytes,
                             chat_template_timeout_s=chat_template_timeout_s)
