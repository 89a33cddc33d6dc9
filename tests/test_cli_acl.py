"""``kvredis acl`` without a server: the lines, the name rules, and docs/operations.md's one
"Access control" section, whose lines are the command's output (the lines' work on real
servers: tests/redis/test_acl_functions.py and tests/redis/test_acl.py)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvredis.cli import cli

DOC = Path(__file__).resolve().parents[1] / "docs" / "operations.md"


def _acl(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, ["acl", *args])
    return result.exit_code, result.stdout, result.stderr


def test_operations_md_has_one_access_control_section_made_by_the_command() -> None:
    text = DOC.read_text()
    assert len(re.findall(r"^#+ Access control\s*$", text, re.M)) == 1
    section = text.split("## Access control\n", 1)[1].split("\n## ", 1)[0]
    shown = re.findall(r"^\$ (kvredis acl [^\n]*)\n([^\n]*)$", section, re.M)
    assert {shlex.split(c)[3] for c, _ in shown} == {"router", "ingester", "operator", "library"}
    for command, line in shown:
        code, out, _ = _acl(*shlex.split(command)[2:])
        assert code == 0
        assert out == line + "\n", command


@pytest.mark.parametrize("role", ["router", "ingester", "operator"])
def test_the_line_of_a_role_names_its_namespace_keys_only(role: str) -> None:
    code, out, err = _acl("--role", role, "team-a")
    assert code == 0 and out.count("\n") == 1
    args = shlex.split(out)
    assert args[:6] == ["ACL", "SETUSER", f"{role}-team-a", "reset", "on", "><password>"]
    keys = [a for a in args if "~" in a]
    assert keys == ["%R~team-a:*" if role == "router" else "~team-a:*"]
    assert "-@all" in args and "resetchannels" in args
    assert "<password>" in err  # the notes go to stderr
    assert not {"+function|load", "+@all", "allkeys", "~*", "+script|load"} & set(args)
    writes = {"+hset", "+del", "+set", "+fcall", "+hdel", "+pexpireat", "+@hash"}
    assert bool(writes & set(args)) == (role != "router")


def test_the_evalsha_line_and_the_user_option() -> None:
    code, out, _ = _acl("--role", "router", "kv", "--evalsha", "--user", "r1")
    args = shlex.split(out)
    assert code == 0 and args[2] == "r1" and "~kv:*" in args
    assert "+evalsha" in args and "+script|load" in args and "+fcall_ro" not in args


def test_the_library_line_has_no_keys_and_no_namespace() -> None:
    code, out, _ = _acl("--role", "library")
    args = shlex.split(out)
    assert code == 0 and "+function|load" in args and not [a for a in args if "~" in a]
    code, _, err = _acl("--role", "library", "kv")
    assert code == 2 and "no NAMESPACE" in err
    code, _, err = _acl("--role", "router")
    assert code == 2 and "name the namespace" in err


@pytest.mark.parametrize("name", ["a:b", "t*", "t?", "[t]", "a\\b", "a b", "kv:prod"])
def test_names_whose_patterns_would_overlap_are_refused(name: str) -> None:
    code, out, err = _acl("--role", "router", name)
    assert code == 2 and out == ""
    assert "may not contain" in err and "kvredis rename" in err


def test_a_quote_in_a_name_is_quoted_for_redis_cli() -> None:
    code, out, _ = _acl("--role", "router", "it's")
    assert code == 0 and '"%R~it\'s:*"' in out
