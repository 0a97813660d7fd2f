"""Generated SWE task families: each task is its own tiny repository (a git bundle) and a
SWE-bench row whose FAIL_TO_PASS and PASS_TO_PASS are measured by running its tests.

Invariant: the same (family, n, seed, split, distractors) gives the same bytes (one seeded rng,
fixed authors and dates), and "heldout" draws names and constants no "train" task uses.

    swerve suite generate --family pyfix --n 64 --seed 0 --split train --out var/pyfix-train.jsonl
"""

from __future__ import annotations

import builtins
import copy
import functools
import json
import keyword
import os
import random
import string
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envs.log_parsers import PARSERS

SPLITS = ("train", "heldout", "heldout-templates")
NAMES = ("pools", "generated", "words")
"""How train tasks are named: the split's pools, made-up words (GENERATED), a word list (LISTED)."""
ORG = "swerve-gen"
GIT_ENV = {"GIT_AUTHOR_NAME": "swerve", "GIT_AUTHOR_EMAIL": "swerve@example.invalid",
           "GIT_COMMITTER_NAME": "swerve", "GIT_COMMITTER_EMAIL": "swerve@example.invalid",
           "GIT_AUTHOR_DATE": "2026-01-01T00:00:00+00:00", "GIT_COMMITTER_DATE": "2026-01-01T00:00:00+00:00",
           "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
MAX_DRAWS = 50
"""Draws per task before giving up (a draw is redrawn when its bug line is not unique, no call
shows the bug, or it repeats an earlier task)."""
MAX_PROBLEM_CHARS = 350


class GenerationError(RuntimeError):
    """A generated task does not hold: its measured tests contradict the design."""


@dataclass(frozen=True)
class Draft:
    files: dict[str, str]
    """The repository at base_commit, the bug in place."""
    fix: dict[str, str]
    """The gold fix: files rewritten."""
    hidden: dict[str, str]
    """Test files the test patch adds."""
    problem: str
    hidden_tests: int
    """Tests in `hidden`; each must fail before the fix."""
    visible_tests: int
    """Tests already in the repository; each must pass before and after."""


@dataclass(frozen=True)
class Family:
    draw: Callable[..., list[Draft]]
    """(rng, n, split, distractors, [names="generated" or "words"]) -> n distinct drafts."""
    test_cmd: str
    log_parser: str
    distractors: int = 1
    """Default difficulty: other functions beside the buggy one."""
    max_distractors: int = 4


# ---- pyfix: one module, one buggy line ---------------------------------------------------

Pool = tuple[tuple, tuple]
"""(train, heldout): "heldout" and "heldout-templates" draw from the second."""


def _pool(train: str, heldout: str) -> Pool:
    return tuple(train.split()), tuple(heldout.split())


PACKAGES = _pool("mathy numkit calc toolbelt utilz", "figures abacus quant metrik ledger")
MODULES = _pool("ops helpers core funcs arith mathops numeric calcs compute logic",
                "tools misc basics routines procs methods snippets primitives extras support")
WORDS = _pool(
    "amber apple arrow basin berry birch brick cedar chalk cider cloud coral crane delta dune eagle ember "
    "fable fern flint frost gable grain grove hazel heron ivory jade kelp lemon lilac lotus maple marsh mint "
    "moss nectar olive onyx opal pearl pebble pine plum quartz raven ridge river robin sage slate spruce "
    "thyme tulip",
    "acorn badger beacon bison canyon comet copper cricket dahlia falcon fjord garnet glacier harbor hollow "
    "juniper lagoon lantern meadow mesa nickel orchid otter panther prairie quill rapids saffron summit "
    "tundra umber valley walnut willow yarrow zephyr bramble cobalt ferret granite")
"""Words that make package and function names many (a policy must copy them from the issue and
the code, not recall them): a package is a word and a suffix, or one of PACKAGES; a target
function is its template's name, or that name and a word."""
SUFFIXES = ("kit", "lib", "box", "utils")
ARGS = {
    "value": _pool("value x num", "amount reading qty"), "lo": _pool("low lo lower", "floor least bottom"),
    "hi": _pool("high hi upper", "ceiling most top"), "limit": _pool("limit cap maximum", "quota allowance budget"),
    "count": _pool("n count", "k how_many"), "step": _pool("step by", "stride spacing"),
    "index": _pool("i idx", "j pos"), "items": _pool("items xs seq", "elements entries things"),
    "item": _pool("item el", "entry member"), "default": _pool("default fallback", "otherwise if_empty"),
    "values": _pool("values nums", "data samples"), "total": _pool("total acc", "running grand"),
    "text": _pool("text s raw", "word token chars"), "base": _pool("base radix", "numeral_base digit_base"),
    "part": _pool("part done", "portion got"), "whole": _pool("whole out_of", "overall full"),
    "factor": _pool("factor mult", "gain boost"), "start": _pool("start begin", "t0 since"),
    "end": _pool("end stop", "t1 until"), "n_items": _pool("total_items num_items", "entry_count record_count"),
    "size": _pool("size per_page", "batch_size chunk"), "threshold": _pool("threshold level", "mark bar"),
    "price": _pool("", "price cost"), "rate": _pool("", "rate percent_off"),
    "num": _pool("", "numerator dividend"), "den": _pool("", "denominator divisor"),
    "target": _pool("", "target wanted"), "width": _pool("", "width length"), "fill": _pool("", "fill pad_char"),
}  # fmt: skip
PHRASINGS = (
    "`{call}` in `{path}` {got}, but it should {want}.",
    "Bug in `{fn}` (`{path}`): `{call}` {got}. It should {want}.",
    "I expected `{call}` to {want}, but it {got}. The function is `{fn}` in `{path}`.",
    "`{path}`: `{call}` {got}. Expected it to {want}.",
)
TEST_CMD = "python3 -B -m unittest -v 2>&1"


@dataclass(frozen=True)
class Template:
    name: str
    kind: str
    source: str
    """The correct function; `{fn}`, `{K}` (a constant) and argument roles (ARGS) to fill."""
    fixed: str
    """The text of the line the bug changes, as it should be (unique in the module)."""
    buggy: str
    names: Pool
    calls: Callable[[random.Random, Any], list[tuple]]
    """(rng, K) -> candidate arguments; the bug shows on some and not on others."""
    consts: Pool = ((), ())


@dataclass(frozen=True)
class Helper:
    source: str
    names: Pool
    calls: tuple[tuple, ...]


def _sample(r: random.Random, k: int, hi: int = 30) -> list[int]:
    return r.sample(range(1, hi), k)


def _clamp_calls(r, _):
    lo = r.randint(0, 5)
    hi = lo + r.randint(5, 20)
    return [(hi + r.randint(1, 9), lo, hi), (r.randint(lo + 1, hi - 1), lo, hi), (lo - r.randint(1, 5), lo, hi),
            (hi, lo, hi)]


def _digits_calls(r, base):
    digits = "0123456789"[:min(base, 10)]
    multi = "1" + "".join(r.choice(digits) for _ in range(r.randint(1, 3)))
    return [(multi,), (r.choice(digits[1:]),), (multi, 10), (f" {multi} ",)]


def _percent_calls(r, _):
    part = r.randint(1, 9)
    return [(part, part * r.choice((2, 4, 5, 8))), (0, r.randint(1, 9)), (part, part), (part, 0)]


def _elapsed_calls(r, _):
    start, delta = r.randint(0, 50), r.randint(1, 30)
    return [(start, start + delta), (start, start), (start + delta, start), (r.randint(0, 9), r.randint(60, 99))]


def _first_calls(r, _):
    xs = sorted(_sample(r, 4))
    return [(xs, xs[2]), (xs, xs[-1] + 5), (xs, 0), (xs, xs[1])]


def _mean_calls(r, _):
    first, half_gap = r.randint(1, 9), r.randint(1, 5)
    return [([],), ([first, first + 2 * half_gap],), ([r.randint(1, 9)],)]


def _count_calls(r, _):
    target = r.randint(1, 5)
    xs = r.sample([target, target + 1, target, target + 2, target], 5)
    return [(xs, target), ([], target), ([target, target + 1], target)]


TEMPLATES = (
    Template("clamp", "wrong function (max for min)", """def {fn}({value}, {lo}, {hi}):
    if {value} < {lo}:
        return {lo}
    return min({value}, {hi})
""", "return min({value}, {hi})", "return max({value}, {hi})",
        _pool("clamp clip_value bound_value", "restrict pin_between confine"), _clamp_calls),
    Template("within_limit", "wrong comparison (< for <=)", """def {fn}({value}, {limit}={K}):
    return {value} <= {limit}
""", "return {value} <= {limit}", "return {value} < {limit}",
        _pool("is_within_limit fits_limit under_cap", "is_allowed within_quota permits"),
        lambda r, k: [(k,), (k - r.randint(1, 9),), (k + r.randint(1, 9),), (k, k + 1)],
        ((10, 50, 100), (20, 75, 250))),
    Template("multiples", "off by one (range end)", """def {fn}({count}, {step}={K}):
    return [{index} * {step} for {index} in range(1, {count} + 1)]
""", "range(1, {count} + 1)", "range(1, {count})",
        _pool("multiples first_multiples steps_of", "ladder stride_values rungs"),
        lambda r, k: [(r.randint(2, 5),), (0,), (r.randint(2, 4), k + 1), (1,)], ((2, 3, 5), (4, 6, 7))),
    Template("tail", "wrong index ([0] for [-1])", """def {fn}({items}, {default}=None):
    if not {items}:
        return {default}
    return {items}[-1]
""", "return {items}[-1]", "return {items}[0]",
        _pool("last_item tail final_element", "newest most_recent trailing"),
        lambda r, _: [(_sample(r, 3),), ([],), ([r.randint(1, 9)],), ([], r.randint(1, 9)), (_sample(r, 4),)]),
    Template("average", "missing guard (empty input)", """def {fn}({values}):
    {total} = sum({values})
    return {total} / len({values}) if {values} else 0.0
""", "return {total} / len({values}) if {values} else 0.0", "return {total} / len({values})",
        _pool("average mean_of avg", "arith_mean expected_value central"), _mean_calls),
    Template("parse_base", "wrong default (base 10)", """def {fn}({text}, {base}={K}):
    return int({text}.strip(), {base})
""", "def {fn}({text}, {base}={K}):", "def {fn}({text}, {base}=10):",
        _pool("parse_code read_number from_digits", "decode_digits value_of_code digits_to_int"),
        _digits_calls, ((2, 8), (16, 4))),
    Template("percent", "swapped operands", """def {fn}({part}, {whole}):
    if {whole} == 0:
        return 0.0
    return round(100 * {part} / {whole}, {K})
""", "100 * {part} / {whole}", "100 * {whole} / {part}",
        _pool("percent percentage share_pct", "ratio_pct portion_percent pct_of"), _percent_calls, ((1, 2), (4, 6))),
    Template("scale", "wrong operator (+ for *)", """def {fn}({values}, {factor}={K}):
    return [{item} * {factor} for {item} in {values}]
""", "[{item} * {factor} for", "[{item} + {factor} for",
        _pool("scale scaled multiply_all", "amplify stretch magnify"),
        lambda r, _: [(_sample(r, 3, 10),), ([],), ([r.randint(11, 20)],)], ((3, 10), (6, 7))),
    Template("elapsed", "swapped operands", """def {fn}({start}, {end}):
    if {end} < {start}:
        raise ValueError("{end} is before {start}")
    return {end} - {start}
""", "return {end} - {start}", "return {start} - {end}",
        _pool("elapsed duration time_between", "span_length gap_size interval_len"), _elapsed_calls),
    Template("page_count", "off by one (missing - 1)", """def {fn}({n_items}, {size}={K}):
    return ({n_items} + {size} - 1) // {size}
""", "({n_items} + {size} - 1) // {size}", "({n_items} + {size}) // {size}",
        _pool("page_count pages_needed num_pages", "sheet_total batches_for chunk_count"),
        lambda r, k: [(k,), (0,), (1,), (k + 1,), (k * r.randint(2, 4),), (k * 2 + 1,)], ((10, 25, 50), (12, 15, 30))),
    Template("first_at_least", "wrong comparison (> for >=)", """def {fn}({items}, {threshold}):
    for {index}, {item} in enumerate({items}):
        if {item} >= {threshold}:
            return {index}
    return -1
""", "if {item} >= {threshold}:", "if {item} > {threshold}:",
        _pool("first_at_least index_reaching first_hit", "earliest_reaching locate_level spot_threshold"),
        _first_calls),
    Template("take_first", "off by one (- 1 too much)", """def {fn}({items}, {count}={K}):
    if {count} <= 0:
        return []
    return {items}[:{count}]
""", "return {items}[:{count}]", "return {items}[:{count} - 1]",
        _pool("take_first head leading", "front opening_items prefix_of"),
        lambda r, k: [(_sample(r, k + 2),), ([],), (_sample(r, 3), 0), ([r.randint(1, 9)], 2)], ((3, 5), (4, 6))),
)
HELDOUT_TEMPLATES = (
    Template("largest", "wrong function (min for max)", """def {fn}({values}, {default}={K}):
    if not {values}:
        return {default}
    return max({values})
""", "return max({values})", "return min({values})", _pool("", "peak_value highest top_reading"),
        lambda r, _: [(_sample(r, 4, 40),), ([],), ([r.randint(1, 9)],)], ((), (-1, 0))),
    Template("pad_left", "off by one (- 1 too much)", """def {fn}({text}, {width}, {fill}={K}):
    if len({text}) >= {width}:
        return {text}
    return {fill} * ({width} - len({text})) + {text}
""", "{fill} * ({width} - len({text})) + {text}", "{fill} * ({width} - len({text}) - 1) + {text}",
        _pool("", "pad_left left_fill right_align"),
        lambda r, _: [(str(r.randint(1, 9)), r.randint(3, 6)), ("abcdef", 4), ("", 1), ("ok", 2)],
        ((), (".", "0", "*"))),
    Template("discount", "wrong operator (+ for -)", """def {fn}({price}, {rate}={K}):
    return round({price} * (1 - {rate} / 100), 2)
""", "(1 - {rate} / 100)", "(1 + {rate} / 100)", _pool("", "discounted after_discount sale_price"),
        lambda r, _: [(r.choice((40, 100, 200)),), (0,), (r.randint(10, 90), 0)], ((), (15, 30))),
    Template("safe_ratio", "missing guard (zero divisor)", """def {fn}({num}, {den}):
    return {num} / {den} if {den} else {K}
""", "return {num} / {den} if {den} else {K}", "return {num} / {den}", _pool("", "ratio safe_divide quotient"),
        lambda r, _: [(r.randint(1, 9), 0), (r.randint(1, 9) * 4, 4), (9, 2)], ((), (0.0, -1.0))),
    Template("count_equal", "wrong comparison (!= for ==)", """def {fn}({items}, {target}):
    return sum(1 for {item} in {items} if {item} == {target})
""", "if {item} == {target})", "if {item} != {target})", _pool("", "occurrences tally_of count_equal"),
        _count_calls),
)
HELPERS = (
    Helper("def {fn}({value}):\n    return {value} * 2\n", _pool("double twice", "doubled times_two"),
           ((3,), (0,), (-4,), (12,))),
    Helper("def {fn}({value}):\n    return {value} % 2 == 0\n", _pool("is_even even", "divisible_by_two is_pair"),
           ((4,), (7,), (0,), (-3,))),
    Helper("def {fn}({text}):\n    return {text}[:1].upper()\n",
           _pool("initial first_letter", "leading_char capital_of"), (("hello",), ("",), ("zebra",), ("Apple",))),
    Helper("def {fn}({text}):\n    return len({text}.split())\n",
           _pool("word_count count_words", "token_total n_words"), (("one two three",), ("",), ("  spaced   out ",))),
    Helper("def {fn}({items}):\n    return sum(len({item}) for {item} in {items})\n",
           _pool("total_length char_total", "combined_size letters_in"), ((["ab", "c"],), ([],), (["", "xyz"],))),
    Helper("def {fn}({value}):\n    if {value} > 0:\n        return 1\n    return -1 if {value} < 0 else 0\n",
           _pool("sign sign_of", "polarity direction_of"), ((5,), (-2,), (0,))),
    Helper('def {fn}({text}):\n    return " ".join(reversed({text}.split()))\n',
           _pool("reverse_words backwards", "flip_words words_backward"), (("a b c",), ("hello world",), ("",))),
    Helper("def {fn}({text}):\n    return not {text}.strip()\n", _pool("is_blank empty_text", "only_spaces is_vacant"),
           (("   ",), ("x",), ("",))),
)


GENERATED = 2
"""The group of a train split whose names are generated (`names="generated"`): every name is a
made-up word, so a policy trained on it cannot recall names and must copy them; held-out splits
keep their pools, which no generated name equals."""
_SYLLABLES = (("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "gr", "st", "tr"),
              ("a", "e", "i", "o", "u"), ("", "", "n", "r", "l", "s", "x"))


LISTED = 3
"""The group of a train split named from a word list (`names="words"`, envs/words.txt): real
words, as the held-out pools are, but 3000 of them, so a name is rarely seen twice; a policy
trained on made-up names alone copied them and broke on dictionary words (bench/demo_gap.py:
0.18 on made-up train names, 0.01 on train-pool words, 0.05 held-out). None is a held-out name
or a part of one."""
WORD_LIST = Path(__file__).with_name("words.txt")


@functools.cache
def _listed_words() -> tuple[str, ...]:
    words = tuple(w for w in WORD_LIST.read_text().split("\n") if w and not w.startswith("#"))
    parts = {part for name in _HELDOUT_NAMES for part in (name, *name.split("_"))}
    if clash := sorted(set(words) & parts):
        raise GenerationError(f"{WORD_LIST}: held-out names in the train word list: {', '.join(clash[:5])}")
    return words


def _heldout_names() -> frozenset[str]:
    pools = [PACKAGES, MODULES, WORDS, *ARGS.values(), *(t.names for t in TEMPLATES + HELDOUT_TEMPLATES),
             *(h.names for h in HELPERS)]
    return frozenset(name for pool in pools for name in pool[1])


def _made_up(rng: random.Random, syllables: int = 2) -> str:
    """A made-up lowercase word: never a keyword, a builtin or a held-out name."""
    while True:
        w = "".join(rng.choice(a) + rng.choice(b) + rng.choice(c) for a, b, c in [_SYLLABLES] * syllables)
        if not keyword.iskeyword(w) and not hasattr(builtins, w) and w not in _HELDOUT_NAMES:
            return w


_HELDOUT_NAMES = _heldout_names()


def _pick(rng: random.Random, pool: Pool, group: int) -> str:
    """A name of `pool` for `group` (0 train, 1 held-out), a made-up one (GENERATED), or one or
    two words of the word list (LISTED)."""
    if group == GENERATED:
        return _made_up(rng, rng.choice((2, 2, 3)))
    if group == LISTED:
        words = _listed_words()
        return rng.choice(words) if rng.random() < 0.6 else f"{rng.choice(words)}_{rng.choice(words)}"
    return rng.choice(pool[group])


def roles(source: str) -> list[str]:
    """The argument roles a template or helper names, in a fixed order."""
    return sorted({f for _, f, _, _ in string.Formatter().parse(source) if f} - {"fn", "K"})


def _fill(source: str, names: Pool, group: int, rng: random.Random, const: Any = None,
          target: bool = False) -> tuple[str, dict]:  # fmt: skip
    while True:
        subs = {role: _pick(rng, ARGS[role], group) for role in roles(source)}
        if len(set(subs.values())) == len(subs):  # made-up names could meet; pools are disjoint
            break
    subs |= {"fn": _pick(rng, names, group), "K": repr(const)}
    if target and rng.random() < 0.5:  # the bug's function; distractors keep their names
        subs["fn"] = f"{subs['fn']}_{_pick(rng, WORDS, group)}"
    return source.format_map(subs), subs


def _outcome(func: Callable, args: tuple) -> tuple[str, str]:
    """("return", repr of the value) or ("raise", the exception's name)."""
    try:
        return "return", repr(func(*copy.deepcopy(args)))
    except (ArithmeticError, LookupError, TypeError, ValueError) as e:
        return "raise", type(e).__name__


def _call(fn: str, args: tuple) -> str:
    return f"{fn}({', '.join(map(repr, args))})"


def _assertion(call: str, outcome: tuple[str, str]) -> str:
    kind, text = outcome
    if kind == "raise":
        return f"        with self.assertRaises({text}):\n            {call}\n"
    return f"        self.assertEqual({call}, {text})\n"


def _test_module(pkg: str, module: str, cls: str, tests: dict[str, tuple[str, list[str]]]) -> str:
    """A unittest module; `tests` maps a test name to (the function it calls, its assertions)."""
    imports = ", ".join(sorted({fn for fn, _ in tests.values()}))
    body = "\n".join(f"    def {name}(self):\n{''.join(lines)}" for name, (_, lines) in sorted(tests.items()))
    return f"import unittest\n\nfrom {pkg}.{module} import {imports}\n\n\nclass {cls}(unittest.TestCase):\n{body}"


def _load(source: str) -> dict:
    namespace: dict = {}
    exec(compile(source, "<generated>", "exec"), namespace)  # noqa: S102 - the module this generator wrote
    return namespace


def _module(rng: random.Random, t: Template, group: int, distractors: int):
    """(correct module, buggy module, the target's substitutions, [(helper, its substitutions)]),
    or None when the bug's line is not unique."""
    consts = t.consts[0 if group in (GENERATED, LISTED) else group]
    const = rng.choice(consts) if consts else None
    target, subs = _fill(t.source, t.names, group, rng, const, target=True)
    fixed, buggy = t.fixed.format_map(subs), t.buggy.format_map(subs)
    helpers = [(h, *_fill(h.source, h.names, group, rng)) for h in rng.sample(HELPERS, distractors)]
    functions = [source for _, source, _ in helpers]
    functions.insert(rng.randint(0, distractors), target)
    good = "\n\n".join(functions)
    bad = good.replace(fixed, buggy)
    if good.count(fixed) != 1 or bad.count(buggy) != 1:
        return None
    return good, bad, subs | {"K": const}, [(h, s) for h, _, s in helpers]


def _pyfix_task(rng: random.Random, t: Template, group: int, distractors: int) -> Draft | None:
    if (drawn := _module(rng, t, group, distractors)) is None:
        return None
    good, bad, subs, helpers = drawn
    ok, broken, fn = _load(good), _load(bad), subs["fn"]
    calls = list({repr(a): a for a in t.calls(rng, subs["K"])}.values())
    rng.shuffle(calls)
    outcomes = [(a, _outcome(ok[fn], a), _outcome(broken[fn], a)) for a in calls]
    failing = [(a, want, got) for a, want, got in outcomes if want != got]
    kept = [(a, want) for a, want, got in outcomes if want == got]
    if not failing or not kept:
        return None
    pkg = (_pick(rng, PACKAGES, group) if rng.random() < 0.25
           else f"{_pick(rng, WORDS, group)}{rng.choice(SUFFIXES)}")
    if pkg in sys.stdlib_module_names:  # the word list's "keyword": the tests would import the standard library's
        return None
    module = _pick(rng, MODULES, group)
    path = f"{pkg}/{module}.py"
    args, want, got = failing[0]
    problem = rng.choice(PHRASINGS).format(call=_call(fn, args), fn=fn, path=path, want=_verb(want, "return", "raise"),
                                           got=_verb(got, "returns", "raises"))
    if len(problem) > MAX_PROBLEM_CHARS:
        return None
    visible = {f"test_{fn}": (fn, [_assertion(_call(fn, a), w) for a, w in kept[:2]])}
    for helper, s in helpers:
        visible[f"test_{s['fn']}"] = (s["fn"], [_assertion(_call(s["fn"], a), _outcome(ok[s["fn"]], a))
                                                for a in rng.sample(helper.calls, 2)])
    hidden = {f"test_{fn}_{tag}": (fn, [_assertion(_call(fn, a), w)])
              for (a, w, _), tag in zip(failing[:2], ("reported", "related"))}
    files = {".gitignore": "__pycache__/\n", f"{pkg}/__init__.py": "", path: bad, "tests/__init__.py": "",
             f"tests/test_{module}.py": _test_module(pkg, module, f"Test{module.title()}", visible)}
    hidden_files = {"tests/test_issue.py": _test_module(pkg, module, "TestIssue", hidden)}
    return Draft(files=files, fix={path: good}, hidden=hidden_files, problem=problem + "\n",
                 hidden_tests=len(hidden), visible_tests=len(visible))


def _verb(outcome: tuple[str, str], returns: str, raises: str) -> str:
    kind, text = outcome
    return f"{returns if kind == 'return' else raises} {text}"


def draw_pyfix(rng: random.Random, n: int, split: str, distractors: int, names: str = "pools") -> list[Draft]:
    group = {"generated": GENERATED, "words": LISTED}.get(names, 0) if split == "train" else 1
    templates = HELDOUT_TEMPLATES if split == "heldout-templates" else TEMPLATES
    drafts, seen, order = [], set(), []
    while len(drafts) < n:
        if not order:
            order = rng.sample(templates, len(templates))
        template = order.pop()
        for _ in range(MAX_DRAWS):
            draft = _pyfix_task(rng, template, group, distractors)
            key = draft and json.dumps(draft.files, sort_keys=True)
            if draft is not None and key not in seen:
                break
        else:
            raise GenerationError(f"template {template.name}: no new task in {MAX_DRAWS} draws; "
                                  "its pools are too small for this many tasks")
        seen.add(key)
        drafts.append(draft)
    return drafts


FAMILIES: dict[str, Family] = {"pyfix": Family(draw_pyfix, TEST_CMD, "django")}


# ---- building: repository, measured tests, bundle, row ------------------------------------

def git(repo: Path, *args: str) -> str:
    """git's output whole: a diff's last context line may be a lone space."""
    done = subprocess.run(["git", "-c", "init.defaultBranch=main", "-c", "pack.threads=1", *args], cwd=repo,
                          check=True, capture_output=True, text=True, env=os.environ | GIT_ENV)
    return done.stdout


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def run_tests(repo: Path, family: Family) -> tuple[dict[str, str], int]:
    """The family's test command, on the host: /usr/bin/python3 as in the sandbox, when present."""
    python = Path("/usr/bin/python3") if Path("/usr/bin/python3").exists() else Path(sys.executable)
    done = subprocess.run(["bash", "-c", family.test_cmd], cwd=repo, capture_output=True, text=True, timeout=300,
                          check=False, env={"PATH": f"{python.parent}:/usr/bin:/bin", "LC_ALL": "C.UTF-8"})
    return PARSERS[family.log_parser](done.stdout + done.stderr), done.returncode


def _measure(work: Path, draft: Draft, family: Family, name: str) -> tuple[list[str], list[str]]:
    before, _ = run_tests(work, family)
    _write(work, draft.fix)
    after, exit_code = run_tests(work, family)
    passed = {t for t, s in after.items() if s == "PASSED"}
    f2p = sorted(t for t in passed if before.get(t) != "PASSED")
    p2p = sorted(passed - set(f2p))
    if exit_code != 0 or passed != set(after) or (len(f2p), len(p2p)) != (draft.hidden_tests, draft.visible_tests):
        raise GenerationError(f"{name}: the gold fix must pass all {draft.hidden_tests + draft.visible_tests} "
                              f"tests and exactly the {draft.hidden_tests} hidden ones must fail without it; "
                              f"measured exit {exit_code}, before {before}, after {after}")
    return f2p, p2p


def build_task(draft: Draft, name: str, family: Family, tmp: Path, bundles_dir: Path) -> dict:
    work = tmp / name
    work.mkdir()
    git(work, "init", "-q")
    _write(work, draft.files)
    git(work, "add", "-A")
    git(work, "commit", "-qm", "Initial version")
    base = git(work, "rev-parse", "HEAD").strip()
    _write(work, draft.hidden)
    git(work, "add", "-A")
    test_patch = git(work, "diff", "--cached", "--binary", base)
    f2p, p2p = _measure(work, draft, family, name)
    gold = git(work, "diff", "--binary", base, "--", *draft.fix)
    git(work, "bundle", "create", "-q", str(bundles_dir / f"{name}.bundle"), "--all")
    return {
        "instance_id": f"{ORG}__{name}", "repo": f"{ORG}/{name}", "base_commit": base,
        "environment_setup_commit": base, "version": "1.0", "problem_statement": draft.problem,
        "hints_text": "", "created_at": "2026-01-01T00:00:00Z", "patch": gold, "test_patch": test_patch,
        "FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p, "source": f"bundle:{name}", "install": [],
        "test_cmd": family.test_cmd, "log_parser": family.log_parser,
    }


def generate(family: str, n: int, seed: int, split: str, out: Path, *, bundles_dir: Path | None = None,
             distractors: int | None = None, progress: Callable[[int, int], None] | None = None,
             names: str = "pools") -> list[dict]:
    """Write `out` (JSONL) and one bundle per task into `bundles_dir` (default: out's folder's
    `bundles`); return the rows. `progress(done, n)` is called after each task. names: "pools"
    (the split's name pools), "generated" (train only: every name made up, see GENERATED) or
    "words" (train only: names from a word list, see LISTED).
    Raises ValueError for bad arguments, GenerationError for a bad task."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; use one of {', '.join(FAMILIES)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    if names not in NAMES:
        raise ValueError(f"names must be one of {', '.join(NAMES)}, got {names!r}")
    if names != "pools" and split != "train":
        raise ValueError(f"names={names} is for the train split (held-out splits keep their pools), got {split!r}")
    fam = FAMILIES[family]
    distractors = fam.distractors if distractors is None else distractors
    if not 0 <= distractors <= fam.max_distractors:
        raise ValueError(f"distractors must be 0..{fam.max_distractors}, got {distractors}")
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    bundles_dir = bundles_dir or out.parent / "bundles"
    bundles_dir.mkdir(parents=True, exist_ok=True)
    own = names != "pools"
    drafts = fam.draw(random.Random(f"{family}:{split}:{seed}:{distractors}" + (f":{names}" if own else "")),
                      n, split, distractors, **({"names": names} if own else {}))
    label = {"pools": split, "generated": f"{split}-gen", "words": f"{split}-words"}[names]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, d in enumerate(drafts):
            rows.append(build_task(d, f"{family}-{label}-{seed}-d{distractors}-{i}", fam, Path(tmp), bundles_dir))
            if progress is not None:
                progress(i + 1, n)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))
    return rows


# ---- the scripted fix ------------------------------------------------------------------------

def demo_calls(row: dict) -> list[dict]:
    """The gold fix as tool calls (view, str_replace, submit), read from the row's patch alone.
    Raises ValueError for a patch that is not one hunk changing existing lines of one file."""
    lines = row["patch"].splitlines()
    files = [line for line in lines if line.startswith("diff --git ")]
    hunks = [i for i, line in enumerate(lines) if line.startswith("@@")]
    if len(files) != 1 or len(hunks) != 1:
        raise ValueError(f"{row['instance_id']}: the patch must change one file in one hunk, "
                         f"it has {len(files)} files and {len(hunks)} hunks")
    if any(line.startswith(("new file", "deleted file", "rename ", "Binary files")) for line in lines):
        raise ValueError(f"{row['instance_id']}: the patch creates, deletes, renames or holds a binary "
                         "file; str_replace edits only an existing text file")
    path = files[0].split(" b/", 1)[1]
    body = [line for line in lines[hunks[0] + 1:] if not line.startswith("\\")]
    changed = [i for i, line in enumerate(body) if line.startswith(("+", "-"))]
    region = body[changed[0]:changed[-1] + 1] if changed else []
    old = "\n".join(line[1:] for line in region if not line.startswith("+"))
    new = "\n".join(line[1:] for line in region if not line.startswith("-"))
    if not old.strip():
        raise ValueError(f"{row['instance_id']}: the patch only adds lines; str_replace needs an "
                         "existing line to replace")
    return [{"name": "str_replace_editor", "arguments": {"command": "view", "path": path}},
            {"name": "str_replace_editor", "arguments": {"command": "str_replace", "path": path,
                                                         "old_str": old, "new_str": new}},
            {"name": "submit", "arguments": {}}]
