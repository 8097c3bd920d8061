"""Secrets in URLs (a URL's user and password, the signature and credentials of a presigned
URL) never reach what we print: CLI lines, events, the summary, log lines."""

import logging
import sys

import pytest

from elastic.core.events import RedactingFormatter, redact_credentials


@pytest.mark.parametrize("url,redacted", [
    ("https://alice:hunter2@host/x.txt", "https://***@host/x.txt"),
    ("s3://AKIAXXXX:hunter2@bucket/run", "s3://***@bucket/run"),
    ("https://token@host", "https://***@host"),
    # an unescaped '@' in the password: hidden whole, up to the host
    ("https://alice:p@ss@host/x?q=1", "https://***@host/x?q=1"),
])
def test_userinfo_is_redacted(url, redacted):
    assert redact_credentials(f"cannot read {url!r}") == f"cannot read {redacted!r}"


@pytest.mark.parametrize("parameter", [
    "X-Amz-Signature", "X-Amz-Credential", "X-Amz-Security-Token", "AWSAccessKeyId", "Signature",
    "X-Goog-Signature", "X-Goog-Credential", "GoogleAccessId", "sig", "token", "access_token",
])
@pytest.mark.parametrize("position", ["?{}=SECRET&v=1", "?v=1&{}=SECRET", "?v=1&{}=SECRET#frag"])
def test_each_secret_query_parameter_is_redacted(parameter, position):
    text = redact_credentials("https://host/key" + position.format(parameter))
    assert "SECRET" not in text and f"{parameter}=***" in text and "v=1" in text, text


def test_secret_query_parameters_are_redacted_whatever_their_case():
    assert redact_credentials("https://host/k?SIG=abc&x-amz-signature=def") == "https://host/k?SIG=***&x-amz-signature=***"


def test_every_secret_of_several_urls_in_one_text_is_redacted():
    text = ('from "https://alice:hunter2@a.example/x?token=t1&page=2" and '
            "https://b.example/y?X-Amz-Credential=AKIA%2F1&X-Amz-Date=20240101T000000Z&X-Amz-Signature=f00d "
            "then https://c.blob.core.windows.net/c/z?sv=2022-11-02&se=2030-01-01&sp=r&sig=abc%3D")
    assert redact_credentials(text) == (
        'from "https://***@a.example/x?token=***&page=2" and '
        "https://b.example/y?X-Amz-Credential=***&X-Amz-Date=20240101T000000Z&X-Amz-Signature=*** "
        "then https://c.blob.core.windows.net/c/z?sv=2022-11-02&se=2030-01-01&sp=r&sig=***"
    )


@pytest.mark.parametrize("text", [
    "https://host/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Expires=3600&X-Amz-SignedHeaders=host&versionId=3",
    "https://host/k?mytoken=1&signed=yes&sigma=2",
    "mail alice@example.com about s3://bucket/run and token=abc outside a URL query",
])
def test_what_holds_no_secret_is_kept(text):
    assert redact_credentials(text) == text


def test_log_lines_are_redacted_in_their_arguments_and_tracebacks():
    try:
        raise OSError("cannot open https://alice:hunter2@host/x?sig=abc")
    except OSError:
        record = logging.LogRecord("elastic", logging.ERROR, __file__, 1, "reading %s failed",
                                   ("https://host/y?X-Amz-Signature=f00d",), sys.exc_info())
    line = RedactingFormatter("%(message)s").format(record)
    assert "hunter2" not in line and "abc" not in line and "f00d" not in line, line
    assert "https://host/y?X-Amz-Signature=***" in line and "https://***@host/x?sig=***" in line, line
