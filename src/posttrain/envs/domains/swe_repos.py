"""Building blocks of `swe.ci_fix`: the small Python modules (with their tests) that repositories are
assembled from, and the AST mutations that inject one bug (off-by-one, wrong operator, swapped
arguments, missing case, wrong import).

Pure source-to-source functions; nothing here executes code. The domain module owns tasks and tools.
"""

from __future__ import annotations

import ast
import random
from dataclasses import dataclass

PKG = "app"


@dataclass(frozen=True)
class ModuleTemplate:
    name: str
    source: str  # may contain {A}, {B} placeholders filled with small ints
    tests: str
    deps: tuple[str, ...] = ()


TEMPLATES: list[ModuleTemplate] = [
    ModuleTemplate(
        "mathutil",
        """\
def clamp(x, lo, hi):
    if x < lo:
        return lo
    if x > hi:
        return hi
    return x


def mean(xs):
    if not xs:
        return 0
    return sum(xs) / len(xs)


def scale(x, factor):
    return x * factor + {A}
""",
        """\
from app.mathutil import clamp, mean, scale


def test_clamp_inside():
    assert clamp(5, 0, 10) == 5


def test_clamp_low():
    assert clamp(-3, 0, 10) == 0


def test_clamp_high():
    assert clamp(12, 0, 10) == 10


def test_mean():
    assert mean([2, 4, 9]) == 5


def test_mean_empty():
    assert mean([]) == 0


def test_scale():
    assert scale(3, 2) == 6 + {A}
""",
    ),
    ModuleTemplate(
        "textutil",
        """\
def slugify(s):
    words = s.lower().split()
    return "-".join(words)


def count_words(s):
    return len(s.split())


def truncate(s, n):
    if len(s) <= n:
        return s
    return s[:n - 1] + "~"
""",
        """\
from app.textutil import count_words, slugify, truncate


def test_slugify():
    assert slugify("Hello Big World") == "hello-big-world"


def test_count_words():
    assert count_words("a bb  ccc") == 3


def test_truncate_short():
    assert truncate("abc", 5) == "abc"


def test_truncate_long():
    assert truncate("abcdefgh", {B}) == "abcdefgh"[:{B} - 1] + "~"
""",
    ),
    ModuleTemplate(
        "listutil",
        """\
def chunk(xs, n):
    out = []
    for i in range(0, len(xs), n):
        out.append(xs[i:i + n])
    return out


def dedupe(xs):
    seen = []
    for x in xs:
        if x not in seen:
            seen.append(x)
    return seen


def last_n(xs, n):
    if n <= 0:
        return []
    return xs[-n:]
""",
        """\
from app.listutil import chunk, dedupe, last_n


def test_chunk():
    assert chunk([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]


def test_dedupe():
    assert dedupe([3, 1, 3, 2, 1]) == [3, 1, 2]


def test_last_n():
    assert last_n([1, 2, 3, 4], 2) == [3, 4]


def test_last_zero():
    assert last_n([1, 2, 3], 0) == []
""",
    ),
    ModuleTemplate(
        "dates",
        """\
def is_leap(year):
    if year % 400 == 0:
        return True
    if year % 100 == 0:
        return False
    return year % 4 == 0


def days_in_month(year, month):
    if month == 2:
        return 29 if is_leap(year) else 28
    if month in (4, 6, 9, 11):
        return 30
    return 31
""",
        """\
from app.dates import days_in_month, is_leap


def test_leap_400():
    assert is_leap(2000)


def test_not_leap_100():
    assert not is_leap(1900)


def test_leap_4():
    assert is_leap(2024)


def test_february():
    assert days_in_month(2023, 2) == 28


def test_april():
    assert days_in_month(2023, 4) == 30


def test_may():
    assert days_in_month(2023, 5) == 31
""",
    ),
    ModuleTemplate(
        "inventory",
        """\
from app.mathutil import clamp


def restock(stock, amount, capacity):
    return clamp(stock + amount, 0, capacity)


def total_value(items):
    total = 0
    for price, qty in items:
        total += price * qty
    return total


def low_stock(items, threshold):
    return [name for name, qty in items if qty < threshold]
""",
        """\
from app.inventory import low_stock, restock, total_value


def test_restock():
    assert restock(5, 3, 100) == 8


def test_restock_capacity():
    assert restock(90, {A}0, 95) == 95


def test_total_value():
    assert total_value([(2, 3), (5, 1)]) == 11


def test_low_stock():
    assert low_stock([("a", 1), ("b", {B}), ("c", 9)], {B}) == ["a"]
""",
        deps=("mathutil",),
    ),
    ModuleTemplate(
        "grades",
        """\
from app.mathutil import mean


def letter(score):
    if score >= 90:
        return "A"
    if score >= 75:
        return "B"
    if score >= 50:
        return "C"
    return "F"


def average_letter(scores):
    return letter(mean(scores))
""",
        """\
from app.grades import average_letter, letter


def test_letter_a():
    assert letter(95) == "A"


def test_letter_b_edge():
    assert letter(75) == "B"


def test_letter_f():
    assert letter(10) == "F"


def test_average_letter():
    assert average_letter([80, 90, 70]) == "B"
""",
        deps=("mathutil",),
    ),
    ModuleTemplate(
        "pricing",
        """\
def discount(price, percent):
    return price - price * percent / 100


def with_tax(price, rate):
    return round(price * (1 + rate), 2)


def bulk_price(unit, qty):
    if qty >= {B}:
        return discount(unit * qty, 10)
    return unit * qty
""",
        """\
from app.pricing import bulk_price, discount, with_tax


def test_discount():
    assert discount(200, 25) == 150


def test_with_tax():
    assert with_tax(100, 0.2) == 120.0


def test_bulk_small():
    assert bulk_price(10, 1) == 10


def test_bulk_large():
    assert bulk_price(10, {B}) == 10 * {B} * 0.9
""",
    ),
    ModuleTemplate(
        "stats",
        """\
from app.listutil import dedupe


def median(xs):
    s = sorted(xs)
    mid = len(s) // 2
    if len(s) % 2 == 1:
        return s[mid]
    return (s[mid - 1] + s[mid]) / 2


def spread(xs):
    return max(xs) - min(xs)


def distinct_count(xs):
    return len(dedupe(xs))
""",
        """\
from app.stats import distinct_count, median, spread


def test_median_odd():
    assert median([5, 1, 3]) == 3


def test_median_even():
    assert median([4, 1, 3, 2]) == 2.5


def test_spread():
    assert spread([4, {A}, 9]) == 9 - min(4, {A})


def test_distinct_count():
    assert distinct_count([1, 1, 2, 3, 3]) == 3
""",
        deps=("listutil",),
    ),
]
BY_NAME = {t.name: t for t in TEMPLATES}


def fill(text: str, a: int, b: int) -> str:
    return text.replace("{A}", str(a)).replace("{B}", str(b))


def choose_modules(rng: random.Random, n: int) -> list[str]:
    """n module names, closed under dependencies (a module's deps are always included)."""
    names: list[str] = []
    for t in rng.sample(TEMPLATES, len(TEMPLATES)):
        need = [d for d in t.deps if d not in names] + [t.name]
        if t.name in names or len(names) + len(need) > n:
            continue
        names.extend(need)
        if len(names) >= n:
            break
    return sorted(names)


# ---- mutations -------------------------------------------------------------------------------------

MUTATION_KINDS = ("wrong_operator", "off_by_one", "swapped_args", "missing_case", "wrong_import")
_OP_SWAP = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Add,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Div,
    ast.Mod: ast.FloorDiv,
}
_CMP_SWAP = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}


@dataclass(frozen=True)
class Mutation:
    kind: str
    site: int  # index among this kind's candidate nodes in the module, in ast.walk order

    def describe(self) -> str:
        return f"{self.kind}#{self.site}"


def _sites(tree: ast.AST, kind: str) -> list[ast.AST]:
    nodes = list(ast.walk(tree))
    if kind == "wrong_operator":
        return [
            n
            for n in nodes
            if (isinstance(n, ast.BinOp) and type(n.op) in _OP_SWAP)
            or (isinstance(n, ast.Compare) and type(n.ops[0]) in _CMP_SWAP)
        ]
    if kind == "off_by_one":
        return [n for n in nodes if isinstance(n, ast.Constant) and type(n.value) is int]
    if kind == "swapped_args":
        return [
            n
            for n in nodes
            if isinstance(n, ast.Call)
            and len(n.args) >= 2
            and not any(isinstance(a, ast.Starred) for a in n.args)
        ]
    if kind == "missing_case":
        return [
            n
            for n in nodes
            if isinstance(n, ast.FunctionDef | ast.For)
            and any(isinstance(s, ast.If) and not s.orelse for s in n.body)
            and len(n.body) > 1
        ]
    if kind == "wrong_import":
        return [
            n for n in nodes if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith(PKG + ".")
        ]
    raise ValueError(f"unknown mutation kind '{kind}' (valid: {', '.join(MUTATION_KINDS)})")


def candidate_mutations(source: str) -> list[Mutation]:
    tree = ast.parse(source)
    return [Mutation(k, i) for k in MUTATION_KINDS for i in range(len(_sites(tree, k)))]


def apply_mutation(source: str, mutation: Mutation, module_functions: dict[str, list[str]]) -> str | None:
    """The mutated source, or None when this mutation does not apply here (e.g. nothing to import
    instead). `module_functions` maps `app.<module>` to its public function names (for wrong_import)."""
    tree = ast.parse(source)
    sites = _sites(tree, mutation.kind)
    if mutation.site >= len(sites):
        return None
    node = sites[mutation.site]
    if mutation.kind == "wrong_operator":
        if isinstance(node, ast.BinOp):
            node.op = _OP_SWAP[type(node.op)]()
        else:
            node.ops[0] = _CMP_SWAP[type(node.ops[0])]()
    elif mutation.kind == "off_by_one":
        node.value = node.value + 1
    elif mutation.kind == "swapped_args":
        node.args[0], node.args[1] = node.args[1], node.args[0]
    elif mutation.kind == "missing_case":
        idx = next(i for i, s in enumerate(node.body) if isinstance(s, ast.If) and not s.orelse)
        del node.body[idx]
    elif mutation.kind == "wrong_import":
        others = [f for f in module_functions.get(node.module, []) if f not in {a.name for a in node.names}]
        if not others:
            return None
        alias = node.names[0]
        node.names[0] = ast.alias(name=others[0], asname=alias.asname or alias.name)
    return ast.unparse(tree) + "\n"


def public_functions(source: str) -> list[str]:
    return [
        n.name
        for n in ast.parse(source).body
        if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")
    ]
