"""Documents to token ids, on the rank that reads them: a HuggingFace tokenizer (from a
directory or the Hub, never with remote code), or UTF-8 bytes when none is named. Every
HuggingFace tokenizer the product reads (``data.tokenizer``, ``elastic prepare`` and
``elastic export``'s ``--tokenizer``) is loaded by ``load_tokenizer``.

A document's tokens end with its separator (the tokenizer's end-of-sequence token; ``\\n``
for bytes), so that packed documents stay apart. A conversation (``chat``) is rendered with
the tokenizer's chat template, and only its assistant turns are trained on.
"""

from __future__ import annotations

import functools
import hashlib
import os
import socket
import threading
from collections.abc import Callable, Sequence
from functools import cached_property
from urllib.parse import urlsplit

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

# Seconds the Hub's host has to answer before a Hub id is read from the local cache alone:
# huggingface_hub's own retries take the best part of a minute to fail where there is no
# network.
HUB_PROBE_S = 3.0


def load_tokenizer(name: str, named_by: str):
    """The HuggingFace tokenizer ``name`` names: a directory, else a Hub id, loaded with
    ``trust_remote_code`` off, and refused if it asks for its own code (``auto_map``). A Hub id
    is read from the local Hub cache alone while the Hub cannot be used (``hub_unreachable``),
    so that a host without network fails at once. ``named_by``: the field or flag that names
    it. Every refusal is a ``DataError`` of one line."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError(f"{named_by} needs transformers: pip install 'elastic-trainer[tokenizer]'") from None
    directory = os.path.isdir(name)
    if not directory and not _hub_id(name):
        what = "a file, not a directory" if os.path.exists(name) else "the directory does not exist"
        raise DataError(f"{named_by} {name!r}: {what}; give the directory a tokenizer was saved in "
                        "(save_pretrained), or a Hub id such as 'gpt2'")
    offline = None if directory else hub_unreachable()
    try:
        # Never the tokenizer's own code: said outright, transformers does not leave it to a
        # prompt on the terminal (answering y there ran the directory's Python).
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=False,
                                                  local_files_only=directory or offline is not None)
    except Exception as error:  # transformers raises OSError, ValueError and more for one bad name
        if offline is not None and isinstance(error, OSError):
            from huggingface_hub.constants import HF_HUB_CACHE

            raise DataError(f"{named_by} {name!r}: no such directory, and the Hub id was not found in the local Hub "
                            f"cache ({HF_HUB_CACHE}), the Hub being out of reach ({offline}); download it where the "
                            f"Hub is reachable (hf download {name}) into this cache, or give its directory") from None
        raise DataError(f"{named_by} {name!r}: cannot be loaded without running its own code or at all "
                        f"({str(error).splitlines()[0][:200]}); name a tokenizer directory or Hub id whose "
                        "tokenizer.json transformers reads itself") from None
    if tokenizer.init_kwargs.get("auto_map"):  # loadable without it, but its author meant its own code to run
        raise DataError(f"{named_by} {name!r}: asks to run its own code (auto_map in its tokenizer_config.json), "
                        "which is never run here; name a tokenizer that transformers reads itself")
    return tokenizer


def _hub_id(name: str) -> bool:
    """Whether ``name`` has a Hub id's form (``repo`` or ``namespace/repo``)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


@functools.cache  # once a process: the network does not come and go within a run's start
def hub_unreachable() -> str | None:
    """Why this process cannot use the Hub, or None: ``HF_HUB_OFFLINE`` set, or its endpoint's
    host (``HF_ENDPOINT``) not answering within ``HUB_PROBE_S``. The host is not probed where
    the environment says how the Hub is reached: ``HF_HUB_OFFLINE=0``, or an HTTP(S) proxy."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    if "HF_HUB_OFFLINE" in os.environ or any(os.environ.get(proxy) for proxy in (
            "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")):
        return None
    endpoint = urlsplit(constants.ENDPOINT)
    address = (endpoint.hostname, endpoint.port or (443 if endpoint.scheme == "https" else 80))
    outcome: list[OSError | None] = []
    answered = threading.Event()

    def probe() -> None:
        try:
            socket.create_connection(address, timeout=HUB_PROBE_S).close()
            outcome.append(None)
        except OSError as error:
            outcome.append(error)
        answered.set()

    # In a thread: looking the name up, which the timeout does not bound, may wait on a DNS server out of reach.
    threading.Thread(target=probe, daemon=True).start()
    if not answered.wait(HUB_PROBE_S):
        return f"{address[0]}:{address[1]} did not answer within {HUB_PROBE_S:g} s"
    return None if outcome[0] is None else f"{address[0]}:{address[1]}: {outcome[0].strerror or outcome[0]}"


def not_unicode(where: str, error: UnicodeEncodeError) -> DataError:
    """A text that holds half of a UTF-16 pair (JSON's lone ``\\ud800`` escape makes one): no
    character, no UTF-8, and a tokenizer's TypeError."""
    return DataError(f"{where}: the text holds {error.object[error.start:error.end]!r}, half of a UTF-16 pair and no "
                     "character, which no tokenizer encodes; fix its escape (a character outside the BMP is a pair, "
                     "\\ud83d\\ude00)")


class ByteTokens:
    """UTF-8 bytes as token ids (a vocabulary of 256), documents ended by a newline."""

    name = "bytes"
    eos_token_id = BYTE_SEPARATOR

    def identity(self) -> str:
        return "utf-8 bytes"

    def encode(self, documents: Sequence[Document], where: Callable[[int], str], first_row: int,
               ) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """Each document's tokens; ``where`` and ``first_row`` as ``HuggingFaceTokens.encode``
        takes them (the files' readers refuse a text that has no UTF-8)."""
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
        tokenizer = load_tokenizer(self.name, "data.tokenizer")
        if tokenizer.eos_token_id is None:
            raise DataError(f"data.tokenizer {self.name!r}: has no end-of-sequence token to end documents with; "
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

    def encode(self, documents: Sequence[Document], where: Callable[[int], str], first_row: int,
               ) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """Each document's tokens and, for a conversation, its labels; ``where(first_row + i)``
        names document ``i`` in an error."""
        texts = [index for index, document in enumerate(documents) if isinstance(document, str)]
        ids = iter(self._ids([documents[index] for index in texts], lambda text: where(first_row + texts[text])))
        encoded = []
        for document in documents:
            if isinstance(document, Chat):
                encoded.append(self._conversation(document))
            else:
                tokens = next(ids) if isinstance(document, str) else document
                encoded.append((np.append(np.asarray(tokens, dtype=np.int64), self.eos_token_id), None))
        return encoded

    def _ids(self, texts: list[str], where: Callable[[int], str]) -> list[list[int]]:
        """The texts' token ids, no special tokens added; ``where(i)`` names text ``i`` in an error."""
        if not texts:
            return []
        try:
            return self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        except TypeError:  # the whole batch's, for one text that is not Unicode
            for index, text in enumerate(texts):
                try:
                    text.encode()
                except UnicodeEncodeError as error:
                    raise not_unicode(where(index), error) from None
            raise

    def _conversation(self, chat: Chat) -> tuple[np.ndarray, np.ndarray]:
        """The conversation's tokens and its labels: the assistant's tokens, ``IGNORE_INDEX``
        elsewhere. Each assistant turn is what rendering the conversation up to it adds to the
        rendering before it with the generation prompt, so the template's own markup around a
        turn is the prompt's, as transformers' training recipes count it."""
        if chat.completion is not None:  # a prompt and its completion
            prompt, completion = self._ids([chat.prompt, chat.completion], lambda _: chat.where)
            completion = [*completion, self.eos_token_id]
            ids = np.asarray([*prompt, *completion], dtype=np.int64)
            return ids, np.concatenate([np.full(len(prompt), IGNORE_INDEX), completion]).astype(np.int64)
        if not self.tokenizer.chat_template:
            raise DataError(f"{chat.where}: tokenizer {self.name!r} has no chat template to render conversations "
                            "with; name a tokenizer that has one")
        render = self._render
        ids = render(chat.messages, chat.where)
        called = [turn for turn, message in enumerate(chat.messages) if "tool_calls" in message]
        if called and render([{key: value for key, value in message.items() if key != "tool_calls"}
                              for message in chat.messages], chat.where) == ids:
            raise DataError(f"{chat.where}: message {called[0]}'s tool_calls are not in what the chat template of "
                            f"data.tokenizer {self.name!r} renders, so its turn would train without them; name a "
                            "tokenizer whose template renders tool_calls, or remove them from the data")
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
        return self._ids([text], lambda _: where)[0]


def tokenizer_for(name: str | None, max_document_bytes: int, chat_template_timeout_s: float,
                  ) -> ByteTokens | HuggingFaceTokens:
    if not name:
        return ByteTokens()
    return HuggingFaceTokens(name, max_document_bytes=max_document_bytes,
                             chat_template_timeout_s=chat_template_timeout_s)
