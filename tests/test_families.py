"""Generated task families (envs/families.py): same arguments, same bytes; held-out names,
constants and templates unseen in train; rows the suite loader takes; the scripted fix equals
the gold patch; the measured tests fail at the base commit and pass with the fix."""

from __future__ import annotations

import ast
import builtins
import json
import keyword
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from envs import families
from envs.families import SPLITS, demo_calls, generate
from envs.swe_env import SWEEnvConfig, resolve_source
from envs.task import Task
from tests.conftest import clean_env

N = 6
ROOT = Path(__file__).resolve().parents[1]
ALL_TEMPLATES = families.TEMPLATES + families.HELDOUT_TEMPLATES


@pytest.fixture(scope="module")
def suites(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[dict]]]:
    out = tmp_path_factory.mktemp("suites")
    return {split: (out / f"{split}.jsonl", generate("pyfix", N, 3, split, out / f"{split}.jsonl")) for split in SPLITS}


def clone(row: dict, bundles: Path, dest: Path) -> Path:
    subprocess.run(["git", "clone", "-q", str(bundles / f"{row['source'].removeprefix('bundle:')}.bundle"), str(dest)],
                   check=True)
    subprocess.run(["git", "checkout", "-q", row["base_commit"]], cwd=dest, check=True)
    return dest


def apply(repo: Path, patch: str) -> None:
    subprocess.run(["git", "apply", "-"], cwd=repo, input=patch, text=True, check=True)


def module_path(row: dict) -> str:
    return demo_calls(row)[0]["arguments"]["path"]


def target_of(row: dict) -> str:
    """The buggy function: the F2P tests are named test_<function>_reported / _related."""
    return row["FAIL_TO_PASS"][0].split(" ")[0].removeprefix("test_").rsplit("_", 1)[0]


def names_in(path: Path, row: dict, tmp: Path) -> set[str]:
    """Function and argument names of the row's module at its base commit."""
    repo = clone(row, path.parent / "bundles", tmp / row["instance_id"])
    tree = ast.parse((repo / module_path(row)).read_text())
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    return {f.name for f in functions} | {a.arg for f in functions for a in f.args.args}


def test_same_arguments_same_bytes(tmp_path, suites):
    path, rows = suites["train"]
    again = generate("pyfix", N, 3, "train", tmp_path / "train.jsonl")
    assert again == rows
    assert (tmp_path / "train.jsonl").read_bytes() == path.read_bytes()
    for row in rows:
        name = f"{row['source'].removeprefix('bundle:')}.bundle"
        assert (tmp_path / "bundles" / name).read_bytes() == (path.parent / "bundles" / name).read_bytes()


def test_same_bytes_in_another_process(tmp_path, suites):
    path, rows = suites["heldout"]
    code = ("import sys; from pathlib import Path; from envs.families import generate; "
            f"generate('pyfix', {N}, 3, 'heldout', Path(sys.argv[1]))")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "h.jsonl")], check=True, cwd=ROOT,
                   env=os.environ | {"PYTHONHASHSEED": "12345"})
    assert (tmp_path / "h.jsonl").read_bytes() == path.read_bytes()
    for row in rows:
        name = f"{row['source'].removeprefix('bundle:')}.bundle"
        assert (tmp_path / "bundles" / name).read_bytes() == (path.parent / "bundles" / name).read_bytes()


def test_more_tasks_draw_the_same_first_ones(tmp_path, suites):
    """The first n tasks of a longer draw are the n tasks of a draw of n: the demo's validation
    split is the tail of a held-out draw whose head is the held-out table's, so none is shared."""
    path, rows = suites["heldout"]
    longer = generate("pyfix", N + 2, 3, "heldout", tmp_path / "heldout.jsonl")
    assert longer[:N] == rows
    assert not {r["problem_statement"] for r in longer[N:]} & {r["problem_statement"] for r in rows}


def test_another_seed_other_tasks(tmp_path, suites):
    _, rows = suites["train"]
    other = generate("pyfix", N, 4, "train", tmp_path / "train.jsonl")
    assert not {r["problem_statement"] for r in rows} & {r["problem_statement"] for r in other}
    assert not {r["base_commit"] for r in rows} & {r["base_commit"] for r in other}
    assert not {r["instance_id"] for r in rows} & {r["instance_id"] for r in other}


def test_pools_share_nothing_between_train_and_heldout():
    pools = [families.PACKAGES, families.MODULES, families.WORDS, *families.ARGS.values(),
             *(t.names for t in ALL_TEMPLATES),
             *(h.names for h in families.HELPERS)]
    train = [name for pool in pools for name in pool[0]]
    heldout = [name for pool in pools for name in pool[1]]
    assert not set(train) & set(heldout)
    assert len(train) == len(set(train)) and len(heldout) == len(set(heldout))  # no name in two pools
    for name in train + heldout:
        assert name.isidentifier() and not keyword.iskeyword(name) and not hasattr(builtins, name), name
    assert not {c for t in ALL_TEMPLATES for c in t.consts[0]} & {c for t in ALL_TEMPLATES for c in t.consts[1]}


def test_every_role_has_names_where_it_is_used():
    args = families.ARGS
    for t in families.TEMPLATES:
        assert t.names[0] and t.names[1] and all(args[r][0] and args[r][1] for r in families.roles(t.source)), t.name
        assert bool(t.consts[0]) == bool(t.consts[1]) == ("{K}" in t.source), t.name
    for t in families.HELDOUT_TEMPLATES:
        assert t.names[1] and all(args[r][1] for r in families.roles(t.source)), t.name
        assert bool(t.consts[1]) == ("{K}" in t.source), t.name
    for h in families.HELPERS:
        assert all(args[r][0] and args[r][1] for r in families.roles(h.source))


def test_heldout_modules_use_no_train_name(tmp_path, suites):
    train, heldout = ({name for row in suites[s][1] for name in names_in(suites[s][0], row, tmp_path / s)}
                      for s in ("train", "heldout"))
    assert train and heldout and not train & heldout


def test_generated_train_names_are_made_up_and_never_held_out(tmp_path, suites):
    """names="generated": every name of a train task is made up (a policy cannot recall it, it must
    copy it), never a held-out name, and the same arguments give the same bytes."""
    path = tmp_path / "gen" / "train.jsonl"
    rows = generate("pyfix", N, 3, "train", path, names="generated")
    assert generate("pyfix", N, 3, "train", tmp_path / "again" / "train.jsonl", names="generated") == rows
    assert all("-train-gen-3-" in r["instance_id"] for r in rows)
    made_up = {name for row in rows for name in names_in(path, row, tmp_path / "m")}
    heldout = {name for row in suites["heldout"][1] for name in names_in(suites["heldout"][0], row, tmp_path / "h")}
    pools = {name for pool in [families.PACKAGES, families.MODULES, families.WORDS, *families.ARGS.values(),
                               *(t.names for t in ALL_TEMPLATES), *(h.names for h in families.HELPERS)]
             for name in pool[0] + pool[1]}
    assert made_up and not made_up & heldout and not made_up & pools
    for name in made_up:
        assert name.isidentifier() and not keyword.iskeyword(name) and not hasattr(builtins, name), name
    paths = [module_path(r) for r in rows]
    assert len(set(paths)) == len(paths) and not any(p.split("/")[0] in pools for p in paths)
    with pytest.raises(ValueError, match="names=generated is for the train split"):
        generate("pyfix", 1, 3, "heldout", tmp_path / "x.jsonl", names="generated")


def test_word_list_train_names_are_words_and_never_held_out(tmp_path, suites):
    """names="words": every name of a train task is a word of envs/words.txt or two joined by _
    (real words, as held-out names are, but none of them or a part of one), and the same
    arguments give the same bytes."""
    path = tmp_path / "words" / "train.jsonl"
    rows = generate("pyfix", N, 3, "train", path, names="words")
    assert generate("pyfix", N, 3, "train", tmp_path / "again" / "train.jsonl", names="words") == rows
    assert all("-train-words-3-" in r["instance_id"] for r in rows)
    listed = set(families._listed_words())
    assert len(listed) == 3000
    names = {name for row in rows for name in names_in(path, row, tmp_path / "w")}
    heldout = {name for row in suites["heldout"][1] for name in names_in(suites["heldout"][0], row, tmp_path / "h")}
    heldout_parts = {part for name in families._HELDOUT_NAMES for part in (name, *name.split("_"))}
    # the target function may carry a word of the word list after its own (see _fill)
    assert names and not names & heldout
    assert all(set(name.split("_")) <= listed and not set(name.split("_")) & heldout_parts for name in names), names
    packages = {module_path(r).split("/")[0] for r in rows}
    assert all(any(set(p.removesuffix(s).split("_")) <= listed for s in ("", *families.SUFFIXES))
               for p in packages), packages  # words, or words and a suffix
    with pytest.raises(ValueError, match="names=words is for the train split"):
        generate("pyfix", 1, 3, "heldout", tmp_path / "x.jsonl", names="words")


def test_no_package_is_named_as_a_standard_library_module():
    """A package named from the word list's "keyword" or "locale" made the tests import the
    standard library's module: seed 1's train split drew "keyword" as its 530th package, and
    `swerve demo learn --seed 1` stopped at generation. Such a draw is drawn again."""
    drafts = families.draw_pyfix(random.Random("pyfix:train:1:1:words"), 530, "train", 1, names="words")
    packages = {path.split("/")[0] for d in drafts for path in d.fix}
    assert len(packages) > 400 and not packages & sys.stdlib_module_names
    assert {"keyword", "locale"} <= set(families._listed_words()) & sys.stdlib_module_names


def test_heldout_templates_are_templates_train_never_uses(suites):
    shared, new = {t.name for t in families.TEMPLATES}, {t.name for t in families.HELDOUT_TEMPLATES}
    assert len(shared) >= 12 and len(new) >= 4 and not shared & new
    template_of = {fn: t.name for t in ALL_TEMPLATES for pool in t.names for fn in pool}

    def template(fn: str) -> str:  # a target is its template's name, or that name and a word
        return template_of.get(fn) or template_of[fn.rsplit("_", 1)[0]]

    used = {s: {template(target_of(row)) for row in suites[s][1]} for s in SPLITS}
    assert used["train"] <= shared and used["heldout"] <= shared
    assert len(used["heldout-templates"]) >= 4 and used["heldout-templates"] <= new


async def test_rows_import_as_suites(tmp_path, suites, sqlite_template):
    from service.control import suites as loader
    from service.store.db import make_async_engine

    shutil.copy(sqlite_template, tmp_path / "swerve.db")
    engine = make_async_engine(f"sqlite:///{tmp_path / 'swerve.db'}")
    try:
        for split, (path, rows) in suites.items():
            records = loader.parse_jsonl(loader.file_chunks(str(path)))
            result = await loader.import_suite(engine, split, records, max_listed_errors=10)
            assert result.task_count == len(rows)
    finally:
        await engine.dispose()
    for path, rows in suites.values():
        for row in rows:
            task = Task.model_validate(row)
            assert task.log_parser == "django" and task.install == [] and task.history_mode() == "none"
            assert resolve_source(task, SWEEnvConfig(bundle_dirs=(path.parent / "bundles",))).endswith(".bundle")


def test_problem_statements_are_short_and_name_the_place(suites):
    for _, rows in suites.values():
        for row in rows:
            statement = row["problem_statement"]
            assert len(statement) < 350 and module_path(row) in statement and f"`{target_of(row)}(" in statement


@pytest.mark.parametrize("split", SPLITS)
def test_demo_calls_give_the_gold_file(tmp_path, suites, split):
    path, rows = suites[split]
    for row in rows:
        view, edit, submit = demo_calls(row)
        commands = (view["arguments"]["command"], edit["arguments"]["command"], submit["name"])
        assert commands == ("view", "str_replace", "submit")
        repo = clone(row, path.parent / "bundles", tmp_path / row["instance_id"])
        text = (repo / edit["arguments"]["path"]).read_text()
        assert text.count(edit["arguments"]["old_str"]) == 1
        assert edit["arguments"]["old_str"] in text.splitlines()  # whole lines, indentation kept
        apply(repo, row["patch"])
        assert text.replace(edit["arguments"]["old_str"], edit["arguments"]["new_str"]) == \
            (repo / edit["arguments"]["path"]).read_text()


HEADER = "diff --git a/{0} b/{0}\n--- a/{0}\n+++ b/{0}\n"


@pytest.mark.parametrize(("patch", "why"), [
    (HEADER.format("a.py") + "@@ -1 +1 @@\n-x\n+y\n" + HEADER.format("b.py") + "@@ -1 +1 @@\n-x\n+y\n",
     "one file in one hunk"),
    (HEADER.format("a.py") + "@@ -1 +1 @@\n-x\n+y\n@@ -9 +9 @@\n-z\n+w\n", "one file in one hunk"),
    (HEADER.format("a.py") + "@@ -1,1 +1,2 @@\n x\n+y\n", "only adds lines"),
    ("diff --git a/a.py b/a.py\nnew file mode 100644\n--- /dev/null\n+++ b/a.py\n@@ -0,0 +1 @@\n+y\n", "creates"),
    ("", "it has 0 files"),
])
def test_demo_calls_refuse_what_str_replace_cannot_do(patch, why):
    with pytest.raises(ValueError, match=why):
        demo_calls({"instance_id": "x", "patch": patch})


def test_measured_tests_fail_at_base_and_pass_with_the_gold(tmp_path, suites):
    for split in ("train", "heldout-templates"):
        path, rows = suites[split]
        row = rows[0]
        repo = clone(row, path.parent / "bundles", tmp_path / row["instance_id"])
        apply(repo, row["test_patch"])
        before, _ = families.run_tests(repo, families.FAMILIES["pyfix"])
        assert all(before[t] != "PASSED" for t in row["FAIL_TO_PASS"])
        assert all(before[t] == "PASSED" for t in row["PASS_TO_PASS"])
        apply(repo, row["patch"])
        after, exit_code = families.run_tests(repo, families.FAMILIES["pyfix"])
        assert exit_code == 0 and all(after[t] == "PASSED" for t in row["FAIL_TO_PASS"] + row["PASS_TO_PASS"])


def test_a_task_whose_hidden_test_passes_without_the_fix_is_refused(tmp_path):
    module = "def f(x):\n    return x\n"
    test = "import unittest\n\nfrom p.m import f\n\n\nclass T(unittest.TestCase):\n    def test_f(self):\n" \
           "        self.assertEqual(f(1), 1)\n"
    draft = families.Draft(files={"p/__init__.py": "", "p/m.py": module, "tests/__init__.py": ""},
                  fix={"p/m.py": module.replace("x\n", "x + 0\n")}, hidden={"tests/test_issue.py": test},
                  problem="f is wrong", hidden_tests=1, visible_tests=0)
    with pytest.raises(families.GenerationError, match="hidden ones must fail"):
        families.build_task(draft, "bad", families.FAMILIES["pyfix"], tmp_path, tmp_path)


@pytest.mark.parametrize("distractors", [0, 4])
def test_distractors_set_the_module_size(tmp_path, distractors):
    path = tmp_path / "s.jsonl"
    rows = generate("pyfix", 3, 0, "train", path, distractors=distractors)
    for row in rows:
        repo = clone(row, path.parent / "bundles", tmp_path / row["instance_id"])
        text = (repo / module_path(row)).read_text()
        assert len(text.splitlines()) < 40 and "\t" not in text and "#" not in text
        assert sum(isinstance(n, ast.FunctionDef) for n in ast.parse(text).body) == distractors + 1
        assert len(row["PASS_TO_PASS"]) == distractors + 1


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"family": "nope"}, "unknown family"), ({"split": "test"}, "unknown split"),
    ({"distractors": 5}, "distractors must be 0..4"), ({"n": 0}, "n must be at least 1"),
])
def test_bad_arguments_are_refused(tmp_path, kwargs, message):
    args = {"family": "pyfix", "n": 1, "seed": 0, "split": "train", "out": tmp_path / "s.jsonl"} | kwargs
    with pytest.raises(ValueError, match=message):
        generate(**args)


def test_cli_writes_bundles_where_workers_look(tmp_path):
    env = clean_env()
    env["SWERVE_DATA_DIR"] = str(tmp_path / "var")
    done = subprocess.run([sys.executable, "-m", "service.cli", "suite", "generate", "--family", "pyfix", "--n", "2",
                           "--seed", "1", "--split", "heldout-templates", "--out", str(tmp_path / "s.jsonl")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "2 pyfix tasks" in done.stdout
    assert "generating pyfix tasks: 2/2" in done.stderr  # progress, on stderr off a terminal
    rows = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    for row in rows:
        assert (tmp_path / "var" / "bundles" / f"{row['source'].removeprefix('bundle:')}.bundle").is_file()
