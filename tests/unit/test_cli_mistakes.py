"""A user's mistakes on the command line end in one line naming the fault and exit status 2, never a
traceback: a config file that is not UTF-8, a tokenizer.json the library cannot read, a scoring
window of one token; `bench --help` helps."""

from __future__ import annotations

import pytest

from serving.errors import UserError
from serving.text.tokenizer import load_tokenizer
from tests.cli import call_cli


def test_a_config_file_that_is_not_utf8_is_named(tmp_path):
    config = tmp_path / "binary.yaml"
    config.write_bytes(b"\xff\xfe\x00binary")
    for args in (("generate", "--prompt", "hi", "--config", str(config)), ("deploy", "plan", str(config))):
        result = call_cli(*args)
        assert result.returncode == 2 and f"{config}: not UTF-8 text" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr


def test_a_tokenizer_json_the_library_cannot_read_is_a_users_error(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{1: "not a tokenizer"}')
    with pytest.raises(UserError, match=r"tokenizer\.json: not a tokenizer"):
        load_tokenizer(tmp_path)


def test_a_window_of_one_token_is_refused_by_name_and_bench_has_help():
    result = call_cli("perplexity", "x", "--text-file", "README.md", "--window", "1")
    assert result.returncode == 2 and "--window: must be 2 or more" in result.stderr, result.stderr
    helped = call_cli("bench", "--help")
    assert helped.returncode == 0 and "serve|overhead|offline --help" in helped.stdout, helped.stdout + helped.stderr


def test_a_tokenizer_error_names_where_the_files_came_from_not_a_temporary_directory():
    from serving.checkpoints.restore import tokenizer_from_files

    with pytest.raises(UserError) as info:
        tokenizer_from_files({"tokenizer_config.json": b"{}"}, "/models/mine")
    assert str(info.value).startswith("/models/mine: no tokenizer.json or tokenizer.model"), info.value


def test_a_batch_output_that_cannot_hold_results_is_named_before_any_work(tmp_path):
    from serving.batch.errors import BatchError
    from serving.batch.files import check_output

    a_file = tmp_path / "afile"
    a_file.write_text("x")
    with pytest.raises(BatchError, match="a file, not a folder"):
        check_output(str(a_file))
    with pytest.raises(BatchError, match="cannot make the folder"):
        check_output(str(a_file / "below"))
    check_output(str(tmp_path / "new" / "out"))
    assert (tmp_path / "new" / "out").is_dir()

