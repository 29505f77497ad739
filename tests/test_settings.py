"""perseus_env.SETTINGS is the one table of PERSEUS_* variables: docs/settings.md documents
exactly its settings, the C++ runtime reads no name it lacks, no Python module reads a PERSEUS_*
variable around its readers, and the readers name the variable and the bad value (in-process)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import perseus_env

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"PERSEUS_[A-Z0-9_]*[A-Z0-9]")
# A read of os.environ / an env mapping keyed by a PERSEUS_ literal, outside perseus_env.py.
DIRECT_READ = re.compile(r"""(environ|env)\.get\(\s*f?["']PERSEUS_|getenv\(\s*f?["']PERSEUS_"""
                         r"""|(environ|env)\[\s*f?["']PERSEUS_\w*["']\s*\](?!\s*=[^=])""")


def documented_names() -> set[str]:
    """Every PERSEUS_* name in the first column of docs/settings.md's tables."""
    names = set()
    for line in (ROOT / "docs" / "settings.md").read_text().splitlines():
        if line.startswith("| `PERSEUS_"):
            names.update(NAME.findall(line.split("|")[1]))
    return names


def test_docs_list_exactly_the_documented_settings():
    table = {s.name for s in perseus_env.SETTINGS if s.documented}
    docs = documented_names()
    assert not table - docs, f"settings missing from docs/settings.md: {sorted(table - docs)}"
    assert not docs - table, f"docs/settings.md rows not in perseus_env.SETTINGS: " \
                             f"{sorted(docs - table)}"


def test_docs_say_who_reads_each_setting():
    for line in (ROOT / "docs" / "settings.md").read_text().splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if line.startswith("| `PERSEUS_") and len(cells) == 4:
            for name in NAME.findall(cells[0]):
                assert cells[3] == ", ".join(perseus_env.setting(name).readers), line


def test_every_setting_has_a_rule_a_meaning_and_a_reader():
    for s in perseus_env.SETTINGS:
        assert s.rule and s.meaning and s.default, s
        assert s.readers and set(s.readers) <= {perseus_env.LIBRARY, perseus_env.LAUNCHER,
                                                perseus_env.RUNTIME, perseus_env.BUILD}, s


def test_every_name_the_native_runtime_reads_is_in_the_table():
    sources = [p for ext in ("*.cc", "*.h") for p in (ROOT / "ops").rglob(ext)]
    assert sources
    names = {n for p in sources for n in re.findall(r'"(PERSEUS_[A-Z0-9_]+)"', p.read_text())}
    assert names, "no PERSEUS_ strings found under ops/"
    missing = sorted(n for n in names if n not in {s.name for s in perseus_env.SETTINGS})
    assert not missing, f"the C++ sources read settings missing from the table: {missing}"
    runtime = {s.name for s in perseus_env.SETTINGS if perseus_env.RUNTIME in s.readers}
    assert not names - runtime, f"read by the runtime, not marked so: {sorted(names - runtime)}"


def test_python_names_only_settings_and_reads_them_through_perseus_env():
    table = {s.name for s in perseus_env.SETTINGS}
    files = [ROOT / "setup.py", *sorted((ROOT / "perseus_legacy").rglob("*.py")),
             *sorted((ROOT / "perseusrun").rglob("*.py")),
             *sorted((ROOT / "perseus_shared").rglob("*.py"))]
    unknown, direct = [], []
    for path in files:
        text = path.read_text()
        unknown += [f"{path.relative_to(ROOT)}: {n}" for n in set(NAME.findall(text))
                    if n not in table and not n.endswith("_") and n != "PERSEUS_TCP"]
        if path.name != "setup.py":  # the build reads its own settings
            direct += [f"{path.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}"
                       for m in DIRECT_READ.finditer(text)]
    assert not unknown, f"PERSEUS_ names missing from perseus_env.SETTINGS: {unknown}"
    assert not direct, f"PERSEUS_ variables read around perseus_env's readers: {direct}"


@pytest.mark.parametrize("reader, text, expected", [
    (lambda env: perseus_env.read_switch("PERSEUS_NO_TF_PATCH", env), "maybe",
     "PERSEUS_NO_TF_PATCH='maybe': expected 1/true/yes/on or 0/false/no/off"),
    (lambda env: perseus_env.read_seconds("PERSEUS_START_TIMEOUT", 1.0, env, False), "0",
     "PERSEUS_START_TIMEOUT='0': expected a positive number of seconds"),
    (lambda env: perseus_env.read_seconds("PERSEUS_CHIEF_WAIT_SECS", 1.0, env), "-1",
     "PERSEUS_CHIEF_WAIT_SECS='-1': expected a number of seconds >= 0"),
    (lambda env: perseus_env.read_choice("PERSEUS_CONTROLLER", ("mpi", "tcp"), "", env),
     "gloo", "PERSEUS_CONTROLLER='gloo': expected mpi or tcp"),
])
def test_readers_name_the_variable_and_the_bad_value(reader, text, expected):
    name = expected.split("=")[0]
    with pytest.raises(perseus_env.SettingError) as info:
        reader({name: text})
    assert str(info.value) == expected


def test_readers_parse_and_default():
    assert perseus_env.read_switch("PERSEUS_LOG_ALL_RANKS", {}) is False
    assert perseus_env.read_switch("PERSEUS_LOG_ALL_RANKS", {"PERSEUS_LOG_ALL_RANKS": "On"})
    assert perseus_env.read_seconds("PERSEUS_CHIEF_WAIT_SECS", 7.0, {}) == 7.0
    assert perseus_env.read_seconds("PERSEUS_CHIEF_WAIT_SECS", 7.0,
                                    {"PERSEUS_CHIEF_WAIT_SECS": " 0 "}) == 0.0
    assert perseus_env.read_choice("PERSEUS_MPI_YIELD_WHEN_IDLE", ("on", "off", "auto"), "auto",
                                   {"PERSEUS_MPI_YIELD_WHEN_IDLE": "YES"},
                                   aliases=perseus_env.SWITCH_ALIASES) == "on"
    with pytest.raises(KeyError, match="not a perseus_legacy setting"):
        perseus_env.read("PERSEUS_NOT_A_SETTING", {})
