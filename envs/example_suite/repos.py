"""The example suite's repositories: small Python libraries written for swerve, each with
baseline tests, and the bugs its tasks plant (the kinds found in real code: off-by-one,
wrong default, missing edge case, wrong exception) with the tests that expose them.

A task is (id, file, correct text, buggy text, problem statement, new tests). `build.py`
turns these into git bundles and a SWE-bench JSONL file.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bug:
    name: str
    path: str
    correct: str
    buggy: str
    problem: str
    tests: str
    """A new test module (tests/test_issue_<name>.py) that fails on the bug and passes after."""


@dataclass(frozen=True)
class Repo:
    name: str
    files: dict[str, str]
    bugs: list[Bug]


TEXTKIT = Repo("textkit", {
    "textkit/__init__.py": '"""Small text utilities."""\n',
    "textkit/trunc.py": '''def truncate(text, length, suffix="..."):
    """Cut text to at most `length` characters, ending with `suffix` when cut."""
    if length < len(suffix):
        raise ValueError("length must be at least len(suffix)")
    if len(text) <= length:
        return text
    return text[: length - len(suffix)] + suffix
''',
    "textkit/case.py": '''import re


def snake_to_camel(name):
    """snake_case -> camelCase (leading underscores are kept)."""
    stripped = name.lstrip("_")
    prefix = name[: len(name) - len(stripped)]
    head, *rest = stripped.split("_")
    return prefix + head + "".join(part[:1].upper() + part[1:] for part in rest)


def camel_to_snake(name):
    """camelCase or PascalCase -> snake_case; acronyms stay together (HTTPServer -> http_server)."""
    name = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\\1_\\2", name)
    name = re.sub(r"([a-z0-9])([A-Z])", r"\\1_\\2", name)
    return name.lower()
''',
    "textkit/words.py": '''from collections import Counter


def words(text):
    return [w.strip(".,;:!?\\"'()").lower() for w in text.split() if w.strip(".,;:!?\\"'()")]


def top_words(text, n=3):
    """The n most frequent words, most frequent first, ties in order of first appearance."""
    counts = Counter(words(text))
    order = {w: i for i, w in reversed(list(enumerate(words(text))))}
    return sorted(counts, key=lambda w: (-counts[w], order[w]))[:n]
''',
    "textkit/wrap.py": '''def wrap(text, width):
    """Greedy word wrap: lines of at most `width` characters (longer words stand alone)."""
    if width <= 0:
        raise ValueError("width must be positive")
    lines, line = [], ""
    for word in text.split():
        candidate = f"{line} {word}" if line else word
        if len(candidate) <= width:
            line = candidate
        else:
            if line:
                lines.append(line)
            line = word
    if line:
        lines.append(line)
    return lines
''',
    "tests/test_basics.py": '''from textkit.case import camel_to_snake, snake_to_camel
from textkit.trunc import truncate
from textkit.words import top_words, words
from textkit.wrap import wrap


def test_truncate_short_text_unchanged():
    assert truncate("hello", 10) == "hello"


def test_snake_to_camel_simple():
    assert snake_to_camel("parse_http_response") == "parseHttpResponse"


def test_camel_to_snake_simple():
    assert camel_to_snake("parseResponse") == "parse_response"


def test_words_strip_punctuation():
    assert words("Hello, world!") == ["hello", "world"]


def test_top_words_most_frequent_first():
    assert top_words("b a b c b a", 2) == ["b", "a"]


def test_wrap_two_lines():
    assert wrap("the quick brown fox", 10) == ["the quick", "brown fox"]
''',
}, [
    Bug("truncate-off-by-one", "textkit/trunc.py",
        "return text[: length - len(suffix)] + suffix", "return text[: length - len(suffix) - 1] + suffix",
        "truncate() returns strings one character shorter than asked.\n\n"
        "`truncate('abcdefghij', 8)` gives `'abcd...'` (7 characters); it should give `'abcde...'`, "
        "exactly 8 characters.\n",
        '''from textkit.trunc import truncate


def test_truncate_uses_the_whole_length():
    assert truncate("abcdefghij", 8) == "abcde..."
    assert len(truncate("x" * 50, 20)) == 20
'''),
    Bug("camel-acronym", "textkit/case.py",
        'name = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\\1_\\2", name)\n    ', "",
        "camel_to_snake splits acronyms letter by letter: `camel_to_snake('HTTPServer')` returns "
        "`'httpserver'`... it should return `'http_server'` as the docstring says.\n",
        '''from textkit.case import camel_to_snake


def test_acronyms_stay_together():
    assert camel_to_snake("HTTPServer") == "http_server"
    assert camel_to_snake("parseXMLDocument") == "parse_xml_document"
'''),
    Bug("top-words-default", "textkit/words.py", "def top_words(text, n=3):", "def top_words(text, n=1):",
        "top_words() without `n` returns one word. The documentation (and every caller) expects "
        "the three most frequent words by default.\n",
        '''from textkit.words import top_words


def test_default_is_three_words():
    assert top_words("a b c d a b a") == ["a", "b", "c"]
'''),
    Bug("wrap-zero-width", "textkit/wrap.py", "if width <= 0:", "if width < 0:",
        "wrap(text, 0) loops over the words and returns one word per line instead of refusing: "
        "a width of 0 is meaningless and should raise ValueError like negative widths do.\n",
        '''import pytest

from textkit.wrap import wrap


def test_zero_width_is_refused():
    with pytest.raises(ValueError):
        wrap("some words", 0)
'''),
])

NUMKIT = Repo("numkit", {
    "numkit/__init__.py": '"""Small numeric helpers."""\n',
    "numkit/stats.py": '''def mean(xs):
    xs = list(xs)
    if not xs:
        raise ValueError("mean of an empty sequence")
    return sum(xs) / len(xs)


def median(xs):
    xs = sorted(xs)
    if not xs:
        raise ValueError("median of an empty sequence")
    mid = len(xs) // 2
    if len(xs) % 2:
        return xs[mid]
    return (xs[mid - 1] + xs[mid]) / 2


def variance(xs, sample=True):
    """Sample variance by default (divides by n - 1); population variance with sample=False."""
    xs = list(xs)
    if len(xs) < (2 if sample else 1):
        raise ValueError("not enough data")
    m = mean(xs)
    return sum((x - m) ** 2 for x in xs) / (len(xs) - 1 if sample else len(xs))
''',
    "numkit/chunks.py": '''def chunked(seq, size):
    """Split seq into lists of `size` items; the last may be shorter."""
    if size < 1:
        raise ValueError("size must be >= 1")
    return [list(seq[i : i + size]) for i in range(0, len(seq), size)]


def windows(seq, size):
    """All contiguous windows of `size` items."""
    return [list(seq[i : i + size]) for i in range(len(seq) - size + 1)]
''',
    "numkit/money.py": '''from decimal import ROUND_HALF_UP, Decimal


def round_money(amount, places=2):
    """Round half away from zero, as accountants do (2.675 -> 2.68)."""
    quantum = Decimal(1).scaleb(-places)
    return float(Decimal(str(amount)).quantize(quantum, rounding=ROUND_HALF_UP))
''',
    "tests/test_basics.py": '''from numkit.chunks import chunked, windows
from numkit.money import round_money
from numkit.stats import mean, median, variance


def test_mean():
    assert mean([1, 2, 3, 4]) == 2.5


def test_median_odd():
    assert median([3, 1, 2]) == 2


def test_variance_population():
    assert variance([1, 2, 3, 4], sample=False) == 1.25


def test_chunked_even():
    assert chunked([1, 2, 3, 4], 2) == [[1, 2], [3, 4]]


def test_windows_pairs():
    assert windows([1, 2, 3], 2) == [[1, 2], [2, 3]]


def test_round_money_down():
    assert round_money(2.674) == 2.67
''',
}, [
    Bug("median-even", "numkit/stats.py", "return (xs[mid - 1] + xs[mid]) / 2", "return xs[mid]",
        "median() of an even number of values returns the upper middle value: `median([1, 2, 3, 4])` "
        "is 3 but should be 2.5.\n",
        '''from numkit.stats import median


def test_even_count_averages_the_middle_pair():
    assert median([1, 2, 3, 4]) == 2.5
    assert median([4, 1]) == 2.5
'''),
    Bug("variance-default", "numkit/stats.py", "def variance(xs, sample=True):", "def variance(xs, sample=False):",
        "variance() defaults to the population variance although the docstring promises the sample "
        "variance: `variance([1, 2, 3, 4])` gives 1.25 instead of 1.6666...\n",
        '''import pytest

from numkit.stats import variance


def test_sample_variance_is_the_default():
    assert variance([1, 2, 3, 4]) == pytest.approx(5 / 3)
'''),
    Bug("windows-last", "numkit/chunks.py", "range(len(seq) - size + 1)", "range(len(seq) - size)",
        "windows() drops the last window: `windows([1, 2, 3, 4], 2)` misses `[3, 4]`.\n",
        '''from numkit.chunks import windows


def test_last_window_is_included():
    assert windows([1, 2, 3, 4], 2) == [[1, 2], [2, 3], [3, 4]]
    assert windows([1, 2], 2) == [[1, 2]]
'''),
    Bug("round-half-up", "numkit/money.py", "rounding=ROUND_HALF_UP", "rounding=ROUND_HALF_EVEN",
        "round_money(2.675) returns 2.67. Money must round half away from zero (2.68), not to even.\n",
        '''from numkit.money import round_money


def test_halves_round_up():
    assert round_money(2.675) == 2.68
    assert round_money(0.125) == 0.13
'''),
])

CACHEKIT = Repo("cachekit", {
    "cachekit/__init__.py": '"""Small containers."""\n',
    "cachekit/lru.py": '''from collections import OrderedDict


class LRUCache:
    """A mapping that keeps at most `capacity` items, evicting the least recently used."""

    def __init__(self, capacity):
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._items = OrderedDict()

    def get(self, key, default=None):
        if key not in self._items:
            return default
        self._items.move_to_end(key)
        return self._items[key]

    def put(self, key, value):
        if key in self._items:
            self._items.move_to_end(key)
        self._items[key] = value
        if len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def __len__(self):
        return len(self._items)
''',
    "cachekit/ring.py": '''class RingBuffer:
    """Keeps the last `size` items appended."""

    def __init__(self, size):
        self.size = size
        self._data = []

    def append(self, item):
        self._data.append(item)
        if len(self._data) > self.size:
            self._data.pop(0)

    def items(self):
        return list(self._data)

    def latest(self):
        if not self._data:
            raise IndexError("ring buffer is empty")
        return self._data[-1]
''',
    "cachekit/intervals.py": '''def merge(intervals):
    """Merge overlapping or touching [start, end] intervals."""
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out
''',
    "tests/test_basics.py": '''from cachekit.intervals import merge
from cachekit.lru import LRUCache
from cachekit.ring import RingBuffer


def test_lru_keeps_recent():
    cache = LRUCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1 and len(cache) == 2


def test_ring_keeps_last():
    ring = RingBuffer(2)
    for i in range(4):
        ring.append(i)
    assert ring.items() == [2, 3]


def test_merge_overlapping():
    assert merge([[1, 3], [2, 5], [7, 8]]) == [[1, 5], [7, 8]]
''',
}, [
    Bug("lru-get-refresh", "cachekit/lru.py", "        self._items.move_to_end(key)\n        return self._items[key]",
        "        return self._items[key]",
        "LRUCache.get() does not count as a use: after `put(a)`, `put(b)`, `get(a)`, `put(c)` with "
        "capacity 2, `a` is evicted although `b` was the least recently used.\n",
        '''from cachekit.lru import LRUCache


def test_get_refreshes_recency():
    cache = LRUCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    cache.get("a")
    cache.put("c", 3)
    assert cache.get("a") == 1 and cache.get("b") is None
'''),
    Bug("ring-empty-error", "cachekit/ring.py", 'raise IndexError("ring buffer is empty")',
        'raise ValueError("ring buffer is empty")',
        "RingBuffer.latest() on an empty buffer raises ValueError; like list indexing it should raise "
        "IndexError (callers catch IndexError).\n",
        '''import pytest

from cachekit.ring import RingBuffer


def test_latest_of_empty_buffer_raises_index_error():
    with pytest.raises(IndexError):
        RingBuffer(3).latest()
'''),
    Bug("merge-touching", "cachekit/intervals.py", "if out and start <= out[-1][1]:", "if out and start < out[-1][1]:",
        "merge() does not merge touching intervals: `merge([[1, 2], [2, 3]])` returns two intervals; "
        "the docstring says touching intervals merge into `[[1, 3]]`.\n",
        '''from cachekit.intervals import merge


def test_touching_intervals_merge():
    assert merge([[1, 2], [2, 3]]) == [[1, 3]]
'''),
    Bug("lru-capacity-zero", "cachekit/lru.py", "if capacity < 1:", "if capacity < 0:",
        "LRUCache(0) is accepted and then every put() silently drops the value. A capacity below 1 "
        "should raise ValueError at construction.\n",
        '''import pytest

from cachekit.lru import LRUCache


def test_zero_capacity_is_refused():
    with pytest.raises(ValueError):
        LRUCache(0)
'''),
])

CONFKIT = Repo("confkit", {
    "confkit/__init__.py": '"""A tiny INI-style configuration reader."""\n',
    "confkit/parse.py": '''class ConfigError(Exception):
    pass


def parse(text):
    """Parse `[section]` headers and `key = value` lines; `#` starts a comment."""
    config, section = {}, None
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("[") and line.endswith("]"):
            section = config.setdefault(line[1:-1].strip(), {})
        elif "=" in line and section is not None:
            key, value = line.split("=", 1)
            section[key.strip()] = value.strip()
        else:
            raise ConfigError(f"line {number}: cannot parse {raw!r}")
    return config
''',
    "confkit/values.py": '''TRUE = {"1", "true", "yes", "on"}
FALSE = {"0", "false", "no", "off"}


def as_bool(value):
    lowered = value.strip().lower()
    if lowered in TRUE:
        return True
    if lowered in FALSE:
        return False
    raise ValueError(f"not a boolean: {value!r}")


def get(config, section, key, default=None):
    """config[section][key], or `default` when the section or the key is missing."""
    return config.get(section, {}).get(key, default)
''',
    "tests/test_basics.py": '''from confkit.parse import parse
from confkit.values import as_bool, get


def test_parse_sections():
    config = parse("[db]\\nhost = localhost\\n# comment\\n[cache]\\nsize=3\\n")
    assert config == {"db": {"host": "localhost"}, "cache": {"size": "3"}}


def test_as_bool_true():
    assert as_bool("Yes") is True


def test_get_present():
    assert get({"db": {"host": "h"}}, "db", "host") == "h"
''',
}, [
    Bug("bool-off", "confkit/values.py", 'FALSE = {"0", "false", "no", "off"}', 'FALSE = {"0", "false", "no"}',
        "as_bool('off') raises `ValueError: not a boolean` although `on` is accepted as true.\n",
        '''from confkit.values import as_bool


def test_off_is_false():
    assert as_bool("off") is False
    assert as_bool(" OFF ") is False
'''),
    Bug("get-missing-section", "confkit/values.py", "return config.get(section, {}).get(key, default)",
        "return config[section].get(key, default)",
        "get() raises KeyError when the section is missing instead of returning the default.\n",
        '''from confkit.values import get


def test_missing_section_gives_default():
    assert get({}, "db", "host", "localhost") == "localhost"
'''),
    Bug("key-outside-section", "confkit/parse.py", 'elif "=" in line and section is not None:', 'elif "=" in line:',
        "A `key = value` line before any `[section]` header crashes parse() with a TypeError. It "
        "should raise ConfigError naming the line, like other unparsable lines.\n",
        '''import pytest

from confkit.parse import ConfigError, parse


def test_key_before_section_is_a_config_error():
    with pytest.raises(ConfigError, match="line 1"):
        parse("key = value\\n[s]\\n")
'''),
    Bug("value-with-equals", "confkit/parse.py", 'key, value = line.split("=", 1)', 'key, value = line.split("=")[:2]',
        "Values that contain `=` are cut: `url = a=b` is read as `a` instead of `a=b`.\n",
        '''from confkit.parse import parse


def test_values_keep_equals_signs():
    assert parse("[s]\\nurl = http://x/?a=b&c=d\\n")["s"]["url"] == "http://x/?a=b&c=d"
'''),
])

GRIDKIT = Repo("gridkit", {
    "gridkit/__init__.py": '"""Grid helpers."""\n',
    "gridkit/grid.py": '''def neighbours(grid, row, col, diagonal=False):
    """Coordinates of the cells next to (row, col) inside the grid."""
    steps = [(-1, 0), (1, 0), (0, -1), (0, 1)]
    if diagonal:
        steps += [(-1, -1), (-1, 1), (1, -1), (1, 1)]
    rows, cols = len(grid), len(grid[0])
    return [(row + dr, col + dc) for dr, dc in steps
            if 0 <= row + dr < rows and 0 <= col + dc < cols]


def transpose(grid):
    return [list(column) for column in zip(*grid)] if grid else []
''',
    "gridkit/path.py": '''def manhattan(a, b):
    """Grid distance between two (row, col) cells."""
    return abs(a[0] - b[0]) + abs(a[1] - b[1])


def bounding_box(cells):
    """(min_row, min_col, max_row, max_col) of a non-empty collection of cells."""
    if not cells:
        raise ValueError("no cells")
    rows = [r for r, _ in cells]
    cols = [c for _, c in cells]
    return min(rows), min(cols), max(rows), max(cols)
''',
    "tests/test_basics.py": '''from gridkit.grid import neighbours, transpose
from gridkit.path import bounding_box, manhattan


def test_manhattan_forward():
    assert manhattan((0, 0), (2, 3)) == 5


def test_bounding_box():
    assert bounding_box([(1, 2), (3, 0)]) == (1, 0, 3, 2)


def test_corner_neighbours():
    assert sorted(neighbours([[0, 0], [0, 0]], 0, 0)) == [(0, 1), (1, 0)]


def test_transpose():
    assert transpose([[1, 2], [3, 4]]) == [[1, 3], [2, 4]]
''',
}, [
    Bug("neighbours-edge", "gridkit/grid.py", "if 0 <= row + dr < rows and 0 <= col + dc < cols]",
        "if 0 <= row + dr < rows and 0 <= col + dc <= cols]",
        "neighbours() returns cells outside the grid on the right edge: for a 2x2 grid, the "
        "neighbours of (0, 1) include (0, 2).\n",
        '''from gridkit.grid import neighbours


def test_right_edge_stays_inside():
    assert sorted(neighbours([[0, 0], [0, 0]], 0, 1)) == [(0, 0), (1, 1)]
'''),
    Bug("transpose-empty", "gridkit/grid.py", "return [list(column) for column in zip(*grid)] if grid else []",
        "return [list(column) for column in zip(*grid)] if grid[0] else []",
        "transpose([]) raises IndexError; the transpose of an empty grid is an empty grid.\n",
        '''from gridkit.grid import transpose


def test_empty_grid():
    assert transpose([]) == []
'''),
    Bug("manhattan-abs", "gridkit/path.py", "return abs(a[0] - b[0]) + abs(a[1] - b[1])",
        "return abs(a[0] - b[0]) + (a[1] - b[1])",
        "manhattan() can be negative: `manhattan((0, 3), (0, 0))` gives 3 but `manhattan((0, 0), (0, 3))` "
        "gives -3. Distances must be symmetric.\n",
        '''from gridkit.path import manhattan


def test_distance_is_symmetric():
    assert manhattan((0, 0), (0, 3)) == manhattan((0, 3), (0, 0)) == 3
'''),
    Bug("bbox-empty", "gridkit/path.py", 'if not cells:\n        raise ValueError("no cells")\n    ', "",
        "bounding_box([]) raises `ValueError: min() arg is an empty sequence` from deep inside; it should "
        "raise ValueError('no cells') before touching the data, as documented.\n",
        '''import pytest

from gridkit.path import bounding_box


def test_empty_collection_names_the_problem():
    with pytest.raises(ValueError, match="no cells"):
        bounding_box([])
'''),
])

REPOS = [TEXTKIT, NUMKIT, CACHEKIT, CONFKIT, GRIDKIT]
