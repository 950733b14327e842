"""The shared parsers and argparse types: each refuses bad text in one line
naming the value and what is allowed (argparse exits 2), never another
exception (property tests over any text)."""

from __future__ import annotations

import argparse
import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from echo_vllm import cli_args
from echo_vllm.cli_args import UsageError, parse_bytes, parse_int


def _parser(**types) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tool")
    for name, kind in types.items():
        ap.add_argument(f"--{name}", type=kind)
    return ap


def refusal(ap: argparse.ArgumentParser, argv: list[str], capsys) -> str:
    """The one error line argparse printed for ``argv`` (exit 2)."""
    with pytest.raises(SystemExit) as info:
        ap.parse_args(argv)
    assert info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1
    return errors[0]


@pytest.mark.parametrize("kind,text,message", [
    (cli_args.count(2, 64, "why"), "0", "argument --x: 0: must be from 2 to 64 (why)"),
    (cli_args.count(2, 64), "65", "65: must be from 2 to 64"),
    (cli_args.count(1), "5k", "not an integer: '5k'"),
    (cli_args.count(1), "2.5", "not an integer: '2.5'"),
    (cli_args.count(1), "9" * 50, "not an integer"),
    (cli_args.counts(2, 8), "2,,9", "9: must be from 2 to 8"),
    (cli_args.counts(2, 8), ",", "expected a comma list"),
    (cli_args.byte_size(2, 1 << 30), "64Q", "not a byte count: '64Q'"),
    (cli_args.byte_size(2, 1 << 30), "0", "0: must be from 2 to 1073741824"),
    (cli_args.byte_size(2, 1 << 30), "2G", "2G (2147483648 bytes): must be from 2 to 1073741824"),
    (cli_args.byte_sizes(2, 1 << 30), "1M,-1", "not a byte count: '-1'"),
    (cli_args.counts(2, 8), "4,8,4", "'4,8,4': 4 is given twice"),
    (cli_args.byte_sizes(2, 1 << 30), "8K,64K,8192", "'8K,64K,8192': 8192 is given twice (8K is the same: 8192)"),
    (cli_args.factor(), "1", "1: must be from 2 to 1024 (a factor of 1 or less never reaches the largest size)"),
    (cli_args.real(0, 1, low_open=True), "0", "0: must be a finite number above 0 to 1"),
    (cli_args.real(0, 1), "nan", "nan: must be a finite number from 0 to 1"),
    (cli_args.real(0, 1), "inf", "inf: must be a finite"),
    (cli_args.real(0, 1), "x", "not a number: 'x'"),
    (cli_args.device(), "gpu", "'gpu': not a device (cpu, cuda, cuda:N)"),
    (cli_args.device(allow_auto=True), "cuda:x", "not a device (auto, cpu, cuda, cuda:N)"),
    (cli_args.http_url, "ftp://h", "expected http://HOST[:PORT]"),
    (cli_args.http_url, "http://h:99999", "not a URL (Port out of range"),
    (cli_args.http_url, "http://", "expected http://HOST[:PORT]"),
    (cli_args.file_stem, "../x", "'../x': not a file name stem"),
    (cli_args.choice_list(("exact", "naive", "echo")), "exact,ecko", "'ecko': choose from exact,naive,echo; did you "
                                                                      "mean 'echo'?"),
    (cli_args.choice_list(("exact", "naive")), "exact,exact", "a value is given twice"),
    (cli_args.existing_file, "/nonexistent/f", "/nonexistent/f: no such file"),
    (cli_args.existing_file, "/dev/zero", "/dev/zero: not a regular file"),
    (cli_args.existing_dir, "/nonexistent/d", "/nonexistent/d: no such folder"),
    (cli_args.out_dir, "/proc/echo-vllm-x", "/proc, where it would be made, is not writable"),
    (cli_args.out_dir, "/etc/hostname", "exists and is not a folder"),
    (cli_args.out_dir, "", "'': expected a folder"),
    (cli_args.bit_rates(10**6, 10**11), "50", "not a bit rate: '50' (e.g. 50mbit, 1gbit)"),
    (cli_args.bit_rates(10**6, 10**11), "50m", "not a bit rate: '50m'"),
    (cli_args.bit_rates(10**6, 10**11), "0.5mbit", "0.5mbit (500000 bit/s): must be from 1000000"),
    (cli_args.bit_rates(10**6, 10**11), "1.5bit", "is 1.5 bit/s, not a whole number"),
    (cli_args.bit_rates(10**6, 10**11), "50mbit,50000kbit", "50000kbit is given twice (50mbit is the same"),
    (cli_args.duration(0, 1), "5 m", "not a duration: '5 m'"),
    (cli_args.duration(0, 1), "2s", "2s (2 s): must be from 0 to 1"),
])
def test_each_type_refuses_in_one_line_naming_the_value(kind, text, message, capsys):
    line = refusal(_parser(x=kind), [f"--x={text}"], capsys)
    assert message in line


def test_the_types_return_their_values(tmp_path):
    ap = _parser(n=cli_args.count(0, 9), sizes=cli_args.byte_sizes(1), f=cli_args.factor(), r=cli_args.real(0, 1),
                 out=cli_args.out_dir, dev=cli_args.device(allow_auto=True), url=cli_args.http_url)
    args = ap.parse_args(["--n", " 7", "--sizes", "8K,1.5M", "--f", "4", "--r", "0.5", "--out",
                          str(tmp_path / "a" / "b"), "--dev", "CUDA:1", "--url", "http://127.0.0.1:8000"])
    assert (args.n, args.sizes, args.f, args.r, args.dev) == (7, [8192, 3 << 19], 4, 0.5, "cuda:1")
    assert not (tmp_path / "a").exists()  # checked, not made
    assert os.listdir(tmp_path) == []  # the write check left nothing behind


def test_out_dir_refuses_a_dangling_link(tmp_path, capsys):
    """makedirs would fail on it after the work: refused up front, with the
    folder to be made below it too."""
    (tmp_path / "dl").symlink_to(tmp_path / "no_such_target")
    for out in (tmp_path / "dl", tmp_path / "dl" / "sub"):
        line = refusal(_parser(out=cli_args.out_dir), ["--out", str(out)], capsys)
        assert f"{tmp_path}/dl is a link to {tmp_path}/no_such_target, which does not exist" in line
    assert sorted(os.listdir(tmp_path)) == ["dl"]


def test_out_dir_expands_a_quoted_tilde(tmp_path, monkeypatch):
    """``--out=~/x`` reaches the tool unexpanded: the check looked at
    $HOME/x, but the tool wrote into a folder named ``~`` in the cwd."""
    monkeypatch.setenv("HOME", str(tmp_path))
    assert _parser(out=cli_args.out_dir).parse_args(["--out=~/x"]).out == str(tmp_path / "x")


def test_rates_and_durations_read_as_tc_writes_them():
    """tc's decimal units (``mbit`` = 10**6 bit/s; ``bps`` bits, as tc reads it)."""
    ap = _parser(rate=cli_args.bit_rates(1, 10**12), delay=cli_args.duration(0, 10))
    args = ap.parse_args(["--rate", "50mbit,1Gbit,200Mbit/s,800kbps,1000bit,1.5gbit", "--delay", "250us"])
    assert args.rate == [50 * 10**6, 10**9, 200 * 10**6, 800 * 10**3, 1000, 1500 * 10**6]
    assert args.delay == 250e-6
    assert [cli_args.parse_duration(t) for t in ("5ms", "0.5s", "2", "0")] == [0.005, 0.5, 2.0, 0.0]


def test_parse_bytes_and_parse_int():
    assert parse_bytes("1.5G") == 3 << 29 and parse_bytes("0x40000") == 1 << 18 and parse_bytes("4 MiB") == 4 << 20
    for bad in ("1.1k", "", "-1", "1e3", "9" * 41 + "k"):
        with pytest.raises(ValueError, match="not a byte count"):
            parse_bytes(bad)
    assert parse_int(" -3 ") == -3 and parse_int("1_000") == 1000
    for bad in ("5k", "0x10", "1e3", "", "1.0"):
        with pytest.raises(ValueError, match="not an integer"):
            parse_int(bad)


def test_did_you_mean():
    assert cli_args.did_you_mean("group_sise", ["group_size", "seed"]) == "; did you mean 'group_size'?"
    assert cli_args.did_you_mean("zzz", ["group_size"]) == ""
    # a prefix every name shares does not make them all look close
    assert cli_args.did_you_mean("--echo-zzz", ["--echo-seed"], common="--echo-") == ""
    assert cli_args.did_you_mean("--echo-sed", ["--echo-seed"], common="--echo-") == "; did you mean '--echo-seed'?"


def test_report_errors_prints_one_line_and_exits_2(capsys):
    def bad():
        raise UsageError("--x 3: too\n  many")

    assert cli_args.report_errors("tool", bad) == 2
    assert capsys.readouterr().err == "tool: error: --x 3: too many\n"
    assert cli_args.report_errors("tool", lambda: 0) == 0


# -- property tests ------------------------------------------------------------------

TEXT = st.one_of(st.text(max_size=40), st.from_regex(r"\s*[-+]?\d{0,25}(\.\d{0,5})?\s*[kmgtKMGT]?(i?[bB])?\s*",
                                                      fullmatch=True))


@settings(max_examples=300, deadline=None)
@given(TEXT)
def test_parse_bytes_gives_a_byte_count_or_one_clear_error(text):
    try:
        n = parse_bytes(text)
    except ValueError as e:
        assert str(e).startswith("not a byte count") and "\n" not in str(e)
        return
    assert isinstance(n, int) and n >= 0


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=1 << 30), st.sampled_from(["", "k", "K", "m", "g", "t", "KiB", "MB"]))
def test_byte_counts_read_exactly(n, suffix):
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[suffix[:1].lower()]
    assert parse_bytes(f"{n}{suffix}") == n * scale


class _Refused(Exception):
    pass


def _raise(message):
    raise _Refused(message)


PARSER = _parser(count=cli_args.count(1, 100), size=cli_args.byte_size(2, 1 << 36),
                 sizes=cli_args.byte_sizes(2, 1 << 36), factor=cli_args.factor(), real=cli_args.real(0, 1),
                 device=cli_args.device(), url=cli_args.http_url, stem=cli_args.file_stem)
PARSER.error = _raise  # the message argparse would print before exiting 2


@settings(max_examples=150, deadline=None)
@given(TEXT, st.sampled_from(["count", "size", "sizes", "factor", "real", "device", "url", "stem"]))
def test_every_type_gives_a_value_or_argparse_exit_2_with_one_line(text, kind):
    try:
        PARSER.parse_args([f"--{kind}={text}"])
    except _Refused as e:
        assert str(e).startswith(f"argument --{kind}: ") and "\n" not in str(e)


# -- the command line as typed -------------------------------------------------------

#: (token, what the refusal names): look-alikes of '-' (a document's or web page's
#: dashes) and other characters outside ASCII in an option's name
LOOKALIKES = [
    ("\u2013api-key", "'\u2013api-key' begins with '\u2013' (U+2013 EN DASH), which only looks like '-'"),
    ("\u2014api-key=SECRETK1", "'\u2014api-key' begins with '\u2014' (U+2014 EM DASH)"),
    ("\uff0d\uff0dhf-token\uff1dSECRETK1", "(U+FF0D FULLWIDTH HYPHEN-MINUS)"),
    ("\u2212\u2212out", "(U+2212 MINUS SIGN)"),
    ("\u2010\u2010seed", "(U+2010 HYPHEN)"),
    ("\ufe63p", "(U+FE63 SMALL HYPHEN-MINUS)"),
    ("\u00ad-out", "(U+00AD SOFT HYPHEN)"),
    ("--api\u2011key=SECRETK1", "'--api\u2011key' holds '\u2011' (U+2011 NON-BREAKING HYPHEN): option names are plain ASCII"),
    ("--out\u200b", "(U+200B ZERO WIDTH SPACE): option names are plain ASCII"),
    ("--s\u0435ed", "(U+0435 CYRILLIC SMALL LETTER IE)"),
]


@pytest.mark.parametrize("token,message", LOOKALIKES)
def test_lookalike_dashes_are_refused_naming_the_option_never_its_value(token, message):
    for argv in ([token, "SECRETK2"], ["--x", "1", "--", token]):
        with pytest.raises(UsageError) as info:
            cli_args.check_argv(argv)
        text = str(info.value)
        assert message in text and "SECRETK" not in text and "\n" not in text


def test_the_refusal_says_how_to_type_the_option():
    for token, typed in (("\u2013api-key", "--api-key"), ("\u2014p", "-p"), ("\uff0d\uff0dseed", "--seed"),
                         ("--api\u2010key", "--api-key")):
        with pytest.raises(UsageError, match=f"; type {typed}$"):
            cli_args.check_argv([token])


def test_negative_looking_values_stay_with_their_option():
    """argparse takes ``-1M`` for an option ("expected one argument"): it is
    handed to the option's own parser instead. Plain negative numbers,
    values after ``--`` and tokens after a value are left as they are."""
    assert cli_args.check_argv(["--sizes", "-1M", "--x", "-.5"]) == ["--sizes=-1M", "--x=-.5"]
    assert cli_args.check_argv(["-p", "-1", "--a=b", "-2k", "--", "--c", "-3k"]) == \
        ["-p", "-1", "--a=b", "-2k", "--", "--c", "-3k"]
    assert cli_args.check_argv(["--n", "-1", "-1"]) == ["--n=-1", "-1"]
    assert cli_args.check_argv(["m", "--served-model-name", "Mod\u00e8le", "--x=\u2013"]) == \
        ["m", "--served-model-name", "Mod\u00e8le", "--x=\u2013"]  # values may hold anything


def test_a_negative_size_reaches_the_types_own_refusal(capsys):
    line = refusal(_parser(sizes=cli_args.byte_sizes(2)), cli_args.check_argv(["--sizes", "-1M"]), capsys)
    assert "argument --sizes: not a byte count: '-1M'" in line


@pytest.mark.parametrize("text,message", [
    ('{"a": 1, "a": 2}', "the key 'a' is given twice, with different values"),
    ('{"p": {"k": "s3cret", "k": "other"}}', "the key 'k' is given twice"),
    ("[" * 65 + "]" * 65, "nested more than 64 levels deep"),
    ('{"a": ' * 5000 + "1" + "}" * 5000, "nested more than 64 levels deep"),
    ('{"x": ' + "9" * 5000 + "}", "an integer of 5000 digits: at most 40"),
    ("-" + "9" * 41, "an integer of 41 digits: at most 40"),
])
def test_parse_json_is_bounded_and_refuses_contradicting_keys(text, message):
    with pytest.raises(ValueError) as info:
        cli_args.parse_json(text)
    assert message in str(info.value) and "s3cret" not in str(info.value)


def test_parse_json_reads_what_json_reads():
    assert cli_args.parse_json('{"a": 1, "a": 1, "b": [[["]]]"]]], "c": -' + "9" * 40 + "}") == \
        {"a": 1, "b": [[["]]]"]]], "c": -int("9" * 40)}
    assert cli_args.parse_json("[" * 64 + "]" * 64) is not None
    assert cli_args.json_depth('{"a": "[[[{{{\\"[["}') == 1  # brackets inside strings do not nest
    with pytest.raises(json.JSONDecodeError):
        cli_args.parse_json("{bad")


def _path_of(base, size: int):
    """A path below ``base`` of ``size`` bytes, in names of at most 200."""
    path = str(base)
    while len(path) < size:
        path += "/" + "d" * min(200, size - len(path) - 1)
    return path


@pytest.mark.parametrize("make,message", [
    (lambda base: base / ("x" * 256), "the name 'xxxxxxxxxxxxxxxx"),
    (lambda base: base.joinpath(*["d"] * 300), "levels deep: at most 256"),
    (lambda base: base.joinpath(*["d" * 200] * 20), "the path is"),
    (lambda base: _path_of(base, 4000), "the path is 4000 bytes with room for a file name in it (256 bytes)"),
])
def test_out_dir_refuses_what_the_file_system_would_refuse_later(tmp_path, capsys, make, message):
    """``OSError: File name too long`` and makedirs' RecursionError came after
    the run: refused when the arguments are read, making nothing."""
    line = refusal(_parser(out=cli_args.out_dir), ["--out", str(make(tmp_path))], capsys)
    assert message in line
    assert os.listdir(tmp_path) == []


def test_out_file_is_a_writable_file_name(tmp_path, capsys):
    ap = _parser(json=cli_args.out_file)
    assert ap.parse_args(["--json", str(tmp_path / "new" / "t.json")]).json == str(tmp_path / "new" / "t.json")
    (tmp_path / "d").mkdir()
    assert "is a folder (the result would replace it)" in refusal(ap, ["--json", str(tmp_path / "d")], capsys)
    assert "expected a file name" in refusal(ap, ["--json", f"{tmp_path}/"], capsys)
    assert "is not writable" in refusal(ap, ["--json", "/proc/echo-vllm-x/t.json"], capsys)
    assert "bytes: the file system takes at most" in refusal(ap, ["--json", str(tmp_path / ("t" * 300))], capsys)


def test_env_path_problem():
    assert cli_args.env_path_problem("/data/c ") == \
        "begins or ends with a space (a relative path, made in the current folder)"
    assert cli_args.env_path_problem(" /data/c") is not None
    assert "levels deep" in cli_args.env_path_problem("/a" * 300)
    assert cli_args.env_path_problem("/data/c") is None


def test_out_dir_refuses_a_loop_of_links(tmp_path, capsys):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    line = refusal(_parser(out=cli_args.out_dir), ["--out", str(tmp_path / "a" / "x")], capsys)
    assert f"{tmp_path}/a is a link to {tmp_path}/b, which leads round in a loop of links" in line


def test_the_lookalike_dashes_hold_every_dash_unicode_knows():
    import unicodedata

    dashes = {chr(c) for c in range(0x80, 0x110000) if unicodedata.category(chr(c)) == "Pd"}
    assert dashes <= cli_args.LOOKALIKE_DASHES and "-" not in cli_args.LOOKALIKE_DASHES
    # beyond them: the soft hyphen and the minus signs
    assert cli_args.LOOKALIKE_DASHES - dashes == set("\u00ad\u02d7\u207b\u208b\u2212\u2796")
