"""Secrets in URLs (a URL's user and password, the signature and credentials of a presigned
URL) never reach what we print: CLI lines, events, the summary, log lines."""

import http.server
import json
import logging
import re
import sys
import threading

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


@pytest.mark.parametrize("parameter", ["api_key", "key", "client_secret", "password", "X-Goog-Security-Token",
                                       "x-api-key", "refresh_token", "session.token", "apikey"])
def test_any_parameter_named_for_a_secret_is_redacted(parameter):
    text = redact_credentials(f"https://host/k?v=1&{parameter}=SECRET")
    assert text == f"https://host/k?v=1&{parameter}=***"


PRESIGNED = ("http://127.0.0.1:{port}/a.jsonl?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIDSECRET%2F20240101"
             "&X-Amz-Signature=SIGSECRET&X-Amz-Security-Token=TOKENSECRET")


def test_errors_of_the_users_input_are_redacted_as_they_are_made():
    from elastic.data.documents import DataError
    from elastic.setup.errors import ConfigError

    url = PRESIGNED.format(port=1)
    for error in (ConfigError(f"cannot read {url}"), DataError(f"{url} document 3: not a JSON object")):
        assert "SECRET" not in str(error) and "X-Amz-Signature=***" in str(error), error
    assert issubclass(DataError, ConfigError)  # refused at a run's start as any bad input is


def test_a_data_tokenizer_with_credentials_is_refused_like_a_data_path():
    from elastic.setup.config import parse_config
    from elastic.setup.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^invalid config: data.tokenizer: a URL with credentials in it \(\*\*\*@\)"):
        parse_config({"data": {"tokenizer": "https://alice:hunter2@host/tokenizer"}})


def test_what_a_manifest_keeps_of_a_presigned_url_holds_none_of_its_secrets():
    from elastic.setup.config import parse_config
    from elastic.setup.dataset import data_identity
    from elastic.setup.resume_checks import config_hash, config_record

    url = PRESIGNED.format(port=1)
    config = parse_config({"data": {"path": url, "format": "jsonl"}})
    assert "SECRET" not in json.dumps(config_record(config)) and config_record(config)["data"]["path"] == (
        redact_credentials(url))
    # a new presignature of the same request is the same setting
    assert config_hash(parse_config({"data": {"path": url.replace("SIGSECRET", "OTHER"), "format": "jsonl"}})) == (
        config_hash(config))

    class TwoShards:  # URLs that differ only in a secret: each keeps its identity under the shared name
        def identity(self):
            return {"https://host/get?key=one": "10 bytes, sha256 a", "https://host/get?key=two": "12 bytes, sha256 b",
                    PRESIGNED.format(port=2): "9 bytes, sha256 c"}

    assert data_identity(TwoShards()) == {"https://host/get?key=***": "10 bytes, sha256 a; 12 bytes, sha256 b",
                                          redact_credentials(PRESIGNED.format(port=2)): "9 bytes, sha256 c"}


class ChangingFile(http.server.BaseHTTPRequestHandler):
    """``/a.jsonl``, by byte range too, as the server's ``bodies[0]`` is at each request."""

    def _body(self) -> bytes:
        return self.server.bodies[0]

    def do_HEAD(self):
        self.send_response(200)
        self.send_header("Content-Length", str(len(self._body())))
        self.end_headers()

    def do_GET(self):
        body = self._body()
        asked = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
        if asked:
            start, end = int(asked[1]), int(asked[2] or len(body) - 1) + 1
            body = body[start:end]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{start + len(body) - 1}/{len(self._body())}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_data_that_changes_after_the_preflight_is_one_line_and_exit_2_with_no_secret(tmp_path, capsys, monkeypatch):
    from elastic.cli import main
    from elastic.setup import preflight
    from elastic.setup.dataset import generate_corpus

    documents = generate_corpus(20_000, 3).decode().split(". ")
    good = "".join(json.dumps({"text": text}) + "\n" for text in documents).encode()
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), ChangingFile) as server:
        server.bodies = [good]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        checked = preflight.load_config

        def then_changed(*args, **kwargs):  # the file changes once the preflight has read it
            config = checked(*args, **kwargs)
            server.bodies[0] = b"not json\n" + good[len(b"not json\n"):]
            return config

        monkeypatch.setattr(preflight, "load_config", then_changed)
        monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # main sets its own
        try:
            code = main(["train", "--data", PRESIGNED.format(port=server.server_address[1]), "--set",
                         "data.format=jsonl", "--storage", str(tmp_path / "runs"), "--steps", "1", "--quiet"])
        finally:
            server.shutdown()
    err = capsys.readouterr().err
    assert code == 2 and "SECRET" not in err and "Traceback" not in err, err
    [line] = [line for line in err.splitlines() if line.startswith("elastic: ")]
    assert "a.jsonl?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=***" in line and "not a JSON object" in line


def test_an_error_no_command_expected_prints_its_traceback_redacted(monkeypatch, capsys):
    from elastic.cli import main

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # main puts its own in place
    with pytest.raises(SystemExit):
        main(["--no-such-flag"])  # before it reads its arguments
    try:
        raise RuntimeError(f"lost {PRESIGNED.format(port=1)}")
    except RuntimeError:
        sys.excepthook(*sys.exc_info())
    err = capsys.readouterr().err
    assert "Traceback" in err and "lost http://127.0.0.1:1/a.jsonl?" in err and "SECRET" not in err, err
