"""A small HuggingFace tokenizer made on the spot, with a chat template: for tests and
benchmarks that tokenize, with no network and no download."""

from __future__ import annotations

from pathlib import Path

# Each turn ends with the end-of-sequence token, so the rendering of a conversation begins
# with its rendering of every earlier part (the assistant's tokens can be told apart).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tokenizer(directory: Path, texts: list[str], vocab_size: int = 256) -> Path:
    """A byte-level BPE tokenizer trained on ``texts``, saved in ``directory`` with ``</s>`` as
    its end-of-sequence token and ``CHAT_TEMPLATE``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    model = Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    model.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory
