"""Plain text, a document a line (UTF-8; plain, ``.gz`` or ``.zst``): read as JSON Lines are,
by the byte ranges of its lines, a line's text the document instead of a field of its JSON.
The line's end is no part of the document; a blank line is none."""

from __future__ import annotations

from elastic.data.documents import DataError, JsonlFile


class LinesFile(JsonlFile):
    """One text file of documents, a line each, named by its line as an editor counts them."""

    def _parse(self, line: bytes, row: int) -> str:
        try:
            text = line.decode()
        except UnicodeDecodeError:
            raise DataError(f"{self.where(row)}: the line is not UTF-8; re-encode the file as UTF-8") from None
        return self._text(text.rstrip("\r\n"), row)
