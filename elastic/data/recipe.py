"""What a dataset sends to the ranks: its recipe, not its caches."""

from __future__ import annotations


class Recipe:
    """Pickles as its recipe: the attributes named in ``_transient`` are caches (open files,
    memory maps, decoded blocks, a loaded tokenizer), left out of the pickle and made again
    on the process that reads."""

    _transient: tuple[str, ...] = ()

    def __getstate__(self) -> dict:
        return {key: value for key, value in self.__dict__.items() if key not in self._transient}
